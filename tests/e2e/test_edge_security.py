"""Hostile clients at the edge, through the real Envoy, pdproc and simulated vLLM pair.

What is asserted is what reached the decode pod (the simulator records every request it
gets, on any path) and whether anything contacted the address a client's own
kv_transfer_params named: a loopback "canary" server stands in for the metadata endpoint an
attacker would aim the decode pod at.

- Spellings of a P/D path (percent-encoding, //, dot segments, %2F, letter case, a trailing
  "/", ";params", "%0A" ...) either take the P/D route (through pdproc) or are refused.
- Client kv_transfer_params get a 400 whether pdproc is up (pdproc refuses them), down or
  draining (the kv guard Lua filter after ext_proc refuses them), and never reach the decode.
- A stalled upload ends with a 408 and frees its ext_proc stream; a long token stream is
  not cut.
- Envoy's request body limit is the configured one (also above the 1 MiB connection
  default), with a 413 that says so.
"""

from __future__ import annotations

import http.client
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Stack, http_get, running_stack

from tests.stacks import Canary, reset
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

MiB = 1024 * 1024
ENVOY_BODY_LIMIT = 3 * MiB  # above Envoy's 1 MiB per-connection default on purpose
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
SIM = ["--dp-ranks", "2", "--itl-ms", "2"]
MODES = ["two-message", "single-message"]

# Spellings Envoy's normalisation turns into a P/D path: they take the P/D route.
PD_SPELLINGS = {
    "/v1/chat/%63ompletions": "/v1/chat/completions",
    "/v1%2Fchat%2Fcompletions": "/v1/chat/completions",
    "/v1%2fchat%2fcompletions": "/v1/chat/completions",
    "/v1/%63ompletions": "/v1/completions",
    "/%76%31/chat/completions": "/v1/chat/completions",
    "//v1/chat/completions": "/v1/chat/completions",
    "/v1//chat/completions": "/v1/chat/completions",
    "/v1/./chat/completions": "/v1/chat/completions",
    "/v1/x/../chat/completions": "/v1/chat/completions",
    "/v1/chat/%2e/completions": "/v1/chat/completions",
    "/v1%5Cchat%5Ccompletions": "/v1/chat/completions",
    "/v1/chat/completions%2f%2e%2e%2fcompletions": "/v1/chat/completions",
    "/v1/chat/completions?stream=false": "/v1/chat/completions",
}
# Spellings that stay different from every P/D path: refused (404) before any filter runs.
VARIANT_SPELLINGS = [
    "/v1/chat/completions/",
    "/V1/Chat/Completions",
    "/v1/chat/%43ompletions",
    "/v1/chat/completions;x=1",
    "/v1/chat/completions%3Bx",
    "/v1/chat/completions%0A",
    "/v1/chat/completions%0d%0a",
    "/v1/chat/completions%20",
    "/v1/chat/completions.",
    "/v1/chat/completions%2F",
    "/v1/chat/completions/.",
    "/v1/RESPONSES",
    "/inference/v1/generate/",
]


@pytest.fixture(scope="module")
def canary() -> Iterator[Canary]:
    server = Canary()
    yield server
    server.close()


def attack(canary: Canary, **extra: Any) -> dict[str, Any]:
    """A chat request whose own kv_transfer_params would make the decode pod pull "KV" from
    the canary (in production: any address the decode pod can reach)."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_bootstrap_addr": canary.url,
        "remote_engine_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": canary.port,
        "transfer_id": "t",
    }
    return {**CHAT, "kv_transfer_params": params, **extra}


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def send(
    stack: Stack,
    path: str,
    body: bytes | dict[str, Any] | None,
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> Reply:
    """One request with `path` sent byte for byte (no client-side normalisation)."""
    raw = orjson.dumps(body) if isinstance(body, dict) else body
    conn = http.client.HTTPConnection(stack.envoy.listen.host, stack.envoy.listen.port, timeout=60)
    try:
        all_headers = {"content-type": "application/json", **(headers or {})}
        conn.request(method, path, body=raw, headers=all_headers)
        response = conn.getresponse()
        return Reply(
            response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        )
    finally:
        conn.close()


def target(stack: Stack) -> dict[str, str]:
    return {"x-prefiller-host-port": str(stack.sim.prefill)}


def decode_records(stack: Stack) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = stack.sim_get("decode", "/sim/requests")["requests"]
    return found


def prefill_records(stack: Stack) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = stack.sim_get("prefill", "/sim/requests")["requests"]
    return found


def decode_requests_sent(stack: Stack) -> int:
    """Requests Envoy sent to the decode cluster (whatever the decode did with them)."""
    return stack.envoy.stats("cluster.decode.").get("cluster.decode.upstream_rq_total", 0)


def assert_openai_error(reply: Reply, status: int) -> dict[str, Any]:
    assert reply.status == status, reply.body[:300]
    assert reply.headers["content-type"] == "application/json"
    error: dict[str, Any] = reply.json()
    assert (error["object"], error["code"]) == ("error", status)
    return error


def access_log(stack: Stack, count: int) -> list[dict[str, Any]]:
    """Envoy's JSON access log lines once `count` are there (Envoy flushes every few s)."""

    def lines() -> list[dict[str, Any]] | None:
        text = stack.envoy.process.log_path.read_text("utf-8", errors="replace")
        found = [orjson.loads(line) for line in text.splitlines() if line.startswith("{")]
        return found if len(found) >= count else None

    result: list[dict[str, Any]] = eventually(lines, timeout_s=30)
    return result


