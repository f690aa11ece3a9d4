"""A bootstrap server's answer parsed into an engine map, within bounds: pure logic."""

from __future__ import annotations

import orjson
import pytest

from pdproc import engine_maps


def test_engine_map_good() -> None:
    payload = orjson.dumps(
        {
            "0": {"engine_id": "e0", "worker_addr": {"0": {"0": "tcp://10.0.0.1:5000"}}},
            "1": {"engine_id": "e1", "worker_addr": {}},
        }
    )
    assert engine_maps.parse_engine_map(payload) == {0: "e0", 1: "e1"}


def test_engine_map_skips_ranks_without_string_id_and_nulls() -> None:
    payload = orjson.dumps(
        {"0": {"engine_id": 42}, "1": None, "2": {"engine_id": "e2"}, "x": {"engine_id": "ex"}}
    )
    assert engine_maps.parse_engine_map(payload) == {2: "e2"}


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"{}", "engine_id not found"),
        (b'{"0": {"engine_id": null}}', "engine_id not found"),
        (b'{"0": {"worker_addr": {}}}', "engine_id not found"),
        (b"<html>oops</html>", "failed to parse"),
        (b"[]", "not a JSON object"),
        (b'{"0": "e0"}', "not an object"),
    ],
)
def test_engine_map_errors(payload: bytes, message: str) -> None:
    with pytest.raises(engine_maps.BootstrapError, match=message):
        engine_maps.parse_engine_map(payload)


def test_engine_map_bounds() -> None:
    many = orjson.dumps({str(i): {"engine_id": f"e{i}"} for i in range(engine_maps.MAX_RANKS + 1)})
    with pytest.raises(engine_maps.BootstrapError, match="more than"):
        engine_maps.parse_engine_map(many)
    with pytest.raises(engine_maps.BootstrapError, match="larger than"):
        engine_maps.parse_engine_map(b" " * (engine_maps.MAX_QUERY_BYTES + 1))
    with pytest.raises(engine_maps.BootstrapError, match="too long"):
        engine_maps.parse_engine_map(orjson.dumps({"0": {"engine_id": "e" * 1000}}))
