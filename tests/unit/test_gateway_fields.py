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
