"""The Mooncake P/D protocol as pure functions: engine maps, rank choice, the two bodies.

No I/O here, so every rule is unit-tested without servers. Facts and sources:
DESIGN.md §2 and research/seed-system.md §1, §4, §9.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

KV_PARAMS = "kv_transfer_params"
RANK_HEADER = "x-data-parallel-rank"

EngineMap = dict[int, str]
"""dp rank -> engine_id, as the prefill pod's bootstrap server reports them."""


class BootstrapError(Exception):
    """The bootstrap server's answer cannot be used.

    `pod_down` says the server could not even be reached: the prefill pod itself is gone.
    """

    def __init__(self, message: str, *, pod_down: bool = False) -> None:
        super().__init__(message)
        self.pod_down = pod_down


class BodyError(ValueError):
    """The client's body is not a JSON object."""


def parse_engine_map(payload: bytes) -> EngineMap:
    """Parse `GET /query`: `{"<dp_rank>": {"engine_id": "<id>", "worker_addr": {...}}, ...}`.

    Ranks whose `engine_id` is a string are kept (a rank still registering may have none);
    a null rank is skipped; any other value means we misunderstand the server, so the whole
    answer is refused, as llm-d does. Keys must be integers: vLLM parses the rank header with
    `int()` and would silently ignore anything else, sending the prefill to a random rank.
    """
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise BootstrapError(f"failed to parse bootstrap response: {exc}") from None
    if not isinstance(data, dict):
        raise BootstrapError("failed to parse bootstrap response: not a JSON object")
    engines: EngineMap = {}
    for key, entry in data.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise BootstrapError(
                f"failed to parse bootstrap response: rank {key!r} is not an object"
            )
        engine_id = entry.get("engine_id")
        if not isinstance(engine_id, str) or not engine_id:
            continue
        try:
            rank = int(key)
        except ValueError:
            continue
        if rank >= 0:
            engines[rank] = engine_id
    if not engines:
        raise BootstrapError("engine_id not found in bootstrap response")
    return engines


def pick_rank(
    engines: EngineMap, in_flight: Mapping[int, int], rng: random.Random | None = None
) -> tuple[int, str]:
    """Choose the (dp_rank, engine_id) for one request: the rank with the fewest prefills in
    flight from this processor, ties broken at random so replicas don't all pile onto rank 0.
    """
    fewest = min(in_flight.get(rank, 0) for rank in engines)
    candidates = [rank for rank in engines if in_flight.get(rank, 0) == fewest]
    rank = candidates[0] if len(candidates) == 1 else (rng or random).choice(candidates)
    return rank, engines[rank]


def new_transfer_id() -> str:
    return "xfer-" + str(uuid.uuid4())


def parse_body(raw: bytes) -> dict[str, Any]:
    """The client's request as a JSON object, or BodyError with a message fit for the client."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BodyError(f"invalid JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BodyError(f"request body must be a JSON object, not {type(data).__name__}")
    return data


def decode_params(transfer_id: str, bootstrap_addr: str, engine_id: str) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": transfer_id,
        "remote_bootstrap_addr": bootstrap_addr,
        "remote_engine_id": engine_id,
    }


def prefill_params(transfer_id: str) -> dict[str, Any]:
    return {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": transfer_id}


def decode_body(raw: bytes, parsed: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The body Envoy forwards to the decode pod: the client's, with kv_transfer_params set.

    When the client sent no kv_transfer_params (the normal case) the client's bytes are kept
    and the field is spliced in before the closing brace: no re-serialisation of a prompt
    that may be megabytes long, and numbers keep their exact spelling. Otherwise the client's
    value is replaced (never trusted) and the object re-serialised.
    """
    if KV_PARAMS not in parsed:
        # parse_body proved the last non-blank byte is "}": cut there, copy the prompt once.
        cut = _last_non_blank(raw, len(raw)) - 1
        cut = _last_non_blank(raw, cut)
        tail = (b"," if parsed else b"") + _KV_KEY + orjson.dumps(params) + b"}"
        return b"".join((memoryview(raw)[:cut], tail))
    return orjson.dumps({**parsed, KV_PARAMS: params})


_KV_KEY = b'"' + KV_PARAMS.encode() + b'":'
_JSON_BLANKS = b" \t\r\n"


def _last_non_blank(raw: bytes, end: int) -> int:
    """The end index of `raw[:end]` without trailing JSON whitespace."""
    while end > 0 and raw[end - 1] in _JSON_BLANKS:
        end -= 1
    return end


def prefill_body(path: str, parsed: dict[str, Any], params: dict[str, Any]) -> bytes:
    """The body pdproc sends to the prefill pod: the client's, primed to produce one token."""
    data = {**parsed, KV_PARAMS: params}
    prime_single_token(path, data, parsed)
    return orjson.dumps(data)


def prime_single_token(path: str, target: dict[str, Any], original: Mapping[str, Any]) -> None:
    """Make `target` a request vLLM finishes length-capped after one token, in place.

    vLLM's Mooncake producer ships the KV only when the request finishes
    FINISHED_LENGTH_CAPPED; any other end (a stop string, EOS as the first token, a
    rejected request) silently drops it and the decode waits for KV that never comes.
    The llm-d rules come first (max_tokens=1, max_completion_tokens=1 only if the client
    had it, stream off, no stream_options); the rest closes what llm-d leaves open.
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