# --- pdproc up ----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=MODES)
def edge(request: pytest.FixtureRequest) -> Iterator[Stack]:
    options = {
        "single_message": request.param == "single-message",
        "max_body_bytes": ENVOY_BODY_LIMIT,
    }
    with running_stack(SIM, envoy_options=options) as st:
        yield st


@pytest.fixture
def clean(edge: Stack, canary: Canary) -> Iterator[Stack]:
    """The edge stack reset (as `fresh` resets a suite's `stack`), and after the test the
    check that no client-chosen address was ever contacted."""
    reset(edge)
    sent_before = decode_requests_sent(edge)
    yield edge
    assert canary.hits == [], "the decode pod was pointed at a client-chosen address"
    canary.hits.clear()
    del sent_before


@pytest.mark.parametrize("path", [*PD_SPELLINGS, *VARIANT_SPELLINGS])
def test_no_spelling_carries_client_kv_params_to_the_decode(
    clean: Stack, canary: Canary, path: str
) -> None:
    before = decode_requests_sent(clean)
    reply = send(clean, path, attack(canary), target(clean))
    expected = 400 if path in PD_SPELLINGS else 404
    assert_openai_error(reply, expected)
    assert decode_requests_sent(clean) == before
    assert decode_records(clean) == []
    assert prefill_records(clean) == []
    assert canary.hits == []


@pytest.mark.parametrize("path", list(PD_SPELLINGS))
def test_pd_path_spellings_go_through_pdproc(clean: Stack, path: str) -> None:
    reply = send(clean, path, CHAT, target(clean))
    assert reply.status == 200, reply.body[:300]
    (decode,) = eventually(lambda: [r for r in decode_records(clean) if r["status"]])
    assert decode["path"] == PD_SPELLINGS[path]
    assert decode["body"]["kv_transfer_params"]["transfer_id"].startswith("xfer-")
    (prefill,) = eventually(lambda: [r for r in prefill_records(clean) if r["status"]])
    assert prefill["body"]["kv_transfer_params"]["do_remote_decode"] is True


@pytest.mark.parametrize("path", ["/v1/chat/%63ompletions", "/v1%2Fchat%2Fcompletions"])
def test_pd_path_spellings_do_not_bypass_the_target_allow_list(clean: Stack, path: str) -> None:
    # 127.0.0.2 is loopback but outside the stack's --prefill-allow 127.0.0.1/32.
    bad = {"x-prefiller-host-port": f"127.0.0.2:{clean.sim.prefill.port}"}
    error = assert_openai_error(send(clean, path, CHAT, bad), 403)
    assert error["type"] == "PermissionDeniedError"
    assert decode_records(clean) == []


@pytest.mark.parametrize(
    ("name", "headers"),
    [("with a prefill target", True), ("without a prefill target (no header, no pool)", False)],
)
def test_client_kv_params_get_400_from_pdproc(
    clean: Stack, canary: Canary, name: str, headers: bool
) -> None:
    before = clean.metric("pdproc_requests_total", outcome="bad_request")
    reply = send(clean, "/v1/chat/completions", attack(canary), target(clean) if headers else {})
    error = assert_openai_error(reply, 400)
    assert error["type"] == "BadRequestError"
    assert "kv_transfer_params" in error["message"]
    assert clean.metric("pdproc_requests_total", outcome="bad_request") == before + 1
    assert decode_records(clean) == []
    assert prefill_records(clean) == []


