"""What only the gateway may tell a pod about KV transfer: body fields and request headers.

A decode server pulls its KV from wherever these say, so a client's own could aim it at any
address. Every path refuses (fields) or strips (headers) them: pdproc on the P/D paths, the
kv guard in Envoy wherever pdproc did not check a body, Envoy's route config for the headers.
"""

from __future__ import annotations

KV_PARAMS = "kv_transfer_params"

# vLLM's `kv_transfer_params` (read by every OpenAI-style route of vLLM 0.32: chat, completions,
# responses, /v1/messages, /invocations, /inference/v1/generate, their /render variants,
# /cohere/v2/chat), and what SGLang's disaggregation reads from a request body. SGLang's
# OpenAI request models (`ChatCompletionRequest`, `CompletionRequest` in
# python/sglang/srt/entrypoints/openai/protocol.py, passed on by serving_chat.py and
# serving_completions.py) carry the bootstrap address and room and the prefill DP rank
# holding the KV; its native /generate request (`GenerateReqInput`,
# python/sglang/srt/managers/io_struct.py, "for disaggregated inference") also the pairing
# key, the decode's TP size (which shapes the KV the prefill sends: its router sets it) and
# `kv_router_hint`, a router's pointer to the peer (a control endpoint) holding a reusable
# prefix, which SGLang's HiCache storage backend then reads KV from. Refused whichever
# connector runs: one rule everywhere, and a vLLM server, which ignores SGLang's fields, loses
# nothing.
GATEWAY_FIELDS = (
    KV_PARAMS,
    # vLLM's encoder-cache transfer (encoder outputs pulled from another instance): the same
    # kind of gateway-only pointer.
    "ec_transfer_params",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "disagg_prefill_dp_rank",
    "decode_tp_size",
    "kv_router_hint",
)

# Objects whose own members vLLM also reads the fields from, as paths from the body: vLLM
# builds `SamplingParams.extra_args` from a client's `vllm_xargs` (chat, completions ...), and
# the token-in route takes `sampling_params.extra_args` as it is; the engine's request reads
# `kv_transfer_params` from `extra_args`, so a client's own there would steer the decode
# whenever the top-level field is absent (every decode-only path). A client's gateway field
# in any of these is refused as at the top level. (SGLang reads its fields at the top level
# only: its `sampling_params` struct, python/sglang/srt/sampling/sampling_params.py, has none
# of them, and `custom_params` reaches only custom logit processors.)
NESTED_CARRIERS = (("vllm_xargs",), ("sampling_params", "extra_args"))

# SGLang (with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES) reads the same fields from these
# headers (sglang/srt/entrypoints/request_headers.py). Never forwarded to any pod.
GATEWAY_HEADERS = (
    "x-override-bootstrap-host",
    "x-override-bootstrap-port",
    "x-override-bootstrap-room",
    "x-override-disagg-prefill-dp-rank",
)
