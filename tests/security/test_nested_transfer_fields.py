"""Transfer fields nested where vLLM reads them too, and the kv guard's bounds.

vLLM builds `SamplingParams.extra_args` from a client's `vllm_xargs` (chat, completions) and
takes `sampling_params.extra_args` as it is on `/inference/v1/generate`; its engine reads
`kv_transfer_params` from `extra_args`, so a client's own there steered the decode on every
decode-only path, and pdproc and the kv guard passed it unchanged. `ec_transfer_params` is
the same kind of field. Now they are refused with a 400 in every mode: pool P/D and
decode-only (pdproc's own 400) and with pdproc stopped (the kv guard's).

The guard's walk was unbounded: 16 MiB of `[],[],...` cost 0.75 s of an Envoy worker and an
8-million-deep body grew Envoy by 90 MiB. Now past 254 levels or 2,097,152 finds it refuses.
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.stacks import records, reset

from .conftest import SIM_ARGS, metric, send

GENERATE = "/inference/v1/generate"
CHAT = "/v1/chat/completions"
EVIL = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://169.254.169.254:80"}
MESSAGES = [{"role": "user", "content": "Hello"}]


def chat(**fields: object) -> bytes:
    return orjson.dumps({"model": "m", "messages": MESSAGES, "max_tokens": 4, **fields})


def generate(extra_args: object) -> bytes:
    return orjson.dumps(
        {
            "model": "m",
            "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 4, "extra_args": extra_args},
        }
    )


# (path, body): each must be refused on every path and mode.
NESTED = {
    "vllm_xargs dict": (CHAT, chat(vllm_xargs={"kv_transfer_params": EVIL})),
    "vllm_xargs list": (CHAT, chat(vllm_xargs={"kv_transfer_params": [1, 2]})),
    "vllm_xargs string": (CHAT, chat(vllm_xargs={"kv_transfer_params": "x"})),
    "vllm_xargs ec": (CHAT, chat(vllm_xargs={"ec_transfer_params": EVIL})),
    "vllm_xargs completions": (
        "/v1/completions",
        orjson.dumps({"model": "m", "prompt": "x", "vllm_xargs": {"kv_transfer_params": EVIL}}),
    ),
    "vllm_xargs escaped key": (
        CHAT,
        chat()[:-1] + b',"vllm_xargs":{"kv_transfer_param\\u0073":{"a":1}}}',
    ),
    "vllm_xargs twice": (
        CHAT,
        chat()[:-1] + b',"vllm_xargs":{"a":1},"vllm_xargs":{"kv_transfer_params":{}}}',
    ),
    "generate extra_args": (GENERATE, generate({"kv_transfer_params": EVIL})),
    "generate extra_args ec": (GENERATE, generate({"ec_transfer_params": EVIL})),
    "top-level ec": (CHAT, chat(ec_transfer_params=EVIL)),
}
CARRIED = {
    "vllm_xargs other keys": (CHAT, chat(vllm_xargs={"foo": "kv_transfer_params"})),
    "extra_args other keys": (GENERATE, generate({"foo": 1})),
}
MODES = ["two-message", "single-message"]


@pytest.fixture(scope="module", params=MODES)
def up(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """pdproc with a static prefill pool: no header is pool P/D, an empty one decode-only."""
    options = {"single_message": request.param == "single-message"}
    with running_stack(SIM_ARGS, ["--shutdown-delay", "0"], pool=True, envoy_options=options) as st:
        yield st


@pytest.fixture(scope="module", params=MODES)
def down(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """pdproc stopped: Envoy fails open and only the kv guard is left."""
    options = {"single_message": request.param == "single-message"}
    with running_stack(SIM_ARGS, envoy_options=options) as st:
        st.pdproc.stop()
        yield st


def assert_refused_and_unsent(stack: Stack, path: str, body: bytes, prefill: str | None) -> str:
    reset(stack)
    reply = send(stack, body, prefill, path=path)
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()
    assert error["type"] == "BadRequestError"
    assert records(stack, "decode") == []
    assert records(stack, "prefill") == []
    message: str = error["message"]
    return message


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(NESTED))
@pytest.mark.parametrize("prefill", [None, ""], ids=["pool-pd", "decode-only"])
def test_nested_transfer_fields_get_400_from_pdproc(
    up: Stack, case: str, prefill: str | None
) -> None:
    refused = metric(up, "pdproc_requests_total", outcome="bad_request")
    path, body = NESTED[case]
    message = assert_refused_and_unsent(up, path, body, prefill)
    assert "_transfer_params is set by the gateway, not by clients" in message
    assert metric(up, "pdproc_requests_total", outcome="bad_request") == refused + 1


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(NESTED))
def test_nested_transfer_fields_get_400_from_the_kv_guard(down: Stack, case: str) -> None:
    path, body = NESTED[case]
    message = assert_refused_and_unsent(down, path, body, None)
    assert "is set by the gateway" in message or "backslash escapes" in message


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(CARRIED))
def test_other_nested_keys_reach_the_decode(up: Stack, down: Stack, case: str) -> None:
    path, body = CARRIED[case]
    for stack, prefill in ((up, ""), (down, None)):
        reset(stack)
        reply = send(stack, body, prefill, path=path)
        assert reply.status_code == 200, reply.text[:300]
        (record,) = records(stack, "decode")
        assert "kv_transfer_params" not in record["body"]


# --- the kv guard's bounds (pdproc stopped) ---------------------------------------------

MiB = 1024 * 1024


@pytest.mark.e2e
def test_the_guard_refuses_a_body_nested_deeper_than_pdproc_allows(down: Stack) -> None:
    deep = b'{"model":"m","x":' + b"[" * 300 + b"]" * 300 + b',"kv_transfer_params":1}'
    message = assert_refused_and_unsent(down, CHAT, deep, None)
    assert "nested too deeply for the gateway to check it" in message
    # An 8 MiB deep body (8 million levels before): refused as soon as the bound is passed.
    deeper = b'{"model":"m","x":' + b"[" * (8 * MiB) + b"]" * 8 + b"}"
    message = assert_refused_and_unsent(down, CHAT, deeper, None)
    assert "nested too deeply" in message
    # 253 levels inside the body are what pdproc accepts: the guard too.
    reset(down)
    fits = b'{"model":"m","messages":[{"role":"user","content":"x"}],"x":' + b"[" * 253
    reply = send(down, fits + b"]" * 253 + b"}", None, path=CHAT)
    assert reply.status_code == 200, reply.text[:300]


@pytest.mark.e2e
def test_the_guard_refuses_a_body_with_more_tokens_than_its_bound(down: Stack) -> None:
    wide = b'{"model":"m","x":[' + b"[]," * (3 * MiB) + b'[]],"kv_transfer_params":1}'
    message = assert_refused_and_unsent(down, CHAT, wide, None)
    assert "too many JSON tokens for the gateway to check it" in message
    # 16,384 chat messages (2 MiB) are well inside the bound.
    reset(down)
    many = chat(messages=[{"role": "user", "content": "m" * 100}] * 16384)
    reply = send(down, many, None, path=CHAT)
    assert reply.status_code == 200, reply.text[:300]
