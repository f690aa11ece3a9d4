"""What only the gateway may tell a pod about KV transfer: body fields and request headers.

A decode server pulls its KV from wherever these say, so a client's own could aim it at any
address. Every path refuses (fields) or strips (headers) them: pdproc on the P/D paths, the
kv guard in Envoy wherever pdproc did not check a body, Envoy's route config for the headers.
"""

from __future__ import annotations

KV_PARAMS = "kv_transfer_params"

# vLLM's `kv_transfer_params` (read by every OpenAI-style route of vLLM 0.32: chat, completions,
# responses, /v1/messages, /invocations, /inference/v1/generate, their /render variants,
# /cohere/v2/chat); SGLang's bootstrap address and room, its pairing key and the prefill DP
# rank holding the KV (GenerateReqInput and the OpenAI request models of SGLang 0.5). Refused
# whichever connector runs: one rule everywhere, and a vLLM server, which ignores SGLang's
# fields, loses nothing.
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
)

# Objects whose own members vLLM also reads the fields from, as paths from the body: vLLM
# builds `SamplingParams.extra_args` from a client's `vllm_xargs` (chat, completions ...), and
# the token-in route takes `sampling_params.extra_args` as it is; the engine's request reads
# `kv_transfer_params` from `extra_args`, so a client's own there would steer the decode
# whenever the top-level field is absent (every decode-only path). A client's gateway field
# in any of these is refused as at the top level. (SGLang reads its bootstrap fields at the
# top level only.)
NESTED_CARRIERS = (("vllm_xargs",), ("sampling_params", "extra_args"))

# SGLang (with SGLANG_ENABLE_REQUEST_HEADER_OVERRIDES) reads the same fields from these
# headers (sglang/srt/entrypoints/request_headers.py). Never forwarded to any pod.
GATEWAY_HEADERS = (
    "x-override-bootstrap-host",
    "x-override-bootstrap-port",
    "x-override-bootstrap-room",
    "x-override-disagg-prefill-dp-rank",
)