def test_an_escaped_spelling_of_the_key_is_the_same_key(clean: Stack, canary: Canary) -> None:
    body = orjson.dumps(attack(canary)).replace(
        b'"kv_transfer_params"', b'"kv\\u005ftransfer_params"'
    )
    assert_openai_error(send(clean, "/v1/completions", body, target(clean)), 400)
    assert decode_records(clean) == []


def test_bodies_pdproc_checked_are_not_scanned_again(edge: Stack) -> None:
    """Envoy's access log says what the kv guard did: nothing (two-message mode: pdproc's
    mark was there with the headers), or a look at pdproc's mark once the body had passed
    (single-message mode); never a scan."""
    reset(edge)
    before = len(access_log(edge, 0))
    reply = send(edge, "/v1/chat/completions", CHAT, {**target(edge), "x-request-id": "guard-1"})
    assert reply.status == 200
    logged = access_log(edge, before + 1)
    (line,) = [entry for entry in logged if entry["request_id"] == "guard-1"]
    assert line["body_checked"] is True
    single = edge.envoy.config_path.read_text().count("request_header_mode: SKIP") == 1
    assert line["kv_guard"] == ("pdproc_after_body" if single else "pdproc")


def test_body_limit_is_the_configured_one(clean: Stack) -> None:
    """2.5 MiB passes (so the 1 MiB connection default is not what applies); 3.5 MiB gets
    Envoy's 413 naming the configured limit."""
    prompt = "tok " * (640 * 1024)  # 2.5 MiB
    reply = send(clean, "/v1/completions", {"model": "m", "prompt": prompt, "max_tokens": 1},
                 target(clean))  # fmt: skip
    assert reply.status == 200, reply.body[:300]
    big = {"model": "m", "prompt": "tok " * (896 * 1024), "max_tokens": 1}  # 3.5 MiB
    error = assert_openai_error(send(clean, "/v1/completions", big, target(clean)), 413)
    assert error["type"] == "RequestTooLargeError"
    assert f"at most {ENVOY_BODY_LIMIT} bytes" in error["message"]


# --- pdproc down: the kv guard alone ----------------------------------------------------


