"""Every route of the generated Envoy config either goes
through pdproc and the kv guard, or cannot reach a pod with KV transfer fields.

vLLM 0.32 reads `kv_transfer_params` on far more routes than the P/D ones (`/invocations`,
`/v1/messages`, `/cohere/v2/chat`, the `/render` variants ...), SGLang its `bootstrap_*` on
`/generate`, `/api/generate`, `/vertex_generate` ... (read from their source). Before, all of
them took the catch-all route `other`, where neither pdproc nor the guard looked. Now the
config denies by default: the P/D routes (pdproc + guard), the open paths (`--open-path`:
the guard), and a 404 for everything else.

The test reads the routes from the config the running Envoy loaded, classifies each one, and
then attacks each one through that Envoy: with pdproc up and with pdproc stopped (ext_proc
fails open), with every gateway field and SGLang's override headers, the fields pointing at
a canary. Nothing may reach a pod carrying them, and the canary stays silent.
"""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import yaml
from pdproc_sim.devstack import Stack, running_stack

from pdproc.gateway_fields import GATEWAY_FIELDS, GATEWAY_HEADERS, NESTED_CARRIERS
from tests.stacks import Canary

from .conftest import CHAT, SIM_ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXT_PROC = "envoy.filters.http.ext_proc"
LUA = "envoy.filters.http.lua"
# Routes of the real servers that read transfer fields, and a few that do not exist: each
# must land on a route that cannot carry them to a pod.
SERVER_ROUTES = [
    "/invocations",
    "/v1/messages",
    "/cohere/v2/chat",
    "/v1/chat/completions/render",
    "/v1/completions/render",
    "/v1/messages/render",
    "/inference/v1/abort_requests",
    "/generate",
    "/api/generate",
    "/api/chat",
    "/vertex_generate",
    "/v1/embeddings",
    "/pdproc-unknown",
]


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    server = Canary()
    yield server
    server.close()


@pytest.fixture(
    scope="module",
    params=[("two-message", "mooncake"), ("single-message", "sglang")],
    ids=["two-message-mooncake", "single-message-sglang"],
)
def stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    mode, connector = request.param
    options = {"single_message": mode == "single-message"}
    args = ["--shutdown-delay", "0", "--drain-timeout", "2", "--prefill-timeout", "5"]
    with running_stack(SIM_ARGS, args, envoy_options=options, kv_connector=connector) as st:
        yield st


def loaded_config(stack: Stack) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(stack.envoy.config_path.read_text())
    return config


