"""The KV connectors the simulated pair speaks, one at a time (`--kv-connector`).

What each leg must carry, checked the way the real servers (or, where they would silently
fall back, the llm-d sidecar's contract) expect:

- mooncake (vLLM MooncakeConnector, concurrent legs): the prefill gets
  `kv_transfer_params {do_remote_prefill: false, do_remote_decode: true, transfer_id}` and
  `X-data-parallel-rank`; the decode gets `{do_remote_prefill: true, do_remote_decode: false,
  transfer_id, remote_bootstrap_addr, remote_engine_id}` and waits for that transfer.
- nixlv2 (vLLM NixlConnector, sequential legs): the prefill gets `{do_remote_decode: true,
  do_remote_prefill: false}` (the remote_* fields null), `stream: false`, one token, and
  answers the decode's `kv_transfer_params`; the decode gets those and reads the blocks.
  Both legs carry the same `x-request-id`.
- sglang (SGLang disaggregation, concurrent legs): both legs get the same body plus
  `bootstrap_host`, `bootstrap_port`, `bootstrap_room`; each waits for the other.

This module only parses and checks what a request carries (pure); prefill.py and decode.py
act on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from pdproc_sim.openai_shapes import BadRequest, role_kv_params
from pdproc_sim.state import JsonObject

MOONCAKE: Final = "mooncake"
NIXLV2: Final = "nixlv2"
SGLANG: Final = "sglang"
CONNECTORS: Final = (MOONCAKE, NIXLV2, SGLANG)
DEFAULT_CONNECTOR: Final = MOONCAKE

REQUEST_ID_HEADER: Final = "x-request-id"
# bootstrap_room is a random non-negative int64 (llm-d: UnixNano + rand; SGLang's router:
# random.randint(0, 2**63 - 1)).
ROOM_LIMIT: Final = 2**63

# How long a decode waits for its KV by default: vLLM's Mooncake/NIXL abort timeout
# (VLLM_*_ABORT_REQUEST_TIMEOUT, 480 s) and SGLang's SGLANG_DISAGGREGATION_WAITING_TIMEOUT
# (300 s). An SGLang prefill waits as long for its decode to bootstrap
# (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s).
DEFAULT_KV_TIMEOUT_S: Final = {MOONCAKE: 480.0, NIXLV2: 480.0, SGLANG: 300.0}
SGLANG_BOOTSTRAP_TIMEOUT_S: Final = 300.0

SGLANG_NO_ROOM: Final = "Disaggregated request received without bootstrap room id"


def check_connector(name: str) -> str:
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; one of {', '.join(CONNECTORS)}")
    return name


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonempty_str(params: Mapping[str, Any], name: str, where: str) -> str:
    value = params.get(name)
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{where}.{name} must be a non-empty string")
    return value


def request_id(headers: Mapping[str, str]) -> str | None:
    """The leg's x-request-id (llm-d sends the same on both nixlv2 legs; when both carry one,
    the simulated decode checks they match). vLLM requires none."""
    return headers.get(REQUEST_ID_HEADER) or None


# --- prefill leg ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefillTicket:
    """A prefill that must hand KV to a decode. `key` names it in the transfer registry:
    Mooncake's transfer_id, SGLang's room (as a string); nixlv2 keys are minted later."""

    connector: str
    key: str | None
    request_id: str | None
    room: int | None = None


def prefill_ticket(
    connector: str, body: JsonObject, headers: Mapping[str, str], stream: bool
) -> PrefillTicket | None:
    """What the prefill leg carries for `connector`; None for a plain request."""
    if connector == SGLANG:
        room = sglang_room(body)
        return None if room is None else PrefillTicket(SGLANG, str(room), None, room)
    params = role_kv_params(body, "prefill", remote_decode=True)
    if params is None:
        return None
    if connector == MOONCAKE:
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id:
            # vLLM logs "Missing transfer_id in kv_transfer_params from router!" and serves
            # the request without keeping its KV.
            return None
        return PrefillTicket(MOONCAKE, transfer_id, request_id(headers))
    # NIXL's prefill reads only do_remote_decode: any remote_* values are ignored.
    if stream:
        raise BadRequest(
            "the nixlv2 prefill must be stream=false: the decode needs the "
            "kv_transfer_params of its JSON answer"
        )
    return PrefillTicket(NIXLV2, None, request_id(headers))


def sglang_room(body: JsonObject) -> int | None:
    """Check SGLang's bootstrap fields; the room, or None when the request has none."""
    room = body.get("bootstrap_room")
    host = body.get("bootstrap_host")
    port = body.get("bootstrap_port")
    if room is None:
        if host is not None or port is not None:
            raise BadRequest(SGLANG_NO_ROOM)
        return None
    if not _is_int(room) or not 0 <= room < ROOM_LIMIT:
        raise BadRequest(f"bootstrap_room must be an integer in [0, 2**63), got {room!r}")
    if not isinstance(host, str) or not host:
        raise BadRequest("bootstrap_host must be a non-empty string")
    if not _is_int(port) or not 0 < port < 65536:
        raise BadRequest(f"bootstrap_port must be a port number, got {port!r}")
    result: int = room
    return result


# --- decode leg ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DecodeTicket:
    """Where a decode fetches its KV and what it expects to find there."""

    connector: str
    key: str  # transfer_id / remote_request_id / room
    url: str  # base URL of the prefill's bootstrap / side-channel server
    engine_id: str | None = None
    block_ids: tuple[int, ...] = ()
    request_id: str | None = None
    room: int | None = None


def decode_ticket(
    connector: str, body: JsonObject, headers: Mapping[str, str]
) -> DecodeTicket | None:
    """What the decode leg carries for `connector`; None for a plain (decode-only) request."""
    if connector == SGLANG:
        room = sglang_room(body)
        if room is None:
            return None
        url = f"http://{_host(body['bootstrap_host'])}:{body['bootstrap_port']}"
        return DecodeTicket(SGLANG, str(room), url, room=room)
    params = role_kv_params(body, "decode", remote_decode=False)
    if params is None:
        return None
    where = "kv_transfer_params"
    if connector == MOONCAKE:
        transfer_id = _nonempty_str(params, "transfer_id", where)
        bootstrap = _nonempty_str(params, "remote_bootstrap_addr", where)
        engine_id = _nonempty_str(params, "remote_engine_id", where)
        return DecodeTicket(MOONCAKE, transfer_id, bootstrap.rstrip("/"), engine_id)
    engine_id = _nonempty_str(params, "remote_engine_id", where)
    remote_request = _nonempty_str(params, "remote_request_id", where)
    host = _nonempty_str(params, "remote_host", where)
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        raise BadRequest(f"{where}.remote_port must be a port number, got {port!r}")
    blocks = block_ids(params.get("remote_block_ids"))
    if not blocks:
        raise BadRequest(
            f"{where}.remote_block_ids must be a non-empty list of integers "
            "(or one such list per KV cache group)"
        )
    rid = request_id(headers)
    url = f"http://{_host(host)}:{port}"
    return DecodeTicket(NIXLV2, remote_request, url, engine_id, blocks, rid)


def block_ids(value: Any) -> tuple[int, ...]:
    """NIXL's remote_block_ids as one flat tuple: vLLM 0.32 sends one list per KV cache
    group, older releases (and llm-d's contract) a flat list. Empty when neither."""
    if not isinstance(value, list) or not value:
        return ()
    if all(_is_int(b) for b in value):
        return tuple(value)
    if all(isinstance(g, list) and all(_is_int(b) for b in g) for g in value):
        return tuple(b for g in value for b in g)
    return ()


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
