"""Body checks, rewriting, priming, and rank choice: pure logic."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import orjson
import pytest

from pdproc import request_body as rb
from pdproc.connectors import ClientRequest, Legs, mooncake
from pdproc.targets import HostPort

from .fakes import both_legs, value_of

CHAT = {
    "model": "Qwen/Qwen2-0.5B",
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 50,
}


def primed(original: dict[str, Any], path: str = "/v1/chat/completions") -> dict[str, Any]:
    target = dict(original)
    rb.prime_single_token(path, target, original)
    return target


# llm-d's PrimeSingleTokenRequest cases.
def test_prime_without_token_fields_sets_max_tokens_only() -> None:
    out = primed({"model": "m"})
    assert out["max_tokens"] == 1
    assert out["stream"] is False
    assert "max_completion_tokens" not in out


def test_prime_with_max_tokens_only() -> None:
    out = primed({"model": "m", "max_tokens": 50})
    assert out["max_tokens"] == 1
    assert "max_completion_tokens" not in out


def test_prime_with_max_completion_tokens_only_sets_both() -> None:
    out = primed({"model": "m", "max_completion_tokens": 100})
    assert out["max_tokens"] == 1
    assert out["max_completion_tokens"] == 1


def test_prime_with_both_sets_both() -> None:
    out = primed({"model": "m", "max_tokens": 50, "max_completion_tokens": 100})
    assert (out["max_tokens"], out["max_completion_tokens"]) == (1, 1)


def test_prime_turns_streaming_off_and_drops_stream_options() -> None:
    out = primed({"model": "m", "stream": True, "stream_options": {"include_usage": True}})
    assert out["stream"] is False
    assert "stream_options" not in out


def test_prime_in_place_when_target_is_original() -> None:
    body = {"model": "m", "max_completion_tokens": 7, "stream": True}
    rb.prime_single_token("/v1/completions", body, body)
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1


def test_prime_separate_target_leaves_original_alone() -> None:
    original = {"max_tokens": 50}
    target: dict[str, Any] = {}
    rb.prime_single_token("/v1/chat/completions", target, original)
    assert "max_completion_tokens" not in target
    assert original == {"max_tokens": 50}


# What llm-d leaves open: anything that keeps vLLM from ending the prefill length-capped.
def test_prime_neutralises_early_stops_and_extra_sequences() -> None:
    out = primed(
        {"min_tokens": 5, "n": 3, "best_of": 4, "stop": ["\n"], "stop_token_ids": [2]},
    )
    for field in ("min_tokens", "best_of", "stop", "stop_token_ids"):
        assert field not in out
    assert out["n"] == 1
    assert out["ignore_eos"] is True


def test_prime_responses_api_caps_max_output_tokens() -> None:
    out = primed({"input": "hi", "max_output_tokens": 300}, "/v1/responses")
    assert out["max_output_tokens"] == 1


def test_prime_generate_caps_sampling_params() -> None:
    original = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 9, "min_tokens": 4}}
    out = primed(original, "/inference/v1/generate")
    assert out["sampling_params"]["max_tokens"] == 1
    assert "min_tokens" not in out["sampling_params"]
    assert original["sampling_params"] == {"max_tokens": 9, "min_tokens": 4}


def test_prefill_body_has_prefill_params_and_is_primed() -> None:
    body = orjson.loads(
        bytes(
            mooncake.prefill_body(
                "/v1/chat/completions",
                {**CHAT, "max_completion_tokens": 100},
                mooncake.prefill_params("xfer-1"),
            )
        )
    )
    assert body["kv_transfer_params"] == {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "transfer_id": "xfer-1",
    }
    assert (body["max_tokens"], body["max_completion_tokens"], body["stream"]) == (1, 1, False)
    assert body["messages"] == CHAT["messages"]


def params() -> dict[str, Any]:
    return mooncake.decode_params("xfer-9", "http://10.0.0.1:8998", "eng-0")


def decode_body(raw: bytes, parsed: dict[str, Any], kv: dict[str, Any]) -> bytes:
    return rb.with_field(raw, parsed, rb.KV_PARAMS, kv)


def test_decode_body_keeps_client_fields_and_sets_params() -> None:
    raw = orjson.dumps({**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    out = orjson.loads(decode_body(raw, orjson.loads(raw), params()))
    assert out["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "xfer-9",
        "remote_bootstrap_addr": "http://10.0.0.1:8998",
        "remote_engine_id": "eng-0",
    }
    assert out["max_tokens"] == 50
    assert out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}


def test_decode_body_splice_keeps_client_bytes_exactly() -> None:
    # Exact number spelling, key order, whitespace and unicode survive: only the tail changes.
    raw = b'{ "model": "m", "seed": 18446744073709551615, "t": 1.50, "x": "\xc3\xa9" }\n'
    out = decode_body(raw, rb.parse_body(raw), params())
    assert out.startswith(b'{ "model": "m", "seed": 18446744073709551615, "t": 1.50')
    decoded = json.loads(out)
    assert decoded["seed"] == 18446744073709551615
    assert decoded["kv_transfer_params"]["transfer_id"] == "xfer-9"


def test_decode_body_of_empty_object() -> None:
    out = decode_body(b"{}", {}, params())
    assert json.loads(out) == {"kv_transfer_params": params()}


@pytest.mark.parametrize(
    "raw",
    [
        orjson.dumps({**CHAT, "kv_transfer_params": {"remote_bootstrap_addr": "http://evil"}}),
        b'{"model": "m", "kv_transfer_params": null}',
        # The same key to any JSON parser, spelled with an escape.
        b'{"model": "m", "kv\\u005ftransfer_params": {"remote_engine_id": "x"}}',
        b'{"kv_transfer_params": 1, "model": "m", "kv_transfer_params": 2}',
    ],
)
def test_client_kv_params_are_refused(raw: bytes) -> None:
    with pytest.raises(rb.BodyError, match="kv_transfer_params is set by the gateway"):
        rb.parse_body(raw)


def test_a_prompt_mentioning_kv_params_is_fine() -> None:
    raw = orjson.dumps({**CHAT, "messages": [{"role": "user", "content": '"kv_transfer_params"'}]})
    assert value_of(rb.parse_body(raw), "model") == CHAT["model"]


@pytest.mark.parametrize(
    "number", [b"18446744073709551616", b"-9223372036854775809", b"123456789012345678901234567890"]
)
def test_integers_no_leg_can_carry_exactly_are_refused(number: bytes) -> None:
    with pytest.raises(rb.BodyError, match="64 bits"):
        rb.parse_body(b'{"model": "m", "seed": ' + number + b"}")


def test_long_digit_runs_in_strings_are_fine() -> None:
    raw = b'{"model": "m", "prompt": "pi is 31415926535897932384626433832795"}'
    assert value_of(rb.parse_body(raw), "prompt").startswith("pi")


def test_nesting_past_what_the_prefill_body_can_carry_is_a_body_error() -> None:
    def nested(depth: int) -> bytes:
        return b'{"model":"m","x":' + b"[" * depth + b"]" * depth + b"}"

    # The body is level 1: 253 arrays inside it are the most that passes, as before.
    request = ClientRequest("/v1/chat/completions", nested(253), rb.parse_body(nested(253)))
    legs = both_legs(mooncake.Mooncake(8998), request, HostPort("10.0.0.1", 8000), {0: "e0"}, {})
    assert b"[" * 253 + b"]" * 253 in bytes(legs.prefill_body)
    for depth in (254, 300, 5000):
        with pytest.raises(rb.BodyError, match="nested too deeply"):
            rb.parse_body(nested(depth))


def test_mooncake_legs() -> None:
    raw = orjson.dumps({**CHAT, "stream": True})
    request = ClientRequest("/v1/chat/completions", raw, rb.parse_body(raw))
    legs = both_legs(mooncake.Mooncake(8998), request, HostPort("fd00::1", 8000), {3: "e3"}, {})
    assert isinstance(legs, Legs)
    assert legs.rank == 3
    assert legs.prefill_headers == {mooncake.RANK_HEADER: "3"}
    decode = orjson.loads(legs.decode_body)["kv_transfer_params"]
    prefill = orjson.loads(bytes(legs.prefill_body))
    assert decode["remote_bootstrap_addr"] == "http://[fd00::1]:8998"
    assert decode["remote_engine_id"] == "e3"
    assert decode["transfer_id"] == prefill["kv_transfer_params"]["transfer_id"]
    assert prefill["stream"] is False
    assert legs.facts["transfer_id"] == decode["transfer_id"]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "invalid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'"text"', "must be a JSON object"),
        (b"", "invalid JSON"),
        (b'{"a": 1', "invalid JSON"),
        (b"\xff\xfe{}", "invalid JSON"),
    ],
)
def test_parse_body_rejects_non_objects(raw: bytes, message: str) -> None:
    with pytest.raises(rb.BodyError, match=message):
        rb.parse_body(raw)


def test_pick_rank_prefers_fewest_in_flight() -> None:
    engines = {0: "e0", 1: "e1", 2: "e2"}
    assert mooncake.pick_rank(engines, {0: 3, 1: 1, 2: 2}) == (1, "e1")


def test_pick_rank_spreads_ties_over_all_ranks() -> None:
    engines = {0: "e0", 1: "e1"}
    rng = random.Random(7)
    seen = {mooncake.pick_rank(engines, {}, rng) for _ in range(50)}
    assert seen == {(0, "e0"), (1, "e1")}


def test_transfer_ids_are_unique_and_prefixed() -> None:
    ids = {mooncake.new_transfer_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(i.startswith("xfer-") and len(i) == 41 for i in ids)
    # Random version-4 UUIDs, written as uuid.UUID writes them.
    for text in ids:
        parsed = uuid.UUID(text[len("xfer-") :])
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
        assert str(parsed) == text[len("xfer-") :]


@pytest.mark.parametrize(
    "raw", [b"{}", b"{ \n }", b"{}\r\n", b'{"a": [1, {"b": 2}] }\t\n', b' {"a":1}']
)
def test_decode_body_splice_handles_whitespace(raw: bytes) -> None:
    parsed = rb.parse_body(raw)
    out = decode_body(raw, parsed, params())
    assert json.loads(out) == {**json.loads(raw), "kv_transfer_params": params()}