def virtual_host(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    hcm = chain["filters"][0]["typed_config"]
    (vhost,) = hcm["route_config"]["virtual_hosts"]
    names = [f["name"] for f in hcm["http_filters"]]
    assert names[-3:] == [EXT_PROC, LUA, "envoy.filters.http.router"]
    result: dict[str, Any] = vhost
    return result


def disabled(route: dict[str, Any], name: str) -> bool:
    return bool(route.get("typed_per_filter_config", {}).get(name, {}).get("disabled"))


def classify(route: dict[str, Any]) -> str:
    """'pdproc' (pdproc and the guard), 'guard' (the guard alone) or 'no-pod' (answered by
    Envoy itself); any route that reaches a pod without the guard fails the test."""
    if "direct_response" in route:
        assert "route" not in route
        return "no-pod"
    assert "route" in route, route
    assert not disabled(route, LUA), f"route {route['name']} reaches a pod without the kv guard"
    return "guard" if disabled(route, EXT_PROC) else "pdproc"


def paths_for(route: dict[str, Any], pd_paths: list[str]) -> list[str]:
    """Request paths that Envoy routes to `route` (first match wins; the order is the
    config's: exact P/D and open paths, the P/D variants, then the catch-all)."""
    match = route["match"]
    if "path" in match:
        return [match["path"]]
    if "safe_regex" in match:
        return [p + "/" for p in pd_paths] + [pd_paths[0].upper(), pd_paths[0] + "%0A"]
    assert match == {"prefix": "/"}, match
    return SERVER_ROUTES


def attack_bodies(canary: Canary) -> dict[str, bytes]:
    """One body per gateway field, each pointing the decode at the canary."""
    values: dict[str, Any] = {
        "kv_transfer_params": {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_bootstrap_addr": f"http://127.0.0.1:{canary.port}",
            "remote_engine_id": "x",
            "remote_request_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": canary.port,
            "remote_block_ids": [1],
            "transfer_id": "t",
        },
        "ec_transfer_params": {"remote_host": "127.0.0.1", "remote_port": canary.port},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": canary.port,
        "bootstrap_room": 7,
        "bootstrap_pair_key": "k",
        "disagg_prefill_dp_rank": 0,
        "decode_tp_size": 1,
        "kv_router_hint": {"source_control_endpoint": f"tcp://127.0.0.1:{canary.port}"},
    }
    assert set(values) == set(GATEWAY_FIELDS)
    # Where vLLM also reads them: the OpenAI routes' vllm_xargs, the token-in route's
    # sampling_params.extra_args.
    nested = {"kv_transfer_params": values["kv_transfer_params"]}
    sglang = {k: values[k] for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")}
    bodies = {name: orjson.dumps({**CHAT, name: value}) for name, value in values.items()}
    bodies["sglang-all-three"] = orjson.dumps({**CHAT, **sglang})
    bodies["vllm_xargs"] = orjson.dumps({**CHAT, "vllm_xargs": nested})
    bodies["sampling_params.extra_args"] = orjson.dumps(
        {**CHAT, "sampling_params": {"max_tokens": 4, "extra_args": nested}}
    )
    return bodies


def override_headers(canary: Canary) -> dict[str, str]:
    values = {
        "x-override-bootstrap-host": "127.0.0.1",
        "x-override-bootstrap-port": str(canary.port),
        "x-override-bootstrap-room": "7",
        "x-override-disagg-prefill-dp-rank": "0",
    }
    assert set(values) == set(GATEWAY_HEADERS)
    return values


def request(stack: Stack, method: str, path: str, body: bytes, headers: dict[str, str]) -> int:
    conn = http.client.HTTPConnection(stack.envoy.listen.host, stack.envoy.listen.port, timeout=60)
    try:
        sent = {"content-type": "application/json", **headers}
        conn.request(method, path, body=body, headers=sent)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def decode_hits(stack: Stack) -> int:
    return stack.envoy.stats("cluster.decode.").get("cluster.decode.upstream_rq_total", 0)


def carried(stack: Stack) -> list[dict[str, Any]]:
    """What reached the simulated pods carrying a gateway field or override header (no
    request here names a prefill target, so pdproc adds no fields of its own)."""
    found = []
    for role in ("decode", "prefill"):
        for record in stack.sim_get(role, "/sim/requests")["requests"]:
            body = record.get("body")
            fields = set(body) & set(GATEWAY_FIELDS) if isinstance(body, dict) else set()
            for carrier in NESTED_CARRIERS:
                inner: Any = body
                for name in carrier:
                    inner = inner.get(name) if isinstance(inner, dict) else None
                if isinstance(inner, dict):
                    fields |= set(inner) & set(GATEWAY_FIELDS)
            headers = {h.lower() for h in record.get("headers", {})} & set(GATEWAY_HEADERS)
            if fields or headers:
                found.append(record)
    return found


def test_every_route_goes_through_pdproc_and_the_guard_or_reaches_no_pod(stack: Stack) -> None:
    vhost = virtual_host(loaded_config(stack))
    kinds = {route["name"]: classify(route) for route in vhost["routes"]}
    assert kinds["pd"] == "pdproc"
    assert kinds["open"] == "guard"
    assert kinds["pd-variant"] == kinds["not-routed"] == "no-pod"
    # The override headers SGLang reads are stripped for every route.
    assert set(GATEWAY_HEADERS) <= set(vhost["request_headers_to_remove"])
    # The catch-all is last and refuses: no path falls through to a pod unlisted.
    assert vhost["routes"][-1]["match"] == {"prefix": "/"}
    assert "direct_response" in vhost["routes"][-1]


def attack_route(
    stack: Stack,
    canary: Canary,
    route: dict[str, Any],
    pd_paths: list[str],
    headers: dict[str, str],
    answers: dict[tuple[str, str, str], int],
) -> None:
    """Every path, method and attack body on one route: refused by pdproc or the guard
    (400), or no such route (404); the statuses land in `answers`."""
    kind = classify(route)
    for path in paths_for(route, pd_paths):
        methods = ["POST", "PUT"] if kind != "no-pod" else ["POST"]
        for method in methods:
            for name, body in attack_bodies(canary).items():
                status = request(stack, method, path, body, headers)
                answers[(method, path, name)] = status
                expected = {400} if kind != "no-pod" else {404}
                assert status in expected, (route["name"], method, path, name, status)


def reset_pods(stack: Stack) -> None:
    for role in ("prefill", "decode"):
        stack.sim_post(role, "/sim/reset")


def send_clean_bodies(stack: Stack, pd_paths: list[str], headers: dict[str, str]) -> None:
    """A clean body with SGLang's override headers to a P/D route and an open one (decode
    alone: no prefill target)."""
    for path in (pd_paths[0], "/v1/models"):
        request(stack, "POST", path, orjson.dumps(CHAT), headers)


@pytest.mark.parametrize("pdproc_up", [True, False], ids=["pdproc-up", "pdproc-down"])
def test_no_route_carries_transfer_fields_to_a_pod(
    stack: Stack, canary: Canary, pdproc_up: bool
) -> None:
    if not pdproc_up:
        stack.pdproc.stop()  # ext_proc fails open: only the config and the guard are left
    reset_pods(stack)
    vhost = virtual_host(loaded_config(stack))
    pd_paths = [r["match"]["path"] for r in vhost["routes"] if r["name"] == "pd"]
    headers = override_headers(canary)
    before = decode_hits(stack)
    answers: dict[tuple[str, str, str], int] = {}
    for route in vhost["routes"]:
        attack_route(stack, canary, route, pd_paths, headers, answers)
    # None of those requests reached a pod at all, and the canary heard nothing.
    assert decode_hits(stack) == before
    assert len(answers) > 100
    # The clean bodies reach the decode, the override headers stripped on every route that
    # reaches a pod.
    send_clean_bodies(stack, pd_paths, headers)
    assert decode_hits(stack) == before + 2
    assert carried(stack) == []
    assert canary.hits == []
