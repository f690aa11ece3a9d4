# Two entry points for a newcomer: `make demo` and `make test`. Both install what is missing
# into .venv first (Python 3.11+ with venv is all a fresh machine needs).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint unit bench bench-smoke envoy-config clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -e ./sim
	@# xds-protos ships an old copy of opentelemetry/proto/*; whichever wheel pip unpacks last
	@# wins. The OTLP exporters need opentelemetry-proto's own files.
	$(PY) -m pip install --quiet --force-reinstall --no-deps opentelemetry-proto
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pdproc demo

lint: $(STAMP)
	$(VENV)/bin/ruff check pdproc tests $(wildcard bench)
	$(VENV)/bin/ruff format --check pdproc tests $(wildcard bench)
	$(VENV)/bin/mypy

test: lint
	if [ -f scripts/validate-deploy.sh ]; then bash scripts/validate-deploy.sh; fi
	$(PY) -m pytest -q -p no:cacheprovider tests

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit tests/integration

bench: $(STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.run

bench-smoke: $(STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.run --smoke

# The reference config in envoy/ is generated; this regenerates it after a template change.
envoy-config: $(STAMP)
	$(VENV)/bin/pdproc envoy-config --listen 0.0.0.0:10000 --processor 127.0.0.1:9002 \
	  --decode 127.0.0.1:8200 --admin 127.0.0.1:9901 > envoy/pdproc.yaml

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
