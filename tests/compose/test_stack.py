"""docker-compose.yaml's stack, through its containers: P/D requests checked in the
simulator's records, /metrics, `docker stop` draining, a killed pdproc (Envoy fails open and
the kv guard keeps client params out) and a restarted one serving again."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import httpx
import orjson
import yaml

from tests.waiting import eventually

from .conftest import REPO, START_S, ComposeStack

# What other containers reach (counters, state): a bound, generous on a shared machine.
SETTLE_S = 60.0

PATH = "/v1/chat/completions"


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 6,
        **extra,
    }


def post(stack: ComposeStack, body: dict[str, Any], timeout_s: float = 120) -> httpx.Response:
    return httpx.post(stack.http + PATH, json=body, timeout=timeout_s)


def record_for(stack: ComposeStack, role: str, prompt: str) -> dict[str, Any] | None:
    """The simulator's last record of a request whose prompt was `prompt`."""
    for record in reversed(stack.sim_requests(role)):
        body = record.get("body") or {}
        if isinstance(body, dict) and body.get("messages", [{}])[0].get("content") == prompt:
            return record
    return None


def assert_disaggregated(stack: ComposeStack, prompt: str, *, stream: bool) -> None:
    """The decode got the gateway's params for this prompt, the prefill ran it with the same
    transfer id, and the decode found its KV."""
    params = assert_decode_leg(stack, prompt, stream=stream)
    assert_prefill_leg(stack, prompt, params)


def assert_decode_leg(stack: ComposeStack, prompt: str, *, stream: bool) -> dict[str, Any]:
    """The decode's record of this prompt: the gateway's params (returned), the client's
    stream flag, answered 200 with its KV shipped."""
    decode = record_for(stack, "decode", prompt)
    assert decode is not None, "the decode never got the request"
    params: dict[str, Any] = decode["body"]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_bootstrap_addr"] == "http://sim:8998"
    assert decode["body"].get("stream", False) is stream
    assert decode["status"] == 200, decode
    assert decode["kv"]["shipped"] is True, decode
    return params


def assert_prefill_leg(stack: ComposeStack, prompt: str, params: dict[str, Any]) -> None:
    prefill = record_for(stack, "prefill", prompt)
    assert prefill is not None, "no prefill ran for the request"
    leg = prefill["body"]["kv_transfer_params"]
    assert leg["transfer_id"] == params["transfer_id"]
    assert leg["do_remote_decode"] is True
    assert prefill["body"]["max_tokens"] == 1
    assert prefill["status"] == 200


def paired(stack: ComposeStack) -> bool:
    """One plain request through Envoy, answered 200 after a prefill (P/D, not decode-only)."""
    prompt = f"paired? {uuid.uuid4()}"
    try:
        response = post(stack, chat(prompt), timeout_s=30)
    except httpx.HTTPError:
        return False
    decode = record_for(stack, "decode", prompt)
    return (
        response.status_code == 200
        and decode is not None
        and "kv_transfer_params" in decode["body"]
        and record_for(stack, "prefill", prompt) is not None
    )