@pytest.fixture(scope="module", params=MODES)
def unguarded(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """pdproc stopped: ext_proc fails open (failure_mode_allow), only the kv guard is left."""
    options = {
        "single_message": request.param == "single-message",
        "max_body_bytes": ENVOY_BODY_LIMIT,
    }
    with running_stack(SIM, envoy_options=options) as st:
        st.pdproc.stop()
        yield st


CANNOT_VERIFY = "the request body must be a JSON object"
KV_REFUSED = "kv_transfer_params is set by the gateway, not by clients"
ESCAPED_REFUSED = (
    "top-level keys must be written without backslash escapes "
    "(one could spell a field only the gateway sets)"
)


def gateway_only(field: str) -> str:
    return f"{field} is set by the gateway, not by clients"


# (body, the guard's message or None when the body must reach the decode unchanged)
GUARD_CASES: dict[str, tuple[bytes, str | None]] = {
    "plain key": (b'{"model":"m","kv_transfer_params":{"do_remote_prefill":true}}', KV_REFUSED),
    "key first": (b'{"kv_transfer_params":null,"model":"m"}', KV_REFUSED),
    "white space around": (b' \n{ "model" : "m" ,\t"kv_transfer_params" :{} }\r\n', KV_REFUSED),
    "escaped key": (b'{"model":"m","kv\\u005ftransfer_params":{}}', ESCAPED_REFUSED),
    "any escaped key": (b'{"mo\\u0064el":"m"}', ESCAPED_REFUSED),
    "sglang bootstrap_host": (
        b'{"model":"m","bootstrap_host":"10.0.0.9"}',
        gateway_only("bootstrap_host"),
    ),
    "sglang bootstrap_room": (b'{"bootstrap_room":7,"model":"m"}', gateway_only("bootstrap_room")),
    "sglang pair key": (
        b'{"model":"m","bootstrap_pair_key":"k"}',
        gateway_only("bootstrap_pair_key"),
    ),
    "sglang prefill dp rank": (
        b'{"model":"m","disagg_prefill_dp_rank":1}',
        gateway_only("disagg_prefill_dp_rank"),
    ),
    "sglang decode tp size": (b'{"model":"m","decode_tp_size":2}', gateway_only("decode_tp_size")),
    "sglang kv router hint": (
        b'{"model":"m","kv_router_hint":{"source_control_endpoint":"tcp://10.0.0.9:1"}}',
        gateway_only("kv_router_hint"),
    ),
    "duplicate key": (b'{"model":"m","kv_transfer_params":1,"kv_transfer_params":2}', KV_REFUSED),
    "after an escaped quote": (b'{"model":"a\\"","kv_transfer_params":1}', KV_REFUSED),
    "after an escaped backslash": (b'{"model":"a\\\\","kv_transfer_params":1}', KV_REFUSED),
    "after brackets in strings": (b'{"model":"}{][\\"","kv_transfer_params":1}', KV_REFUSED),
    "after nested values": (
        b'{"messages":[{"role":"user","content":[{"type":"text","text":"}"}]}],'
        b'"n":1,"x":null,"t":true,"f":-1.5e3,"kv_transfer_params":{}}',
        KV_REFUSED,
    ),
    "mismatched brackets": (b'{"a":[},"kv_transfer_params":1]}', CANNOT_VERIFY),
    "not an object": (b'[{"kv_transfer_params":1}]', CANNOT_VERIFY),
    "broken": (b'{"model":"m","kv_transfer_params', CANNOT_VERIFY),
    "trailing data": (b'{"model":"m"} {"kv_transfer_params":1}', CANNOT_VERIFY),
    "trailing comma": (b'{"model":"m",}', CANNOT_VERIFY),
    "byte order mark": (b'\xef\xbb\xbf{"kv_transfer_params":1}', CANNOT_VERIFY),
    "utf-16": ('{"kv_transfer_params":1}'.encode("utf-16"), CANNOT_VERIFY),
    "key inside a string": (b'{"model":"m","prompt":"\\"kv_transfer_params\\": {}"}', None),
    "key in a nested object": (b'{"model":"m","extra":{"kv_transfer_params":{}}}', None),
    "key in an array": (b'{"model":"m","stop":["kv_transfer_params"]}', None),
    "escapes in values": (b'{"model":"m","prompt":"a\\nb\\u0041\\\\"}', None),
    "empty object": (b"{}", None),
    "normal chat": (orjson.dumps(CHAT), None),
}


@pytest.mark.parametrize("case", list(GUARD_CASES))
def test_kv_guard_when_pdproc_is_down(unguarded: Stack, canary: Canary, case: str) -> None:
    reset(unguarded)
    body, refused = GUARD_CASES[case]
    before = decode_requests_sent(unguarded)
    reply = send(unguarded, "/v1/chat/completions", body, target(unguarded))
    if refused is None:
        assert reply.status == 200, reply.body[:300]
        (record,) = decode_records(unguarded)
        assert record["body_bytes"] == len(body)
        assert record["body"] == orjson.loads(body)
    else:
        error = assert_openai_error(reply, 400)
        assert (error["type"], error["message"]) == ("BadRequestError", refused)
        assert decode_requests_sent(unguarded) == before
        assert decode_records(unguarded) == []
    assert canary.hits == []


def test_kv_guard_with_a_chunked_body(unguarded: Stack, canary: Canary) -> None:
    reset(unguarded)
    raw = orjson.dumps(attack(canary))

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    response = httpx.post(
        unguarded.envoy.url + "/v1/chat/completions",
        content=chunks(),
        headers={"content-type": "application/json", **target(unguarded)},
        timeout=30,
    )
    assert response.status_code == 400
    assert decode_records(unguarded) == []


def test_kv_guard_lets_large_prompts_through_and_keeps_the_limit(unguarded: Stack) -> None:
    reset(unguarded)
    prompt = "tok\\n " * (400 * 1024)  # 2.4 MiB with 400k escapes
    body = orjson.dumps({"model": "m", "prompt": prompt, "max_tokens": 1})
    reply = send(unguarded, "/v1/completions", body, target(unguarded))
    assert reply.status == 200, reply.body[:300]
    (record,) = decode_records(unguarded)
    assert record["body_bytes"] == len(body)
    big = orjson.dumps({"model": "m", "prompt": "x" * (ENVOY_BODY_LIMIT + 1024)})
    error = assert_openai_error(send(unguarded, "/v1/completions", big, target(unguarded)), 413)
    assert f"at most {ENVOY_BODY_LIMIT} bytes" in error["message"]


def test_pdproc_down_still_serves_the_decode_alone(unguarded: Stack) -> None:
    reset(unguarded)
    reply = send(unguarded, "/v1/chat/completions", CHAT, target(unguarded))
    assert reply.status == 200
    (record,) = decode_records(unguarded)
    assert "kv_transfer_params" not in record["body"]
    stats = unguarded.envoy.stats("http.ingress.ext_proc.")
    assert stats["http.ingress.ext_proc.failure_mode_allowed"] >= 1


# --- pdproc draining --------------------------------------------------------------------


def test_client_kv_params_get_400_while_pdproc_drains(tmp_path: Path, canary: Canary) -> None:
    with running_stack(SIM, ["--shutdown-delay", "5"], workdir=tmp_path) as st:
        st.pdproc.popen.send_signal(signal.SIGTERM)
        eventually(lambda: http_get(st.metrics_addr.url() + "/readyz")[0] == 503)
        for body in (attack(canary), orjson.dumps(attack(canary))):
            reply = send(st, "/v1/chat/completions", body, target(st))
            assert_openai_error(reply, 400)
        assert st.pdproc.popen.poll() is None  # still inside the shutdown delay
        assert decode_records(st) == []
        assert prefill_records(st) == []
        assert canary.hits == []


# --- stalled uploads ----------------------------------------------------------------------


STALLED = 20
UPLOAD_TIMEOUT_S = 5.0


@pytest.mark.parametrize("mode", MODES)
def test_stalled_uploads_get_408_and_free_their_ext_proc_streams(tmp_path: Path, mode: str) -> None:
    options = {
        "single_message": mode == "single-message",
        "request_timeout_s": UPLOAD_TIMEOUT_S,
        "request_headers_timeout_s": 2.0,
        "message_timeout_s": 4.0,
    }
    # 16 tokens 400 ms apart: a token stream that outlives the request timeout.
    sim = ["--dp-ranks", "2", "--itl-ms", "400"]
    with running_stack(sim, envoy_options=options, workdir=tmp_path) as st:
        baseline = st.metric("pdproc_streams_active")
        stream: dict[str, Any] = {}
        streamer = threading.Thread(target=long_stream, args=(st, stream))
        streamer.start()
        started = time.monotonic()
        stalled = stall_uploads(st)
        if mode == "two-message":
            # Each stalled upload holds an ext_proc stream (the headers went to pdproc).
            eventually(lambda: st.metric("pdproc_streams_active") >= baseline + STALLED)
        for sock in stalled:
            check_answered_408(sock)
        assert time.monotonic() - started < 60
        eventually(lambda: st.metric("pdproc_streams_active") == baseline)
        check_envoy_timed_out_and_closed_every_stream(st)
        # The token stream outlived the request timeout and was not cut.
        streamer.join(60)
        assert stream["status"] == 200
        assert time.monotonic() - started > UPLOAD_TIMEOUT_S
        events = [line for line in stream["body"].decode().splitlines() if line.startswith("data:")]
        assert events[-1] == "data: [DONE]"
        assert len(events) >= 17


def long_stream(st: Stack, stream: dict[str, Any]) -> None:
    """A streamed chat through Envoy; its status and whole body go into `stream`."""
    with httpx.Client(timeout=60) as client:
        payload = {**CHAT, "max_tokens": 16, "stream": True}
        url = st.envoy.url + "/v1/chat/completions"
        with client.stream("POST", url, json=payload, headers=target(st)) as response:
            stream["status"] = response.status_code
            stream["body"] = response.read()


def stall_uploads(st: Stack) -> list[socket.socket]:
    """STALLED uploads that send their headers and the start of a body, then nothing; and
    one that stops halfway through its headers."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    stalled = []
    for _ in range(STALLED):
        sock = socket.create_connection((st.envoy.listen.host, st.envoy.listen.port))
        sock.sendall(head + b'content-length: 100000\r\n\r\n{"model":"m","prompt":"')
        stalled.append(sock)
    half_headers = socket.create_connection((st.envoy.listen.host, st.envoy.listen.port))
    half_headers.sendall(head)
    stalled.append(half_headers)
    return stalled


def check_answered_408(sock: socket.socket) -> None:
    """The stalled upload got Envoy's 408, as an OpenAI-style error, and its connection closed."""
    sock.settimeout(60)  # seconds, not the hour a stalled upload used to get
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    body = orjson.loads(answer.split(b"\r\n\r\n", 1)[1])
    assert (body["type"], body["code"]) == ("RequestTimeoutError", 408)


def check_envoy_timed_out_and_closed_every_stream(st: Stack) -> None:
    stats = st.envoy.stats("http.ingress.")
    assert stats["http.ingress.downstream_rq_timeout"] >= STALLED
    assert stats["http.ingress.downstream_rq_header_timeout"] >= 1
    ext_proc = st.envoy.stats("http.ingress.ext_proc.")
    assert ext_proc["http.ingress.ext_proc.streams_started"] == ext_proc.get(
        "http.ingress.ext_proc.streams_closed", 0
    ) + ext_proc.get("http.ingress.ext_proc.streams_failed", 0)
