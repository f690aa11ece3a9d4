"""vLLM's NIXL connector, as llm-d's `nixlv2` protocol: the prefill first, then the decode.

The prefill gets the client's request with `kv_transfer_params` asking it to keep the KV
for a remote decode, primed to one token and not streamed. Its answer carries the
`kv_transfer_params` the decode needs to pull that KV (the prefill's engine id, block ids,
host and port); the decode then gets the client's own request (stream, stream options and
token limits as the client sent them) with those params. A prefill that refuses the
request (400-451) answers the client as it is; any other failure lets the decode serve the
request alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from pdproc.connectors import ClientRequest, EngineMap, Legs, OnFailure
from pdproc.request_body import KV_PARAMS, BodyError, dumps, prime_single_token, with_field
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


def prefill_body(path: str, parsed: Mapping[str, Any]) -> bytes:
    data = {**parsed, KV_PARAMS: PREFILL_PARAMS}
    prime_single_token(path, data, parsed)
    for name in token_limit_fields(path):
        data[name] = 1
    return dumps(data)


def params_from_answer(answer: bytes) -> dict[str, Any]:
    """The `kv_transfer_params` of a prefill's answer, or BodyError when there are none."""
    try:
        data = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise BodyError("the prefill's answer is not JSON") from None
    params = data.get(KV_PARAMS) if isinstance(data, dict) else None
    if not isinstance(params, dict) or not params.get("remote_engine_id"):
        raise BodyError("the prefill's answer has no kv_transfer_params")
    return params


class NixlV2:
    name = "nixlv2"
    uses_engines = False
    sequential = True

    def legs(
        self,
        request: ClientRequest,
        target: HostPort,
        engines: EngineMap | None,
        busy_ranks: Mapping[int, int],
    ) -> Legs:
        headers = {REQUEST_ID_HEADER: request.request_id} if request.request_id else {}
        return Legs(
            prefill_body=prefill_body(request.path, request.parsed),
            decode_body=None,
            prefill_headers=headers,
        )

    def decode_body(self, request: ClientRequest, prefill_answer: bytes) -> bytes:
        params = params_from_answer(prefill_answer)
        return with_field(request.raw, request.parsed, KV_PARAMS, params)

    def on_failure(self, status: int | None) -> OnFailure:
        if status is not None and 400 <= status <= 451:
            return OnFailure.PASS_THROUGH  # the request's own fault: the client sees why
        return OnFailure.DECODE_ALONE
