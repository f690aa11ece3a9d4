"""The compose stack (docker-compose.yaml) as `make test-compose` runs it: real containers
built from the wheels, a real Docker engine, Compose v1 or v2. These tests only drive a stack
that scripts/compose/run.sh started; without one (PDPROC_COMPOSE_PROJECT unset, as in
`make test`) they are skipped.

Everything reaches the containers the way a user does: the ports docker-compose.yaml
publishes on 127.0.0.1 (picked free by run.sh) and the compose / docker commands."""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[2]
PROJECT_ENV = "PDPROC_COMPOSE_PROJECT"
# Bounds for state reached by other processes (containers starting, Envoy re-resolving a
# name): generous, since the machine is shared, and never a measured duration.
START_S = 180.0
COMMAND_S = 240.0


def port(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


@dataclass(frozen=True)
class ComposeStack:
    compose: tuple[str, ...]  # the compose command, with its project and file
    docker: str
    http: str
    admin: str
    metrics: str
    prefill: str
    decode: str

    def run(self, *args: str, timeout_s: float = COMMAND_S) -> str:
        """A compose subcommand; its output, or a failure with the output."""
        return _run([*self.compose, *args], timeout_s)

    def docker_run(self, *args: str, timeout_s: float = COMMAND_S) -> str:
        return _run([self.docker, *args], timeout_s)

    def container(self, service: str) -> str:
        ids = self.run("ps", "-a", "-q", service).split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, service: str) -> dict[str, Any]:
        raw = self.docker_run("inspect", "--format", "{{json .State}}", self.container(service))
        state: dict[str, Any] = orjson.loads(raw)
        return state

    def healthy(self, service: str) -> bool:
        state = self.state(service)
        return bool(state.get("Running")) and state.get("Health", {}).get("Status") == "healthy"

    def logs(self, service: str) -> str:
        return self.run("logs", "--no-color", service)

    # --- HTTP

    def metrics_page(self) -> str:
        response = httpx.get(self.metrics + "/metrics", timeout=10)
        response.raise_for_status()
        return response.text

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples `name{labels}` of pdproc's /metrics (0 when absent)."""
        return sum(
            sample.value
            for family in text_string_to_metric_families(self.metrics_page())
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )

    def envoy_stat(self, name: str) -> int:
        stats = httpx.get(self.admin + "/stats?format=json", timeout=10).json()["stats"]
        values = [s["value"] for s in stats if s.get("name") == name]
        assert values, f"Envoy has no stat {name}"
        return int(values[0])

    def sim_requests(self, role: str) -> list[dict[str, Any]]:
        """The requests the simulated prefill or decode recorded, oldest first."""
        base = self.prefill if role == "prefill" else self.decode
        response = httpx.get(base + "/sim/requests", timeout=10)
        response.raise_for_status()
        records: list[dict[str, Any]] = response.json()["requests"]
        return records

    def sim_faults(self, **faults: Any) -> None:
        response = httpx.post(self.prefill + "/sim/faults", json=faults, timeout=10)
        response.raise_for_status()

    def ready(self) -> bool:
        try:
            envoy = httpx.get(self.admin + "/ready", timeout=5).status_code == 200
            pdproc = httpx.get(self.metrics + "/readyz", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False
        return envoy and pdproc


def _run(argv: list[str], timeout_s: float) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise AssertionError(
            f"{shlex.join(argv)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    return done.stdout


@pytest.fixture(scope="session")
def stack() -> ComposeStack:
    project = os.environ.get(PROJECT_ENV)
    if not project:
        pytest.skip("needs the stack `make test-compose` starts (PDPROC_COMPOSE_PROJECT)")
    compose = shlex.split(os.environ.get("COMPOSE", "docker-compose"))
    compose_file = os.environ.get("PDPROC_COMPOSE_FILE", str(REPO / "docker-compose.yaml"))
    local = "http://127.0.0.1:{}".format
    found = ComposeStack(
        compose=(*compose, "-p", project, "-f", compose_file),
        docker=os.environ.get("DOCKER", "docker"),
        http=local(port("PDPROC_HTTP_PORT", 10000)),
        admin=local(port("PDPROC_ENVOY_ADMIN_PORT", 9901)),
        metrics=local(port("PDPROC_METRICS_PORT", 9090)),
        prefill=local(port("PDPROC_SIM_PREFILL_PORT", 8100)),
        decode=local(port("PDPROC_SIM_DECODE_PORT", 8200)),
    )
    for service in ("sim", "pdproc"):
        eventually(lambda s=service: found.healthy(s), START_S, 1.0)  # type: ignore[misc]
    eventually(found.ready, START_S, 1.0)
    return found


@pytest.fixture(autouse=True)
def serving(stack: ComposeStack) -> Iterator[ComposeStack]:
    """Each test starts on a whole stack (a test before it may have stopped pdproc) and
    leaves the simulator without faults."""
    if not stack.state("pdproc").get("Running"):
        stack.run("start", "pdproc")
    eventually(lambda: stack.healthy("pdproc"), START_S, 1.0)
    eventually(stack.ready, START_S, 1.0)
    yield stack
    stack.sim_faults(prefill_hang=False)
