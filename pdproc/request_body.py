"""The client's JSON body: decoded once, checked, and rewritten for either leg.

Pure functions, no I/O. The body is client input: anything it can hold (deep nesting,
numbers no engine can hold, a `kv_transfer_params` of its own) is refused with a BodyError
whose message is fit for a 400.

A prompt may be many megabytes, so the body is decoded only into its top-level members, each
kept as the client's own bytes (`msgspec.Raw`, a slice of the body, nothing copied). Both
legs are built from those bytes: the decode leg is the client's body with the gateway's
fields spliced in before its closing brace, and the prefill leg is re-encoded from the
members, where the members pdproc overrides are replaced and every other one is copied as
the client spelled it. So both legs carry every number and string exactly, and a duplicate
key (which the engines, like msgspec, read as its last value) reaches the prefill once. The
members that are not plain ASCII strings are decoded in full once, in C, to check them
(nesting, UTF-8, number range); the decoded values are dropped at once. A short body is
decoded whole once instead (fewer calls for the usual request, the same rules). That decode holds
every value of a member as a Python object, so first a bound on what it may hold is counted
in C over the member's bytes (commas, colons and opening brackets): a member of millions of
tiny values (`[0,0,0,...]`, `[{},{},...]`, `{"k0":0,"k1":0,...}`) is refused before it is
decoded, at the cost of a byte count, and never blocks the event loop or grows pdproc's
memory beyond its bytes.

The top-level members themselves are bounded (MAX_MEMBERS) before the body is decoded, for
the same reason: a body of hundreds of thousands of distinct keys would otherwise be built
into a dict of as many Python strings before its size could be seen. They are counted by
msgspec, in C, over a copy of the body whose objects are read as arrays, and the count stops
at the bound (`_refuse_wide_object`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, TypeAlias

import msgspec
import orjson

from pdproc.gateway_fields import GATEWAY_FIELDS, NESTED_CARRIERS
from pdproc.gateway_fields import KV_PARAMS as KV_PARAMS

Members: TypeAlias = dict[str, msgspec.Raw]
"""A JSON object's members: each value as the client's bytes (a slice of its body)."""

Buffer: TypeAlias = bytes | memoryview
ClientBytes: TypeAlias = bytes | bytearray
"""A client's body: bytes, or the buffer a streamed body was gathered in."""


class BodyError(ValueError):
    """The client's body cannot be carried to both legs as it is."""


# Containers nested deeper than this (the body itself is level 1) are refused: what pdproc
# forwarded until it stopped re-serialising bodies (orjson's limit), far above honest use,
# and below where Python parsers in the engines give up.
MAX_NESTING = 254
# The engines hold integers in 64 bits (vLLM's seed is an int64): larger ones are refused
# here as before, one rule for both legs.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # orjson's encoder refuses exactly beyond these
# At most this many JSON values in one top-level member, keys included (counted as its
# commas, colons and opening brackets, those inside strings too, so an over-estimate): a
# token-id prompt of a million tokens fits; the decode it bounds costs at most ~100 ms and a
# few tens of MiB (objects are decoded as arrays for the check, no dict per object).
MAX_VALUES = 1 << 20
# At most this many top-level members: the engines' request models have about a hundred.
MAX_MEMBERS = 4096
# A body shorter than this (and not a wide object) is checked whole, not member by member:
# 12.5 -> 3.8 us for a 1 KiB chat request (timeit), the same rules and messages.
CHECKED_WHOLE_BELOW = 64 * 1024
_COUNTED_CHUNK = 1 << 20
_UNCOUNTED = bytes(set(range(256)) - set(b",[{:"))
_MEMBERS = msgspec.json.Decoder(Members)
_ENCODER = msgspec.json.Encoder()


def parse_body(raw: ClientBytes) -> Members:
    """The client's request as a JSON object's members, or BodyError with a message for the
    client."""
    # Every object member has a colon: a body with few of them (the usual one, whatever its
    # size) holds no wide object anywhere, and skips the counts and copies that find one.
    short = len(raw) < CHECKED_WHOLE_BELOW
    wide = raw.count(b":") > MAX_MEMBERS if short else _holds_more(raw, b":", MAX_MEMBERS)
    if wide:
        _refuse_wide_object(raw)
    try:
        members = _MEMBERS.decode(raw)
    except msgspec.ValidationError:
        raise BodyError(f"request body must be a JSON object, not {_json_kind(raw)}") from None
    except msgspec.DecodeError as exc:
        raise BodyError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise BodyError("request body is nested too deeply") from None
    for name in GATEWAY_FIELDS:
        if name in members:
            # Only the gateway may point a decode pod at a KV source.
            raise BodyError(f"{name} is set by the gateway, not by clients")
    if not wide and short:
        _check_whole(raw)
    else:
        _check_members(raw, members, wide=wide)
    # After the values' bound: a carrier is decoded one level more.
    for path in NESTED_CARRIERS:
        _refuse_nested_fields(members, path, wide=wide)
    return members


