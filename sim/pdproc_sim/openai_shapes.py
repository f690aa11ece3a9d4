"""OpenAI / vLLM request checks and response shapes for the simulated servers."""

from __future__ import annotations

import enum
import hashlib
import time
import uuid
from dataclasses import dataclass
from typing import Any, TypeGuard

import orjson

from pdproc_sim.state import JsonObject

DEFAULT_MODEL = "sim-model"
MAX_GENERATED_TOKENS = 4096

# Cycled to make output text; a fixed vocabulary keeps responses deterministic.
_VOCAB = (" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ".")


class Api(enum.Enum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    GENERATE = "/inference/v1/generate"


class BadRequest(Exception):
    """A request vLLM would answer with 400; messages follow vLLM's where known."""


_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(
    code: int, message: str, err_type: str | None = None, *, sglang: bool = False
) -> JsonObject:
    """vLLM's error body `{"error": {...}}`; SGLang's non-streaming answers put the same
    fields at the top level with `"object": "error"` (its streamed errors are vLLM-shaped)."""
    if err_type is None:
        err_type = _ERROR_TYPES.get(
            code, "InternalServerError" if code >= 500 else "BadRequestError"
        )
    fields: JsonObject = {"message": message, "type": err_type, "param": None, "code": code}
    if sglang:
        return {"object": "error", **fields}
    return {"error": fields}


def role_kv_params(body: JsonObject, role: str, *, remote_decode: bool) -> JsonObject | None:
    """The request's kv_transfer_params if present, checked to carry this role's flags:
    the prefill's `do_remote_decode=true, do_remote_prefill=false`, the decode's the reverse."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise BadRequest("kv_transfer_params must be an object")
    # vLLM reads only the flag of its role (an absent one is false) and serves a request
    # without either as a plain one.
    remote_decode_flag = bool(params.get("do_remote_decode"))
    remote_prefill_flag = bool(params.get("do_remote_prefill"))
    if not (remote_decode_flag or remote_prefill_flag):
        return None
    if remote_decode_flag is not remote_decode or remote_prefill_flag is remote_decode:
        first, second = ("do_remote_decode", "do_remote_prefill")
        if not remote_decode:
            first, second = second, first
        raise BadRequest(f"{role} expects kv_transfer_params with {first}=true and {second}=false")
    return params


def parse_object(raw: bytes) -> JsonObject:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc}") from exc
    if not isinstance(value, dict):
        raise BadRequest("request body must be a JSON object")
    return value


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def sampling(api: Api, body: JsonObject) -> JsonObject:
    """Where the sampling knobs live: generate nests them, the OpenAI APIs don't."""
    if api is Api.GENERATE:
        params = body.get("sampling_params")
        return params if isinstance(params, dict) else {}
    return body


def _positive(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise BadRequest(f"{name} must be at least 1, got {value}.")
    return value


def max_tokens(api: Api, body: JsonObject) -> int | None:
    params = sampling(api, body)
    if api is Api.CHAT:
        # vLLM prefers max_completion_tokens and falls back to the deprecated max_tokens.
        mct = _positive("max_completion_tokens", params.get("max_completion_tokens"))
        mt = _positive("max_tokens", params.get("max_tokens"))
        return mct if mct is not None else mt
    field = "max_output_tokens" if api is Api.RESPONSES else "max_tokens"
    return _positive(field, params.get(field))


def check_sampling(api: Api, body: JsonObject) -> int | None:
    """Validate the length knobs like vLLM; return the effective max_tokens."""
    limit = max_tokens(api, body)
    min_tokens = sampling(api, body).get("min_tokens")
    if limit is not None and _is_int(min_tokens) and min_tokens > limit:
        raise BadRequest(
            f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}."
        )
    return limit


def check_single_sequence(api: Api, body: JsonObject) -> None:
    params = sampling(api, body)
    for name in ("n", "best_of"):
        value = params.get(name)
        if _is_int(value) and value > 1:
            raise BadRequest(f"{name}={value} is not supported with kv_transfer_params.")


def wants_stream(body: JsonObject) -> bool:
    return body.get("stream") is True


def include_usage(body: JsonObject) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _text_chars(value: Any) -> int:
    """Characters of prompt text in a string, a content-part list or a message list."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int):
        return 4  # a token id in a pre-tokenised prompt
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):
        return _text_chars(value.get("content")) + _text_chars(value.get("text"))
    return 0


_PROMPT_FIELD = {Api.CHAT: "messages", Api.COMPLETIONS: "prompt", Api.RESPONSES: "input"}


def prompt_tokens(api: Api, body: JsonObject, body_bytes: int) -> int:
    # ~4 characters per token; only the prompt fields count, so a prefill and its decode
    # (whose kv_transfer_params differ) report the same prompt_tokens.
    if api is Api.GENERATE:
        token_ids = body.get("token_ids")
        return len(token_ids) if isinstance(token_ids, list) else max(1, body_bytes // 4)
    return max(1, _text_chars(body.get(_PROMPT_FIELD[api])) // 4)


def prompt_digest(api: Api, body: JsonObject) -> str:
    """A short fingerprint of the prompt alone, so a decode can tell whether the KV it got was
    computed for its own prompt (the two legs' kv fields and token limits differ)."""
    field = "token_ids" if api is Api.GENERATE else _PROMPT_FIELD[api]
    data = orjson.dumps(body.get(field), option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def token_text(index: int) -> str:
    return _VOCAB[index % len(_VOCAB)]


def _sse(payload: JsonObject, event: str | None = None) -> bytes:
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# What vLLM 0.32 answers beside the OpenAI fields (read from a real engine's answers: the
# contract test in tests/engines/ compares the two).
SYSTEM_FINGERPRINT = "vllm-0.32.0-pdproc-sim"
VLLM_TAIL_FIELDS: dict[str, None] = {"ec_transfer_params": None, "metrics": None}


@dataclass(frozen=True, slots=True)
class Completion:
    """One simulated generation: builds the non-streaming body or the SSE frames."""

    api: Api
    model: str
    n_tokens: int
    finish_reason: str
    prompt_tokens: int
    include_usage: bool
    request_id: str
    created: int
    # Prompt tokens served from the prefix cache; None where the engine has none (vLLM
    # answers prompt_tokens_details only with --enable-prompt-tokens-details).
    cached_tokens: int | None = None

    @classmethod
    def for_request(
        cls,
        api: Api,
        body: JsonObject,
        body_bytes: int,
        n_tokens: int,
        limit: int | None,
        model: str,
        request_id: str | None = None,
        *,
        cached_tokens: int | None = None,
    ) -> Completion:
        requested = body.get("model")
        return cls(
            api=api,
            model=requested if isinstance(requested, str) and requested else model,
            n_tokens=n_tokens,
            finish_reason="length" if limit is not None and n_tokens >= limit else "stop",
            prompt_tokens=prompt_tokens(api, body, body_bytes),
            include_usage=include_usage(body),
            request_id=request_id or uuid.uuid4().hex,
            created=int(time.time()),
            cached_tokens=cached_tokens,
        )

    @property
    def text(self) -> str:
        return "".join(token_text(i) for i in range(self.n_tokens))

    def usage(self) -> JsonObject:
        total = self.prompt_tokens + self.n_tokens
        details = None if self.cached_tokens is None else {"cached_tokens": self.cached_tokens}
        if self.api is Api.RESPONSES:
            usage: JsonObject = {
                "input_tokens": self.prompt_tokens,
                "output_tokens": self.n_tokens,
                "total_tokens": total,
            }
            if details is not None:
                usage["input_tokens_details"] = details
            return usage
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": total,
            "completion_tokens": self.n_tokens,
            "prompt_tokens_details": details,
            "completion_tokens_details": None,
        }

    def body(self) -> JsonObject:
        builders = {
            Api.CHAT: self._chat_body,
            Api.COMPLETIONS: self._completions_body,
            Api.RESPONSES: self._responses_body,
            Api.GENERATE: self._generate_body,
        }
        result = builders[self.api]()
        # vLLM returns the field on every completion; null because nothing is left to hand on.
        result["kv_transfer_params"] = None
        if self.api in (Api.CHAT, Api.COMPLETIONS):
            # vLLM 0.32's other fields of a chat / completion answer, null unless asked for.
            result.update(VLLM_TAIL_FIELDS)
        return result

    def _envelope(self, prefix: str, obj: str) -> JsonObject:
        return {
            "id": f"{prefix}-{self.request_id}",
            "object": obj,
            "created": self.created,
            "model": self.model,
        }

    def _chat_body(self) -> JsonObject:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": self.text},
            "logprobs": None,
            "finish_reason": self.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "routed_experts": None,
        }
        return {
            **self._envelope("chatcmpl", "chat.completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": self.usage(),
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "prompt_text": None,
        }

    def _completions_body(self) -> JsonObject:
        choice = {
            "index": 0,
            "text": self.text,
            "logprobs": None,
            "finish_reason": self.finish_reason,
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
        return {
            **self._envelope("cmpl", "text_completion"),
            "choices": [choice],
            "service_tier": None,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": self.usage(),
        }

    def _responses_body(self, status: str = "completed") -> JsonObject:
        message = {
            "type": "message",
            "id": f"msg_{self.request_id}",
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": self.text, "annotations": []}],
        }
        return {
            "id": f"resp_{self.request_id}",
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [message] if status == "completed" else [],
            "usage": self.usage() if status == "completed" else None,
        }

    def _generate_body(self) -> JsonObject:
        choice = {
            "index": 0,
            "token_ids": [100 + i % len(_VOCAB) for i in range(self.n_tokens)],
            "logprobs": None,
            "finish_reason": self.finish_reason,
        }
        return {"request_id": self.request_id, "choices": [choice], "usage": self.usage()}

    # Streaming. Frames come in three parts so the caller can pace the token frames.

    def head_frames(self) -> list[bytes]:
        if self.api is Api.CHAT:
            delta = {"role": "assistant", "content": ""}
            return [_sse(self._chat_chunk(delta, None))]
        if self.api is Api.RESPONSES:
            created = {"type": "response.created", "sequence_number": 0}
            created["response"] = self._responses_body("in_progress")
            return [_sse(created, "response.created")]
        return []

    def token_frame(self, index: int) -> bytes:
        text = token_text(index)
        finish = self.finish_reason if index == self.n_tokens - 1 else None
        if self.api is Api.CHAT:
            return _sse(self._chat_chunk({"content": text}, finish))
        if self.api is Api.COMPLETIONS:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": None,
                "prompt_token_ids": None,
            }
            return _sse(
                {
                    **self._envelope("cmpl", "text_completion"),
                    "choices": [choice],
                    "system_fingerprint": SYSTEM_FINGERPRINT,
                }
            )
        delta = {
            "type": "response.output_text.delta",
            "sequence_number": index + 1,
            "item_id": f"msg_{self.request_id}",
            "output_index": 0,
            "content_index": 0,
            "delta": text,
        }
        return _sse(delta, "response.output_text.delta")

    def tail_frames(self) -> list[bytes]:
        if self.api is Api.RESPONSES:
            done = {
                "type": "response.completed",
                "sequence_number": self.n_tokens + 1,
                "response": self._responses_body(),
            }
            return [_sse(done, "response.completed")]
        frames = []
        if self.include_usage:
            prefix, obj = (
                ("chatcmpl", "chat.completion.chunk")
                if self.api is Api.CHAT
                else ("cmpl", "text_completion")
            )
            frames.append(
                _sse({**self._envelope(prefix, obj), "choices": [], "usage": self.usage()})
            )
        frames.append(SSE_DONE)
        return frames

    def _chat_chunk(self, delta: JsonObject, finish: str | None) -> JsonObject:
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": None,
        }
        return {
            **self._envelope("chatcmpl", "chat.completion.chunk"),
            "choices": [choice],
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "prompt_token_ids": None,
            "prompt_text": None,
        }
