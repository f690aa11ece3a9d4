"""vLLM's NIXL connector, as llm-d's `nixlv2` protocol: the prefill first, then the decode.

The prefill gets the client's request with `kv_transfer_params` asking it to keep the KV
for a remote decode, primed to one token and not streamed. Its answer carries the
`kv_transfer_params` the decode needs to pull that KV (the prefill's engine id, block ids,
host and port); the decode then gets the client's own request (stream, stream options and
token limits as the client sent them) with those params. A prefill that refuses the
request (400-451) answers the client as it is; any other failure lets the decode serve the
request alone.

The prefill's answer is a pod's word, not the gateway's: the decode connects to whatever
side channel it names. So only the fields vLLM's decode reads go on, each checked for type
and size, and the side channel must be the prefill pod's own host or an address the allow
list admits. Anything else is an `AnswerError`: the decode serves the request alone.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import orjson

from pdproc.connectors import AnswerError, ClientRequest, EngineMap, Legs, NoKvParams, OnFailure
from pdproc.errors import shown
from pdproc.request_body import (
    KV_PARAMS,
    BodyError,
    Pieces,
    dump_pieces,
    prime_single_token,
    with_field,
)
from pdproc.targets import HostPort

REQUEST_ID_HEADER = "x-request-id"
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def token_limit_fields(path: str) -> tuple[str, ...]:
    """The token limits of the API type, all set to 1 on the prefill leg (llm-d's rule)."""
    if path.endswith("/responses"):
        return ("max_output_tokens",)
    return ("max_tokens", "max_completion_tokens")


def prefill_body(path: str, parsed: Mapping[str, Any]) -> Pieces:
    data = {**parsed, KV_PARAMS: PREFILL_PARAMS}
    prime_single_token(path, data, parsed)
    for name in token_limit_fields(path):
        data[name] = 1
    return dump_pieces(data)


# Bounds on a prefill's kv_transfer_params. A real answer names a few hundred to a few
# thousand blocks (one per 16 tokens, per KV cache group) in a few kilobytes.
MAX_ID_CHARS = 256
MAX_BLOCK_IDS = 262_144
MAX_BLOCK_GROUPS = 64
MAX_EXTRA_FIELDS = 32
MAX_EXTRA_STRING_CHARS = 256
_HOST = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,252})")
_REQUIRED_IDS = ("remote_engine_id", "remote_request_id")
_CHECKED = frozenset(
    {"do_remote_prefill", "do_remote_decode", "remote_host", "remote_port", "remote_block_ids"}
    | set(_REQUIRED_IDS)
)

Admits = Callable[[HostPort], bool]


def _plain_int(value: object) -> TypeGuard[int]:
    return type(value) is int and 0 <= value < 2**63


def _ids(values: list[Any]) -> bool:
    """Whether every value is a non-negative 64-bit integer (bools are not)."""
    # set(map(type, ...)) runs in C (scripts/measure_nixl_answer_check.py: the whole check of
    # a 128k-token prompt's 8,192 ids took 0.4 to 0.7 ms on two busy cores).
    return set(map(type, values)) <= {int} and (
        not values or (min(values) >= 0 and max(values) < 2**63)
    )


def _block_ids(value: object) -> bool:
    """vLLM sends one list of block ids per KV cache group (0.32); older releases and the
    llm-d contract a flat list. Either, bounded, of non-negative integers."""
    if not isinstance(value, list) or not value:
        return False
    if type(value[0]) is not list:
        return len(value) <= MAX_BLOCK_IDS and _ids(value)
    if len(value) > MAX_BLOCK_GROUPS or not all(type(g) is list for g in value):
        return False
    total = sum(len(g) for g in value)
    return 0 < total <= MAX_BLOCK_IDS and all(_ids(g) for g in value)


def side_channel(host: object, port: object) -> HostPort:
    """The address the decode would connect to, or AnswerError when it is not one."""
    if not isinstance(host, str) or not 0 < len(host) <= 255 or "%" in host:
        raise AnswerError("remote_host is not a host name")
    if not _plain_int(port) or not 0 < port < 65536:
        raise AnswerError("remote_port is not a port number")
    try:
        return HostPort(str(ipaddress.ip_address(host.strip("[]"))), port)
    except ValueError:
        if not _HOST.fullmatch(host):
            raise AnswerError(f"remote_host {shown(host)} is not a host name") from None
        return HostPort(host.lower(), port)


