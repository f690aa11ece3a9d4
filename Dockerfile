# pdproc: the Envoy external processor (ext_proc) for vLLM Mooncake prefill/decode
# disaggregation.
#
#   docker build -t pdproc:dev .
#   docker run --rm -p 9002:9002 -p 9090:9090 pdproc:dev serve --metrics-listen 0.0.0.0:9090
#
# Every `pdproc serve` flag is also a PDPROC_* environment variable. The image runs as an
# unprivileged user and writes nothing to its filesystem (Kubernetes runs it read-only).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# README.md is the package's readme in pyproject.toml, so the build needs it.
COPY pyproject.toml README.md ./
COPY pdproc ./pdproc
# A virtualenv copied whole into the runtime stage (same base image, same path).
# `fast` adds uvloop, the event loop `pdproc serve` uses when it is installed.
# xds-protos ships an old copy of opentelemetry/proto/*: reinstall the real one last so the
# OTLP trace exporters can load.
RUN python -m venv /opt/pdproc \
 && /opt/pdproc/bin/pip install ".[fast]" \
 && /opt/pdproc/bin/pip install --force-reinstall --no-deps opentelemetry-proto

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 pdproc \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin pdproc
COPY --from=build /opt/pdproc /opt/pdproc
ENV PATH=/opt/pdproc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 9002: gRPC (ext_proc + grpc.health.v1); 9090: /metrics /healthz /readyz (--metrics-listen).
EXPOSE 9002 9090
ENTRYPOINT ["pdproc"]
CMD ["serve"]
