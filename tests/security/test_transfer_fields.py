"""A client's own KV transfer fields, for every connector, on every path.

The fields tell a decode where to pull KV from: vLLM's `kv_transfer_params` and SGLang's
`bootstrap_host` / `bootstrap_port` / `bootstrap_room` (plus its pairing key, the prefill DP
rank, the decode's TP size and the router's KV hint, read from SGLang's source). Before,
only the disaggregated path ran the SGLang check: on the decode-only paths (no target,
`--pd-min-prompt`, draining, an open breaker with `--on-bootstrap-error decode-only`) a
client's `bootstrap_*` reached the decode, which then contacted whatever the client named.
Now `parse_body` refuses every connector's fields on every path, whichever connector runs (a
400 counted `bad_request`), and no pod is contacted. The kv guard's side (pdproc down) is
`tests/e2e/test_edge_security.py` and `test_path_coverage.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from pdproc.config import BootstrapPolicy, KvConnector
from pdproc.gateway_fields import GATEWAY_FIELDS
from pdproc.pod_verdict import Verdict

from .conftest import CHAT, SECONDS, Pd
from .pods import HostilePod

# What each field's value would point the decode at (the canary address of the attack).
HOSTILE_VALUES: dict[str, Any] = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://169.254.169.254:80",
        "remote_engine_id": "x",
        "transfer_id": "t",
    },
    "ec_transfer_params": {"do_remote_prefill": True, "remote_host": "169.254.169.254"},
    "bootstrap_host": "169.254.169.254",
    "bootstrap_port": 80,
    "bootstrap_room": 12345,
    "bootstrap_pair_key": "k",
    "disagg_prefill_dp_rank": 0,
    "decode_tp_size": 1,
    "kv_router_hint": {"source_control_endpoint": "tcp://169.254.169.254:80", "block_hashes": []},
}
CONNECTORS = [KvConnector.MOONCAKE, KvConnector.NIXLV2, KvConnector.SGLANG]


def hostile_body(field: str) -> bytes:
    if field.startswith("bootstrap_") and field != "bootstrap_pair_key":
        # SGLang's decode needs all three to bootstrap: the attack sends them together.
        extra = {name: HOSTILE_VALUES[name] for name in GATEWAY_FIELDS if name != field}
        extra = {k: v for k, v in extra.items() if k.startswith("bootstrap_")}
        return orjson.dumps({**CHAT, **extra, field: HOSTILE_VALUES[field]})
    return orjson.dumps({**CHAT, field: HOSTILE_VALUES[field]})


def test_the_test_covers_every_gateway_field() -> None:
    assert set(HOSTILE_VALUES) == set(GATEWAY_FIELDS)
    assert {"bootstrap_host", "bootstrap_port", "bootstrap_room"} <= set(GATEWAY_FIELDS)


# Each decode-only or disaggregated path: (settings, how to send, what to do first).
Path = tuple[dict[str, Any], Callable[[HostilePod], str | None]]
PATHS: dict[str, Path] = {
    "disaggregated": ({}, lambda pod: pod.address),
    "no-target": ({}, lambda pod: None),
    "empty-header": ({}, lambda pod: ""),
    "short-prompt": ({"pd_min_prompt": 1_000_000}, lambda pod: None),
    "breaker-decode-only": (
        {"on_bootstrap_error": BootstrapPolicy.DECODE_ONLY, "breaker_failures": 1},
        lambda pod: pod.address,
    ),
}


async def refused(pd: Pd, body: bytes, prefill: str | None) -> None:
    before = pd.sample("pdproc_requests_total", outcome="bad_request")
    outcome = await pd.play(body, prefill=prefill)
    assert outcome.status == 400, outcome
    assert outcome.error_kind == "bad_request"
    assert outcome.error is not None
    assert "is set by the gateway, not by clients" in outcome.error["message"]
    assert outcome.decode_body is None  # the decode receives nothing
    assert pd.sample("pdproc_requests_total", outcome="bad_request") == before + 1


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda c: c.value)
@pytest.mark.parametrize("path", list(PATHS))
async def test_every_connectors_fields_are_refused_on_every_path(
    pod: HostilePod, make_pdproc: Callable[..., Awaitable[Pd]], connector: KvConnector, path: str
) -> None:
    settings, prefill = PATHS[path]
    pool = (pod.host_port(),) if path == "short-prompt" else ()
    pd = await make_pdproc(pod, kv_connector=connector, prefill=pool, **settings)
    if path == "breaker-decode-only":
        pd.service.breakers.record(pod.host_port(), Verdict.FAILED)
        assert not pd.service.breakers.allow(pod.host_port())
    for field in GATEWAY_FIELDS:
        await refused(pd, hostile_body(field), prefill(pod))
    # The same client without the fields is served on that path (P/D or the decode alone).
    normal = await pd.play(orjson.dumps(CHAT), prefill=prefill(pod))
    assert normal.status == 200, normal
    prefills = len(pod.prefills())
    assert prefills == (1 if path == "disaggregated" else 0)


@pytest.mark.parametrize("connector", CONNECTORS, ids=lambda c: c.value)
async def test_every_connectors_fields_are_refused_while_draining(
    pod: HostilePod, make_pdproc: Callable[..., Awaitable[Pd]], connector: KvConnector
) -> None:
    pd = await make_pdproc(pod, kv_connector=connector)
    async with pd.lame_duck(drain_timeout_s=5, within_s=SECONDS):
        for field in GATEWAY_FIELDS:
            for prefill in (pod.address, None):
                await refused(pd, hostile_body(field), prefill)
        assert pod.total_hits == 0


async def test_sglang_override_headers_never_reach_the_prefill(
    pod: HostilePod, make_pdproc: Callable[..., Awaitable[Pd]]
) -> None:
    """SGLang reads the same fields from `x-override-bootstrap-*` headers (behind an opt-in
    switch): pdproc does not copy them onto the prefill leg (Envoy strips them for the
    decode: test_path_coverage.py)."""
    pd = await make_pdproc(pod, kv_connector=KvConnector.SGLANG)
    headers: dict[str, str | bytes] = {
        "x-override-bootstrap-host": "169.254.169.254",
        "x-override-bootstrap-port": "80",
        "x-override-bootstrap-room": "1",
        "x-override-disagg-prefill-dp-rank": "0",
    }
    outcome = await pd.play(orjson.dumps(CHAT), prefill=pod.address, extra_headers=headers)
    assert outcome.status == 200
    (prefill,) = pod.prefills()
    assert not [name for name in prefill.headers if name.startswith("x-override-")]
    sent = orjson.loads(prefill.body)
    assert sent["bootstrap_host"] == "127.0.0.1"