def params_from_answer(answer: bytes, target: HostPort, admits: Admits) -> dict[str, Any]:
    """The `kv_transfer_params` the decode gets from a prefill's answer, or AnswerError.

    Kept: the fields vLLM's decode reads, checked; other vLLM fields (tp_size, remote_num_tokens
    ...) only as plain scalars. The side channel (remote_host, remote_port) must be on the
    prefill pod's own host, or admitted by `admits` (the allow list and the pool)."""
    params = _answer_params(answer)
    _check_ids(params)
    _check_asks_for_pull(params)
    _check_side_channel(params, target, admits)
    extras = _plain_extras(params)
    return {**{k: params[k] for k in _CHECKED if k in params}, **extras}


def _answer_params(answer: bytes) -> dict[str, Any]:
    """The answer's `kv_transfer_params` object: NoKvParams when it has none."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise AnswerError("the prefill's answer is not JSON") from None
    params = data.get(KV_PARAMS) if isinstance(data, dict) else None
    if params is None:
        raise NoKvParams("the prefill's answer has no kv_transfer_params")
    if not isinstance(params, dict):
        raise AnswerError("the prefill's kv_transfer_params are not an object")
    return params


def _check_ids(params: Mapping[str, Any]) -> None:
    for name in _REQUIRED_IDS:
        value = params.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
            raise AnswerError(f"kv_transfer_params.{name} is not an id")


def _check_asks_for_pull(params: Mapping[str, Any]) -> None:
    if params.get("do_remote_prefill") is not True or params.get("do_remote_decode", False):
        raise AnswerError("kv_transfer_params do not ask the decode to pull KV")
    if not _block_ids(params.get("remote_block_ids")):
        raise AnswerError("kv_transfer_params.remote_block_ids is not a list of block ids")


def _check_side_channel(params: Mapping[str, Any], target: HostPort, admits: Admits) -> None:
    channel = side_channel(params.get("remote_host"), params.get("remote_port"))
    if channel.host != target.host and not admits(channel):
        raise AnswerError(f"the prefill names a side channel it may not use: {channel}")


def _plain_value(key: str, value: object) -> bool:
    scalar = value is None or isinstance(value, bool | int | float)
    short = isinstance(value, str) and len(value) <= MAX_EXTRA_STRING_CHARS
    return len(key) <= 64 and (scalar or short)


def _plain_extras(params: Mapping[str, Any]) -> dict[str, Any]:
    """The fields not checked above, each a plain scalar or a short string, and not too many."""
    extras = {k: v for k, v in params.items() if k not in _CHECKED}
    if len(extras) > MAX_EXTRA_FIELDS:
        raise AnswerError("kv_transfer_params has too many fields")
    for key, value in extras.items():
        if not _plain_value(key, value):
            raise AnswerError(f"kv_transfer_params.{shown(key)} is not a plain value")
    return extras


class NixlV2:
    name = "nixlv2"
    uses_engines = False

    def legs(
        self,
        request: ClientRequest,
        target: HostPort,
        engines: EngineMap | None,
        in_flight_by_rank: Mapping[int, int],
    ) -> Legs:
        headers = {REQUEST_ID_HEADER: request.request_id} if request.request_id else {}
        return Legs(
            prefill_body=prefill_body(request.path, request.parsed),
            decode_body=None,
            prefill_headers=headers,
        )

    def decode_body(
        self, request: ClientRequest, prefill_answer: bytes, target: HostPort, admits: Admits
    ) -> bytes:
        params = params_from_answer(prefill_answer, target, admits)
        try:
            return with_field(request.raw, request.parsed, KV_PARAMS, params)
        except BodyError as exc:  # checked above; kept as the pod's fault all the same
            raise AnswerError(str(exc)) from None

    def on_failure(self, status: int | None) -> OnFailure:
        if status is not None and 400 <= status <= 451:
            return OnFailure.PASS_THROUGH  # the request's own fault: the client sees why
        return OnFailure.DECODE_ONLY
