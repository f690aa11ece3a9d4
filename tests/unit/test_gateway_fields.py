"""The kv guard (Lua, in Envoy) and pdproc refuse the same client fields."""

from __future__ import annotations

import re

import pytest

from pdproc.envoy_config import kv_guard_source
from pdproc.gateway_fields import GATEWAY_FIELDS
from pdproc.request_body import BodyError, parse_body


def test_the_kv_guard_refuses_exactly_pdprocs_gateway_fields() -> None:
    source = kv_guard_source()
    table = re.search(r"local GATEWAY_FIELDS = \{(.*?)\n\}", source, re.S)
    assert table is not None
    assert re.findall(r"^\s*(\w+) = true,$", table.group(1), re.M) == list(GATEWAY_FIELDS)


def test_pdproc_refuses_each_field_whichever_connector_runs() -> None:
    for name in GATEWAY_FIELDS:
        with pytest.raises(BodyError, match=f"^{name} is set by the gateway, not by clients$"):
            parse_body(b'{"model":"m","%s":1}' % name.encode())
    # Nested or near-miss keys are the client's own.
    assert parse_body(b'{"extra":{"bootstrap_host":"x"},"bootstrap_hosts":1}')


# What SGLang's disaggregation reads from a request body, named here rather than derived from
# GATEWAY_FIELDS so that a field dropped from the list fails: its OpenAI request models (the
# bootstrap address and room, the prefill DP rank) and its native /generate request (also the
# pairing key, the decode's TP size, the router's hint naming a peer to read KV from).
SGLANG_FIELDS = {
    "bootstrap_host": b'"10.0.0.9"',
    "bootstrap_port": b"8998",
    "bootstrap_room": b"7",
    "disagg_prefill_dp_rank": b"0",
    "bootstrap_pair_key": b'"k"',
    "decode_tp_size": b"2",
    "kv_router_hint": b'{"source_control_endpoint":"tcp://10.0.0.9:1","block_hashes":[]}',
}


@pytest.mark.parametrize("name", list(SGLANG_FIELDS))
def test_every_field_sglang_reads_transfer_info_from_is_refused(name: str) -> None:
    body = b'{"model":"m","prompt":"p","%s":%s}' % (name.encode(), SGLANG_FIELDS[name])
    with pytest.raises(BodyError, match=f"^{name} is set by the gateway, not by clients$"):
        parse_body(body)
    source = kv_guard_source()
    assert f"  {name} = true," in source
