# pdproc: the Envoy external processor (ext_proc) for vLLM Mooncake prefill/decode
# disaggregation.
#
#   docker build -t pdproc:dev .
#   docker run --rm -p 9002:9002 -p 9090:9090 pdproc:dev serve --metrics-listen 0.0.0.0:9090
#
# Every `pdproc serve` flag is also a PDPROC_* environment variable. The image runs as an
# unprivileged user and writes nothing to its filesystem (Kubernetes runs it read-only).
#
# The image installs the wheel, built exactly as `make dist` builds the one `make test`
# tests (`python -m build`: the sdist, then the wheel from the sdist) (uvloop comes with it);
# never `pip install .[fast]` of the source tree. The default (last) stage is
# pdproc alone; `--target sim` adds the simulator (pdproc-sim) for the compose dev stack.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m pip install "build>=1.2"
# What the sdist needs: pyproject.toml, README.md (the readme), the license files, the package.
COPY pyproject.toml README.md LICENSE ./
COPY protos/LICENSE ./protos/LICENSE
COPY pdproc ./pdproc
COPY sim ./sim
RUN python -m build --outdir /dist . \
 && python -m build --outdir /dist sim

FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheels /dist /dist
# A virtualenv copied whole into the runtime stage (same base image, same path).
RUN python -m venv /opt/pdproc \
 && /opt/pdproc/bin/pip install "$(ls /dist/pdproc-*.whl)"

FROM venv AS sim-venv
RUN /opt/pdproc/bin/pip install /dist/pdproc_sim-*.whl

FROM ${PYTHON_IMAGE} AS runtime-base
RUN groupadd --system --gid 10001 pdproc \
 && useradd --system --uid 10001 --gid 10001 --no-create-home \
      --home-dir /nonexistent --shell /usr/sbin/nologin pdproc
ENV PATH=/opt/pdproc/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
# 9002: gRPC (ext_proc + grpc.health.v1); 9090: /metrics /healthz /readyz (--metrics-listen).
EXPOSE 9002 9090
ENTRYPOINT ["pdproc"]
CMD ["serve"]

# pdproc plus the simulated vLLM pair (`pdproc sim pair`): docker-compose.yaml's sim service.
FROM runtime-base AS sim
COPY --from=sim-venv /opt/pdproc /opt/pdproc

# The default image: pdproc alone.
FROM runtime-base
COPY --from=venv /opt/pdproc /opt/pdproc
