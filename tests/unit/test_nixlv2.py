"""vLLM's NIXL v2 connector: the prefill leg, and the decode leg from the prefill's answer,
which is a pod's word: checked field by field (pdproc.connectors.nixlv2)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproc.connectors import AnswerError, ClientRequest, NoKvParams, OnFailure
from pdproc.connectors.nixlv2 import (
    MAX_BLOCK_IDS,
    NixlV2,
    params_from_answer,
    side_channel,
    token_limit_fields,
)
from pdproc.request_body import parse_body
from pdproc.targets import HostPort

POD = HostPort("10.0.0.7", 8000)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
RAW = orjson.dumps({**CHAT, "stream": True})


def answer(**params: Any) -> bytes:
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e1",
        "remote_request_id": "r1",
        "remote_block_ids": [[1, 2], [3]],
        "remote_host": POD.host,
        "remote_port": 5600,
        "tp_size": 1,
        **params,
    }
    return orjson.dumps({"id": "x", "kv_transfer_params": kv})


def nobody(_: HostPort) -> bool:
    return False


def request(raw: bytes = RAW, path: str = "/v1/chat/completions") -> ClientRequest:
    return ClientRequest(path, raw, parse_body(raw), "req-1")


def test_the_prefill_leg_is_primed_to_one_token_and_carries_the_request_id() -> None:
    legs = NixlV2().legs(request(), POD, None, {})
    prefill = orjson.loads(bytes(legs.prefill_body))
    assert prefill["max_tokens"] == 1
    assert prefill["max_completion_tokens"] == 1
    assert prefill["stream"] is False
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert legs.decode_body is None
    assert legs.prefill_headers == {"x-request-id": "req-1"}


def test_a_request_without_an_id_sends_none() -> None:
    raw = orjson.dumps(CHAT)
    legs = NixlV2().legs(ClientRequest("/v1/chat/completions", raw, parse_body(raw)), POD, None, {})
    assert legs.prefill_headers == {}


def test_token_limits_by_api() -> None:
    assert token_limit_fields("/v1/responses") == ("max_output_tokens",)
    assert token_limit_fields("/v1/completions") == ("max_tokens", "max_completion_tokens")


def test_the_decode_gets_the_clients_request_with_the_checked_params() -> None:
    decode = orjson.loads(NixlV2().decode_body(request(), answer(), POD, nobody))
    assert decode["stream"] is True
    assert decode["max_tokens"] == 50
    kv = decode["kv_transfer_params"]
    assert kv["remote_engine_id"] == "e1"
    assert kv["remote_block_ids"] == [[1, 2], [3]]
    assert kv["tp_size"] == 1


def test_an_answer_without_params_is_unusable_not_refused() -> None:
    with pytest.raises(NoKvParams):
        params_from_answer(b'{"kv_transfer_params": null}', POD, nobody)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "not JSON"),
        (orjson.dumps({"kv_transfer_params": [1]}), "not an object"),
        (answer(remote_engine_id=""), "remote_engine_id is not an id"),
        (answer(remote_request_id=7), "remote_request_id is not an id"),
        (answer(do_remote_prefill=False), "do not ask the decode to pull"),
        (answer(do_remote_decode=True), "do not ask the decode to pull"),
        (answer(remote_block_ids=[]), "remote_block_ids"),
        (answer(remote_block_ids=[1, True]), "remote_block_ids"),
        (answer(remote_block_ids=[-1]), "remote_block_ids"),
        (answer(remote_block_ids=[[1], 2]), "remote_block_ids"),
        (answer(remote_block_ids=[[]]), "remote_block_ids"),
        (answer(remote_block_ids=[0] * (MAX_BLOCK_IDS + 1)), "remote_block_ids"),
        (answer(remote_block_ids=[[0]] * 65), "remote_block_ids"),
        (answer(remote_host="10.9.9.9"), "side channel it may not use"),
        (answer(remote_port=0), "remote_port"),
        (answer(remote_host="a/b"), "not a host name"),
        (answer(remote_host=""), "not a host name"),
        (answer(remote_host="fe80::1%eth0"), "not a host name"),
        (answer(extra={"nested": 1}), "not a plain value"),
        (answer(extra="x" * 300), "not a plain value"),
        (answer(**{f"f{i}": i for i in range(40)}), "too many fields"),
    ],
)
def test_an_unfit_answer_is_refused(raw: bytes, message: str) -> None:
    with pytest.raises(AnswerError, match=message):
        params_from_answer(raw, POD, nobody)


def test_a_side_channel_the_gateway_admits_is_kept() -> None:
    elsewhere = HostPort("10.9.9.9", 5600)
    params = params_from_answer(answer(remote_host="10.9.9.9"), POD, {elsewhere}.__contains__)
    assert params["remote_host"] == "10.9.9.9"


def test_side_channels_are_normalised() -> None:
    assert side_channel("[fd00::1]", 5600) == HostPort("fd00::1", 5600)
    assert side_channel("Prefill-0.Pods", 5600) == HostPort("prefill-0.pods", 5600)
    with pytest.raises(AnswerError):
        side_channel("host", True)


@pytest.mark.parametrize(
    ("status", "meaning"),
    [
        (400, OnFailure.PASS_THROUGH),
        (451, OnFailure.PASS_THROUGH),
        (452, OnFailure.DECODE_ONLY),
        (500, OnFailure.DECODE_ONLY),
        (None, OnFailure.DECODE_ONLY),
    ],
)
def test_what_a_failed_prefill_means(status: int | None, meaning: OnFailure) -> None:
    assert NixlV2().on_failure(status) is meaning
