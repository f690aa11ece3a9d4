"""The client's JSON body: parsed once, checked, and rewritten for either leg.

Pure functions, no I/O. The body is client input: anything it can hold (deep nesting,
numbers no double can carry, a `kv_transfer_params` of its own) is either carried exactly
or refused with a BodyError whose message is fit for a 400.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson

from pdproc.gateway_fields import GATEWAY_FIELDS
from pdproc.gateway_fields import KV_PARAMS as KV_PARAMS


class BodyError(ValueError):
    """The client's body cannot be carried to both legs as it is."""


# orjson keeps integers in [-2**63, 2**64) exact and turns larger ones into floats, which
# the prefill leg would then carry as floats while the decode keeps the client's digits. So
# a float that large may be such an integer: only then does the body take the exact (slower)
# check. (orjson itself refuses floats that overflow a double.)
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
_SUSPECT = float(2**63)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The client's request as a JSON object, or BodyError with a message for the client."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BodyError(f"request body must be a JSON object, not {type(data).__name__}")
    for name in GATEWAY_FIELDS:
        if name in data:
            # Only the gateway may point a decode pod at a KV source.
            raise BodyError(f"{name} is set by the gateway, not by clients")
    if _has_huge_float(data):
        _check_numbers(raw)
    return data


def _has_huge_float(data: dict[str, Any]) -> bool:
    """Whether any number in the body is a float of magnitude 2**63 or more (iterative: the
    client controls the nesting; a prompt's text costs nothing, only JSON values are seen)."""
    pending: list[dict[str, Any] | list[Any]] = [data]
    while pending:
        container = pending.pop()
        for value in container.values() if isinstance(container, dict) else container:
            kind = type(value)
            if kind is float:
                if not -_SUSPECT < value < _SUSPECT:
                    return True
            elif kind is dict or kind is list:
                pending.append(value)
    return False


def _check_numbers(raw: bytes) -> None:
    """Refuse numbers that orjson (the prefill leg) would not carry exactly."""

    def exact_int(text: str) -> int:
        value = int(text)
        if not _INT_MIN <= value <= _INT_MAX:
            raise BodyError(f"integer {text[:24]}... does not fit in 64 bits")
        return value

    try:
        json.loads(raw, parse_int=exact_int)
    except RecursionError:
        raise BodyError("request body is nested too deeply") from None
    except ValueError as exc:  # BodyError, or the stdlib's view of an orjson-valid body
        if isinstance(exc, BodyError):
            raise
        raise BodyError(f"invalid JSON body: {exc}") from None


def dumps(data: Mapping[str, Any]) -> bytes:
    """Serialise a body pdproc built; BodyError when the client's nesting is too deep."""
    try:
        return orjson.dumps(data)
    except TypeError as exc:  # orjson: "Recursion limit reached"
        raise BodyError(f"request body cannot be forwarded: {exc}") from None


def members(fields: Mapping[str, Any]) -> bytes:
    """Top-level fields as JSON object members: `"a":1,"b":2`, without braces; BodyError
    when a value cannot be serialised (nested too deeply)."""
    return dumps(fields)[1:-1]


def with_field(raw: bytes, parsed: Mapping[str, Any], key: str, value: Any) -> bytes:
    """The client's bytes with one top-level field appended (see `with_fields`)."""
    return with_fields(raw, parsed, {key: value})


def with_fields(raw: bytes, parsed: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """The client's bytes with top-level fields appended, no re-serialisation.

    The keys must not be in `parsed`. A prompt may be megabytes long: it is copied once and
    its numbers keep their exact spelling."""
    # Cut before the closing brace (and the blanks before it); copy the prompt once.
    cut = _last_non_blank(raw, closing_brace(raw))
    added = members(fields)
    tail = (b"," if parsed and added else b"") + added + b"}"
    return b"".join((memoryview(raw)[:cut], tail))


def closing_brace(raw: bytes) -> int:
    """The index of a JSON object's closing brace: parse_body proved it is the last byte
    that is not white space."""
    return _last_non_blank(raw, len(raw)) - 1


_JSON_BLANKS = b" \t\r\n"


def _last_non_blank(raw: bytes, end: int) -> int:
    """The end index of `raw[:end]` without trailing JSON whitespace."""
    while end > 0 and raw[end - 1] in _JSON_BLANKS:
        end -= 1
    return end


def prime_single_token(path: str, target: dict[str, Any], original: Mapping[str, Any]) -> None:
    """Make `target` a request vLLM finishes length-capped after one token, in place.

    vLLM's KV producers ship the KV only when the request finishes length-capped; any other
    end (a stop string, EOS as the first token, a rejected request) silently drops it and
    the decode waits for KV that never comes. The llm-d rules come first (max_tokens=1,
    max_completion_tokens=1 only if the client had it, stream off, no stream_options); the
    rest closes what llm-d leaves open.
    """
    target["max_tokens"] = 1
    if "max_completion_tokens" in original:
        target["max_completion_tokens"] = 1
    target["stream"] = False
    target.pop("stream_options", None)
    # A second token, a second sequence or an early stop would each keep the request from
    # ending length-capped (vLLM rejects min_tokens > max_tokens outright).
    for field in ("min_tokens", "best_of", "stop", "stop_token_ids"):
        target.pop(field, None)
    if "n" in target:
        target["n"] = 1
    target["ignore_eos"] = True
    if path.endswith("/responses"):
        target["max_output_tokens"] = 1
    sampling = target.get("sampling_params")
    if path.endswith("/generate") and isinstance(sampling, dict):
        primed = {**sampling, "max_tokens": 1, "ignore_eos": True}
        for field in ("min_tokens", "stop", "stop_token_ids"):
            primed.pop(field, None)
        if "n" in primed:
            primed["n"] = 1
        target["sampling_params"] = primed