def test_streaming_and_plain_requests_are_disaggregated(stack: ComposeStack) -> None:
    before = stack.metric("pdproc_requests_total", outcome="pd", path=PATH)

    plain = f"plain {uuid.uuid4()}"
    response = post(stack, chat(plain))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]
    assert_disaggregated(stack, plain, stream=False)

    streamed = f"streamed {uuid.uuid4()}"
    body = chat(streamed, stream=True)
    with httpx.stream("POST", stack.http + PATH, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    tokens = [orjson.loads(f)["choices"][0]["delta"].get("content") for f in frames[:-1]]
    assert any(tokens), frames
    assert_disaggregated(stack, streamed, stream=True)

    eventually(
        lambda: stack.metric("pdproc_requests_total", outcome="pd", path=PATH) == before + 2,
        SETTLE_S,
    )


def test_metrics_health_and_readiness(stack: ComposeStack) -> None:
    assert paired(stack)
    response = httpx.get(stack.metrics + "/metrics", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    page = response.text
    for family in (
        "pdproc_requests_total",
        "pdproc_prefills_total",
        "pdproc_prefill_duration_seconds",
        "pdproc_prefills_in_flight",
        "process_resident_memory_bytes",
    ):
        assert f"# TYPE {family} " in page, f"/metrics has no {family}"
    assert stack.metric("pdproc_requests_total", outcome="pd", path=PATH) >= 1
    assert httpx.get(stack.metrics + "/healthz", timeout=10).status_code == 200
    assert httpx.get(stack.metrics + "/readyz", timeout=10).status_code == 200
    # Envoy's own view: ext_proc talked to pdproc without protocol errors.
    assert stack.envoy_stat("http.ingress.ext_proc.streams_started") >= 1


def test_docker_stop_drains_in_flight_requests_then_a_restart_serves(
    stack: ComposeStack,
) -> None:
    container = stack.container("pdproc")
    assert_stop_waits_the_grace_period(stack, container)

    # A request held in its prefill when the stop comes.
    stack.sim_faults(prefill_hang=True)
    held = f"held {uuid.uuid4()}"
    result: dict[str, Any] = {}
    client = threading.Thread(target=lambda: result.update(r=post(stack, chat(held))))
    client.start()
    eventually(lambda: stack.metric("pdproc_prefills_in_flight") == 1, SETTLE_S)

    stopper = threading.Thread(
        target=lambda: result.update(stop=stack.docker_run("stop", container))
    )
    stopper.start()
    # Draining: not ready any more, still running, the request still held.
    eventually(lambda: httpx.get(stack.metrics + "/readyz", timeout=5).status_code == 503, SETTLE_S)
    assert stack.state("pdproc")["Running"] is True
    assert client.is_alive()
    # A request that comes while pdproc drains is served too (by pdproc, or by the decode
    # alone once pdproc takes no new streams).
    late = threading.Thread(
        target=lambda: result.update(late=post(stack, chat(f"late {uuid.uuid4()}")))
    )
    late.start()

    stack.sim_faults(prefill_hang=False)
    for thread in (client, late):
        thread.join(120)
        assert not thread.is_alive()
    stopper.join(START_S)
    assert not stopper.is_alive()
    assert result["r"].status_code == 200, result["r"].text
    assert result["late"].status_code == 200, result["late"].text
    assert_disaggregated(stack, held, stream=False)

    assert_exited_by_itself_drained(stack)

    stack.run("start", "pdproc")
    eventually(lambda: stack.healthy("pdproc"), START_S, 1.0)
    eventually(lambda: paired(stack), START_S, 1.0)


def assert_stop_waits_the_grace_period(stack: ComposeStack, container: str) -> None:
    """Compose hands the grace period to the container: a plain `docker stop` waits as
    long."""
    compose = yaml.safe_load((REPO / "docker-compose.yaml").read_text())
    grace = compose["services"]["pdproc"]["stop_grace_period"]
    timeout = stack.docker_run("inspect", "--format", "{{.Config.StopTimeout}}", container)
    assert f"{timeout.strip()}s" == grace


def assert_exited_by_itself_drained(stack: ComposeStack) -> None:
    """It exited by itself, within the budget: 0, not the SIGKILL at its end (137), and
    no prefill was abandoned."""
    state = stack.state("pdproc")
    assert state["Running"] is False
    assert state["ExitCode"] == 0, state
    assert state["OOMKilled"] is False, state
    log = stack.logs("pdproc")
    assert "pdproc stopped" in log, log[-2000:]
    assert "abandoned_prefills=0" in log, log[-2000:]


def test_killed_pdproc_fails_open_safely_and_a_restart_serves(stack: ComposeStack) -> None:
    assert paired(stack)
    allowed = stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed")
    stack.run("kill", "pdproc")  # SIGKILL: no drain, no goodbye
    eventually(lambda: not stack.state("pdproc")["Running"], SETTLE_S)

    # Requests go on: Envoy fails open to the decode, which serves them alone.
    alone = f"alone {uuid.uuid4()}"

    def served_alone() -> bool:
        try:
            return post(stack, chat(alone), timeout_s=30).status_code == 200
        except httpx.HTTPError:
            return False

    eventually(served_alone, START_S, 1.0)
    decode = record_for(stack, "decode", alone)
    assert decode is not None
    assert "kv_transfer_params" not in decode["body"]
    assert record_for(stack, "prefill", alone) is None
    assert stack.envoy_stat("http.ingress.ext_proc.failure_mode_allowed") > allowed

    # ... but a client's own kv_transfer_params never reach the decode: the kv guard in
    # Envoy refuses them while nothing checked the body.
    hostile = f"hostile {uuid.uuid4()}"
    params = {"do_remote_prefill": True, "remote_bootstrap_addr": "http://198.51.100.7:8998"}
    refused = post(stack, chat(hostile, kv_transfer_params=params))
    assert refused.status_code == 400, refused.text
    assert refused.headers["x-pdproc-error"] == "bad_request"
    assert refused.json()["message"] == "kv_transfer_params is set by the gateway, not by clients"
    assert record_for(stack, "decode", hostile) is None

    stack.run("start", "pdproc")
    eventually(lambda: stack.healthy("pdproc"), START_S, 1.0)
    eventually(lambda: paired(stack), START_S, 1.0)
