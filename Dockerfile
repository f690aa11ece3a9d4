# pdproc: the Envoy external processor (ext_proc) for vLLM Mooncake prefill/decode
# disaggregation.
#
#   make image                       # docs/container.md: offline too, and how to push it
#   docker build -t pdproc:dev .     # from PyPI
#   docker run --rm -p 9002:9002 -p 9090:9090 pdproc:dev serve --metrics-listen 0.0.0.0:9090
#
# Every `pdproc serve` flag is also a PDPROC_* environment variable. The image runs as an
# unprivileged user and writes nothing to its filesystem (Kubernetes runs it read-only).
#
# The image installs the wheel, never the source tree. Two ways to get the wheels:
# - from PyPI (the default): the `wheels` stage builds them exactly as `make dist` builds the
#   ones `make test` tests (`python -m build`: the sdist, then the wheel from the sdist), and
#   the dependencies come from PyPI;
# - offline (`--build-arg WHEELHOUSE=build/wheelhouse`, what `make image` does): a folder of
#   the build context holding the pdproc and pdproc-sim wheels and a wheel of every
#   dependency (scripts/compose/wheelhouse.sh makes it); nothing is downloaded, and a
#   dependency missing from it fails the build.
# PYTHON_IMAGE may be any Debian-like image with python3 (3.11+) and its venv module: the
# offline build uses a debootstrap'd Debian (scripts/compose/base-image.sh).
#
# The default (last) stage is pdproc alone; `--target sim` adds the simulator (pdproc-sim)
# for the compose dev stack (docker-compose.yaml's sim service).
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS wheels
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# An empty folder unless the build names a wheelhouse.
ARG WHEELHOUSE=deploy/container/no-wheelhouse
COPY ${WHEELHOUSE}/ /wheelhouse/
WORKDIR /src
# What the sdist needs: pyproject.toml, README.md (the readme), the license files, the package.
COPY pyproject.toml README.md LICENSE ./
COPY protos/LICENSE ./protos/LICENSE
COPY pdproc ./pdproc
COPY sim ./sim
RUN mkdir /dist \
 && if ls /wheelhouse/pdproc-*.whl >/dev/null 2>&1; then \
      cp /wheelhouse/pdproc-*.whl /wheelhouse/pdproc_sim-*.whl /dist/; \
    else \
      python3 -m venv /opt/build \
      && /opt/build/bin/pip install "build>=1.2" \
      && /opt/build/bin/python -m build --outdir /dist . \
      && /opt/build/bin/python -m build --outdir /dist sim; \
    fi

FROM ${PYTHON_IMAGE} AS venv
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheels /dist /dist
COPY --from=wheels /wheelhouse /wheelhouse
# A virtualenv copied whole into the runtime stage (same base image, same path). With a
# wheelhouse, pip never asks an index (--no-index).
RUN python3 -m venv /opt/pdproc \
 && if ls /wheelhouse/*.whl >/dev/null 2>&1; then set -- --no-index; fi \
 && /opt/pdproc/bin/pip install "$@" --find-links /wheelhouse "$(ls /dist/pdproc-*.whl)"

FROM venv AS sim-venv
RUN if ls /wheelhouse/*.whl >/dev/null 2>&1; then set -- --no-index; fi \
 && /opt/pdproc/bin/pip install "$@" --find-links /wheelhouse /dist/pdproc_sim-*.whl

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
