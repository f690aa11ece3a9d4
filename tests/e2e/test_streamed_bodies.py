"""Large bodies streamed past pdproc (`--stream-body-bytes`), through a real Envoy.

The client sends its body piece by piece, each piece only once Envoy has had pdproc's answer
to the previous message (Envoy's own ext_proc counters say so), so Envoy really passes the
body on in several chunks, as it does for a client on a slower link than loopback.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.stacks import records, served
from tests.waiting import eventually

from .conftest import SIM_ARGS, ext_proc_errors

pytestmark = pytest.mark.e2e

KiB = 1024
PROMPT = "tok " * (150 * KiB)  # 600 KiB: above the 256 KiB default threshold
KV_REFUSED = "kv_transfer_params is set by the gateway, not by clients"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """Two-message mode only (single-message mode never streams); conftest's `fresh` resets
    it between tests."""
    with running_stack(SIM_ARGS) as st:
        yield st


def ext_proc_counter(stack: Stack, name: str) -> int:
    return stack.envoy.stats("http.ingress.ext_proc.")[f"http.ingress.ext_proc.{name}"]


class PacedUpload:
    """One HTTP/1.1 request whose body goes out in pieces; each piece is sent only after
    pdproc has answered every message Envoy sent it so far."""

    def __init__(self, stack: Stack, path: str, length: int, headers: dict[str, str]) -> None:
        self.stack = stack
        self.answered = ext_proc_counter(stack, "stream_msgs_received")
        self.sock = socket.create_connection(
            (stack.envoy.listen.host, stack.envoy.listen.port), timeout=60
        )
        lines = [f"POST {path} HTTP/1.1", "host: gateway", "content-type: application/json"]
        lines += [f"{key}: {value}" for key, value in headers.items()]
        lines.append(f"content-length: {length}")
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        self.wait_answers(1)  # the request headers

    def wait_answers(self, more: int) -> None:
        self.answered += more
        eventually(lambda: ext_proc_counter(self.stack, "stream_msgs_received") >= self.answered)

    def piece(self, data: bytes) -> None:
        """Send a piece that is not the last and wait until pdproc answered it."""
        self.sock.sendall(data)
        self.wait_answers(1)

    def finish(self, data: bytes) -> tuple[int, dict[str, str], bytes]:
        self.sock.sendall(data)
        response = http.client.HTTPResponse(self.sock)
        try:
            response.begin()
            body = response.read()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, body
        finally:
            response.close()
            self.sock.close()


def paced(stack: Stack, body: bytes, pieces: int = 3, path: str = "/v1/completions") -> Any:
    upload = PacedUpload(stack, path, len(body), {"x-prefiller-host-port": str(stack.sim.prefill)})
    size = len(body) // pieces
    for i in range(pieces - 1):
        upload.piece(body[i * size : (i + 1) * size])
    return upload.finish(body[(pieces - 1) * size :])


def test_a_paced_large_body_streams_in_chunks_and_pairs(fresh: Stack) -> None:
    streamed = fresh.metric("pdproc_streamed_request_bodies_total")
    sent = ext_proc_counter(fresh, "stream_msgs_sent")
    body = orjson.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4}) + b"\n"
    status, _, answer = paced(fresh, body, pieces=4)
    assert status == 200, answer[:300]
    # headers + at least 4 body chunks + the decode's response headers
    assert ext_proc_counter(fresh, "stream_msgs_sent") - sent >= 6
    assert fresh.metric("pdproc_streamed_request_bodies_total") == streamed + 1
    prefill, decode = served(fresh, "prefill")[0], served(fresh, "decode")[0]
    assert_streamed_on_without_pdproc_headers(decode)
    assert_paired_with_fields_spliced(prefill, decode, body)
    assert ext_proc_errors(fresh)["streams_failed"] == 0
    eventually(lambda: fresh.metric("pdproc_request_body_bytes_in_flight") == 0)


def assert_streamed_on_without_pdproc_headers(decode: dict[str, Any]) -> None:
    assert decode["headers"].get("transfer-encoding") == "chunked"
    assert "content-length" not in decode["headers"]
    assert "x-prefiller-host-port" not in decode["headers"]


def assert_paired_with_fields_spliced(
    prefill: dict[str, Any], decode: dict[str, Any], body: bytes
) -> None:
    """The decode got the client's bytes, then the fields before the closing brace (the
    "\\n" stays last), paired with the prefill's transfer."""
    kv = decode["body"]["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True
    assert kv["transfer_id"] == prefill["body"]["kv_transfer_params"]["transfer_id"]
    fields = orjson.dumps({"kv_transfer_params": kv})[1:-1]
    assert decode["body_bytes"] == len(body) + 1 + len(fields)
    assert decode["body"]["prompt"].endswith(f"<truncated, {len(PROMPT)} chars>")
    assert decode["kv"]["reason"] in (None, "ok")
    assert prefill["body"]["max_tokens"] == 1


def test_client_params_at_the_end_of_a_streamed_body_are_refused(fresh: Stack) -> None:
    body = orjson.dumps(
        {"model": "m", "prompt": PROMPT, "kv_transfer_params": {"remote_host": "10.9.9.9"}}
    )
    status, headers, answer = paced(fresh, body)
    assert status == 400
    assert headers["x-pdproc-error"] == "bad_request"
    assert KV_REFUSED in orjson.loads(answer)["message"]
    # The decode got most of the body but never all of it: it served nothing.
    assert all(r["status"] is None for r in records(fresh, "decode"))
    assert fresh.sim_get("decode", "/sim/stats")["completed"] == 0
    assert records(fresh, "prefill") == []


def test_a_small_body_is_not_streamed(fresh: Stack) -> None:
    streamed = fresh.metric("pdproc_streamed_request_bodies_total")
    body = orjson.dumps({"model": "m", "prompt": "tok " * (16 * KiB), "max_tokens": 4})
    status, _, _ = paced(fresh, body, pieces=1)
    assert status == 200
    decode = served(fresh, "decode")[0]
    assert int(decode["headers"]["content-length"]) == decode["body_bytes"]
    assert fresh.metric("pdproc_streamed_request_bodies_total") == streamed


@pytest.mark.parametrize("client_params", [True, False], ids=["client-params", "clean"])
def test_pdproc_dying_mid_body_leaves_the_rest_to_the_kv_guard(client_params: bool) -> None:
    """Envoy fails open when pdproc dies mid-body and passes the rest of the body on
    unseen; the body never got pdproc's mark, so the kv guard holds and checks it whole."""
    own = {"kv_transfer_params": {"remote_host": "10.9.9.9"}} if client_params else {}
    body = orjson.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 4, **own})
    with running_stack(SIM_ARGS) as st:
        upload = PacedUpload(
            st, "/v1/completions", len(body), {"x-prefiller-host-port": str(st.sim.prefill)}
        )
        upload.piece(body[: len(body) // 2])
        assert st.metric("pdproc_streamed_request_bodies_total") == 1
        st.pdproc.popen.kill()
        st.pdproc.popen.wait()
        status, headers, answer = upload.finish(body[len(body) // 2 :])
        if client_params:
            assert status == 400, answer[:300]
            assert headers["x-pdproc-error"] == "bad_request"
            assert orjson.loads(answer)["message"] == KV_REFUSED
            assert fresh_decode_served(st) == 0
        else:
            # Served by the decode alone, with the client's own body.
            assert status == 200, answer[:300]
            decode = served(st, "decode")[0]
            assert "kv_transfer_params" not in decode["body"]
            assert decode["body_bytes"] == len(body)


def fresh_decode_served(stack: Stack) -> int:
    completed: int = stack.sim_get("decode", "/sim/stats")["completed"]
    return completed