_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")
# Each object becomes an array of its keys and values, strings staying strings (none of
# these bytes is special inside one): the body's members are half its top-level values.
_OBJECTS_AS_ARRAYS = bytes.maketrans(b"{}:", b"[],")


def _refuse_wide_object(raw: ClientBytes | msgspec.Raw, name: str = "") -> None:
    """BodyError if the body (or its member `name`), which holds more than MAX_MEMBERS
    colons, is an object of more than MAX_MEMBERS members (duplicate keys counted), found in
    C at the cost of one copy of its bytes and of the members up to the bound, never of a
    Python object per member. Every member has a colon: callers count them first, so the
    usual body never gets here."""
    if not _OBJECT_START.match(memoryview(raw)):
        return  # not an object: the decode says what it is
    try:
        _top_level_values().decode(_translated(raw))
    except msgspec.ValidationError:
        what = f"{name} has more than {MAX_MEMBERS} fields" if name else None
        raise BodyError(
            what or f"request body has more than {MAX_MEMBERS} top-level fields"
        ) from None
    except msgspec.DecodeError:
        return  # invalid JSON: the decode's message says where


@cache
def _top_level_values() -> msgspec.json.Decoder[Any]:
    """A decoder of an array that refuses it at its (2 * MAX_MEMBERS + 1)th value, without
    reading further (a struct of that many fields, array-like, no unknown ones allowed).
    Built at first use: the struct takes tens of milliseconds to define."""
    fields = [(f"v{i}", msgspec.Raw, msgspec.Raw(b"0")) for i in range(2 * MAX_MEMBERS)]
    values = msgspec.defstruct(
        "TopLevelValues", fields, array_like=True, forbid_unknown_fields=True, gc=False
    )
    return msgspec.json.Decoder(values)


def _refuse_nested_fields(members: Members, path: tuple[str, ...], *, wide: bool) -> None:
    """BodyError if the object at `path` (from the body) has a gateway field."""
    current: Members | None = members
    for depth, name in enumerate(path, 1):
        value = current.get(name) if current is not None else None
        if value is not None and wide and _count(value, b":") > MAX_MEMBERS:
            _refuse_wide_object(value, ".".join(path[:depth]))
        current = _as_object(value) if value is not None else None
    if current is None:
        return
    for name in GATEWAY_FIELDS:
        if name in current:
            dotted = ".".join((*path, name))
            raise BodyError(f"{dotted} is set by the gateway, not by clients")


def _json_kind(raw: ClientBytes) -> str:
    try:
        value = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        return "invalid JSON"
    return {list: "list", str: "str", int: "int", float: "float", bool: "bool"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


def value_kind(value: msgspec.Raw) -> str:
    """`object`, `array`, `string` or `scalar`, from a member's first byte (a Raw from a
    decode starts at its value)."""
    first = bytes(memoryview(value)[:1])
    return {b"{": "object", b"[": "array", b'"': "string"}.get(first, "scalar")


def _check_members(raw: ClientBytes, members: Members, *, wide: bool) -> None:
    """Each member's values checked (`_check_value`), but the plain ASCII strings: strings
    skipped as Raw had their escapes and control characters checked, not their UTF-8, and
    a body of plain ASCII (the usual one) needs no more."""
    ascii_only = raw.isascii()
    for value in members.values():
        if ascii_only and value_kind(value) == "string":
            continue
        _check_value(value, objects_as_arrays=wide)


def _check_whole(raw: ClientBytes) -> None:
    """The rules `_check_value` applies to each member, applied to a short body at once: one
    decode and one encode in C instead of two per member, and no look at each member's
    kind (its members are at level 2 of orjson's count, as `_check_value` puts each, and
    none can reach MAX_VALUES). The decode also checks every string's UTF-8."""
    try:
        decoded = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise BodyError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise BodyError("request body is nested too deeply") from None
    _check_encodable(decoded)


def _check_encodable(value: Any) -> None:
    """BodyError unless orjson can encode `value` (in C: it refuses integers beyond 64 bits
    and nesting beyond MAX_NESTING)."""
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        if "Recursion" in str(exc):
            raise BodyError("request body is nested too deeply") from None
        raise BodyError(
            f"integer {_first_wide_integer(value)}... does not fit in 64 bits"
        ) from None


def _check_value(value: msgspec.Raw, *, objects_as_arrays: bool) -> None:
    """Decode one member in full (msgspec, in C) and check what it holds (orjson's encoder,
    in C: it refuses integers beyond 64 bits and nesting beyond 254 levels, pdproc's own two
    rules); a member of more values than MAX_VALUES is refused before it is decoded.
    `objects_as_arrays`: the body may hold a wide object, so its objects are decoded as
    arrays (no dict of Python strings per object)."""
    if _may_exceed_values(value) and values_bound(value) > MAX_VALUES:
        raise BodyError(f"a request body field holds more than {MAX_VALUES} JSON values")
    try:
        decoded = msgspec.json.decode(_objects_as_arrays(value) if objects_as_arrays else value)
    except msgspec.DecodeError as exc:
        raise BodyError(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise BodyError("request body is nested too deeply") from None
    if not isinstance(decoded, (dict, list, int)):
        return
    # The member sits at level 2 (the body is level 1): one list around it puts it at
    # level 2 of orjson's count too, whose limit is MAX_NESTING.
    _check_encodable([decoded])


def _objects_as_arrays(value: msgspec.Raw) -> msgspec.Raw | ClientBytes:
    """A member to check, its objects read as arrays of keys and values: the same strings,
    numbers and nesting, without a dict of Python strings per object (hundreds of
    thousands of distinct keys would cost a few hundred bytes each). parse_body's first
    decode proved the keys are strings."""
    if value_kind(value) == "string" or not _count(value, b":"):
        return value  # no object with members (the usual prompt, token ids)
    return _translated(value)


def _holds_more(raw: ClientBytes, byte: bytes, bound: int) -> bool:
    """Whether `byte` occurs more than `bound` times in `raw`, found one occurrence after the
    other (memchr, in C) and no further than the (bound + 1)th. bytes.count compares every
    byte in a loop of its own: 0.63 ms for a 1 MiB prompt here, where the few colons of the
    usual body are found in 0.05 ms (and a body with many stops at the bound)."""
    at = -1
    for _ in range(bound + 1):
        at = raw.find(byte, at + 1)
        if at < 0:
            return False
    return True


def _count(buffer: ClientBytes | msgspec.Raw, byte: bytes) -> int:
    """How often `byte` occurs, counted in C a chunk at a time (no copy of the whole)."""
    if not isinstance(buffer, msgspec.Raw):
        return buffer.count(byte)
    view = memoryview(buffer)
    return sum(
        bytes(view[start : start + _COUNTED_CHUNK]).count(byte)
        for start in range(0, len(view), _COUNTED_CHUNK)
    )


def _translated(buffer: ClientBytes | msgspec.Raw) -> ClientBytes:
    """The bytes with every object turned into an array (`_OBJECTS_AS_ARRAYS`), in C."""
    if not isinstance(buffer, msgspec.Raw):
        return buffer.translate(_OBJECTS_AS_ARRAYS)
    view = memoryview(buffer)
    return b"".join(
        bytes(view[start : start + _COUNTED_CHUNK]).translate(_OBJECTS_AS_ARRAYS)
        for start in range(0, len(view), _COUNTED_CHUNK)
    )


def _may_exceed_values(value: msgspec.Raw) -> bool:
    """Whether a member may hold more than MAX_VALUES values. Its bound (below) is at most
    its length plus one, so a member shorter than MAX_VALUES bytes cannot, and is not
    counted: a prompt of up to a MiB pays no pass over its bytes for this rule."""
    return len(value) >= MAX_VALUES and value_kind(value) in ("object", "array")


def values_bound(value: msgspec.Raw) -> int:
    """At least the number of JSON values in a member, keys included: its commas, colons and
    opening brackets plus one (those inside strings count too). Counted in C, a chunk at a
    time (one chunk copied at once, never the member): what is left once every other byte is
    deleted, one pass over the chunk rather than one per character counted."""
    view = memoryview(value)
    total = 1
    for start in range(0, len(view), _COUNTED_CHUNK):
        chunk = bytes(view[start : start + _COUNTED_CHUNK])
        total += len(chunk.translate(None, _UNCOUNTED))
    return total


def _first_wide_integer(decoded: Any) -> str:
    """The first 24 digits of an integer beyond 64 bits (for the client's message), found
    only once the body is known to hold one and at most MAX_VALUES values."""
    pending: list[Any] = [decoded]
    while pending:
        item = pending.pop()
        if type(item) is int and not _INT_MIN <= item <= _INT_MAX:
            return str(item)[:24]
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
    return "?"


def dumps(data: Mapping[str, Any]) -> bytes:
    """Serialise a body pdproc built: Raw members are copied as the client's bytes."""
    return _encode(data)


def _encode(value: Any) -> bytes:
    try:
        return _ENCODER.encode(value)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BodyError(f"request body cannot be forwarded: {exc}") from None


@dataclass(frozen=True, slots=True)
class Pieces:
    """A body pdproc built, in pieces that are sent one after the other and never joined:
    the client's long members are views of its own bytes, so a long prompt is not copied
    (and costs no memory beyond the client's body) on its way to the prefill pod."""

    parts: tuple[Buffer, ...]

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts)

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


# Members at least this long go to the pod as views of the client's bytes; shorter ones are
# copied into the piece around them (a few pieces per body, not one per member).
_VIEWED_FROM = 4096


def dump_pieces(data: Mapping[str, Any]) -> Pieces:
    """`dumps(data)`, in pieces: the long Raw members are not copied."""
    if not any(isinstance(v, msgspec.Raw) and len(v) >= _VIEWED_FROM for v in data.values()):
        return Pieces((_encode(data),))  # nothing to leave uncopied: one encode, in C
    parts: list[Buffer] = []
    pending = bytearray(b"{")
    for key, value in data.items():
        if len(pending) > 1 or parts:
            pending += b","
        pending += _encode(key)
        pending += b":"
        if isinstance(value, msgspec.Raw) and len(value) >= _VIEWED_FROM:
            parts += (bytes(pending), memoryview(value))
            pending = bytearray()
        else:
            pending += _encode(value)
    pending += b"}"
    parts.append(bytes(pending))
    return Pieces(tuple(parts))


def members(fields: Mapping[str, Any]) -> bytes:
    """Top-level fields as JSON object members: `"a":1,"b":2`, without braces."""
    return dumps(fields)[1:-1]


def with_field(raw: ClientBytes, parsed: Mapping[str, Any], key: str, value: Any) -> bytes:
    """The client's bytes with one top-level field appended (see `with_fields`)."""
    return with_fields(raw, parsed, {key: value})


def with_fields(raw: ClientBytes, parsed: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """The client's bytes with top-level fields appended, no re-serialisation.

    The keys must not be in `parsed`. A prompt may be megabytes long: it is copied once and
    its numbers keep their exact spelling."""
    # Cut before the closing brace (and the blanks before it); copy the prompt once.
    cut = _last_non_blank(raw, closing_brace(raw))
    added = members(fields)
    tail = (b"," if parsed and added else b"") + added + b"}"
    return b"".join((memoryview(raw)[:cut], tail))


def closing_brace(raw: ClientBytes) -> int:
    """The index of a JSON object's closing brace: parse_body proved it is the last byte
    that is not white space."""
    return _last_non_blank(raw, len(raw)) - 1


_JSON_BLANKS = b" \t\r\n"


def _last_non_blank(raw: ClientBytes, end: int) -> int:
    """The end index of `raw[:end]` without trailing JSON whitespace (in C: a client may
    send megabytes of it)."""
    if end == 0 or raw[end - 1] not in _JSON_BLANKS:
        return end
    return len(raw[:end].rstrip(_JSON_BLANKS))


def prime_single_token(path: str, target: dict[str, Any], original: Mapping[str, Any]) -> None:
    """Make `target` a request vLLM finishes length-capped after one token, in place.

    vLLM's KV producers ship the KV only when the request finishes length-capped; any other
    end (a stop string, EOS as the first token, a rejected request) silently drops it and
    the decode waits for KV that never comes. The llm-d rules come first (max_tokens=1,
    max_completion_tokens=1 only if the client had it, stream off, no stream_options); the
    rest closes what llm-d leaves open. Values pdproc leaves alone stay as they are (the
    client's bytes, when `target` holds Raw members).
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
    sampling = _as_object(target.get("sampling_params"))
    if path.endswith("/generate") and sampling is not None:
        primed = {**sampling, "max_tokens": 1, "ignore_eos": True}
        for field in ("min_tokens", "stop", "stop_token_ids"):
            primed.pop(field, None)
        if "n" in primed:
            primed["n"] = 1
        target["sampling_params"] = primed


def _as_object(value: Any) -> dict[str, Any] | None:
    """A member that is a JSON object, as a dict (its own members Raw when it is Raw)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, msgspec.Raw) and value_kind(value) == "object":
        return _MEMBERS.decode(value)
    return None
