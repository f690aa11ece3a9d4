"""A real HTTP/2 (h2c, prior knowledge) client over a plain socket, for the framing attacks:
the `h2` library builds the frames, so the test chooses each DATA frame's size and whether
trailers follow, which no ordinary client lets it do."""

from __future__ import annotations

import contextlib
import select
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

# Frames written per sendall: all of them at once, as fast as an attacker's would.
_BATCH = 1 << 20


@dataclass
class H2Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    reset: bool = False  # the stream was reset instead of answered
    events: list[str] = field(default_factory=list)


def h2_post(
    host: str,
    port: int,
    path: str,
    body: bytes,
    *,
    frame_bytes: int = 16384,
    headers: Mapping[str, str] | None = None,
    trailers: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> H2Answer:
    """POST `body` as DATA frames of at most `frame_bytes` bytes (then `trailers`, if any,
    as a HEADERS frame ending the stream) and read the whole answer."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        sent = [
            (":method", "POST"),
            (":scheme", "http"),
            (":authority", f"{host}:{port}"),
            (":path", path),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            *(headers or {}).items(),
        ]
        conn.send_headers(stream, sent, end_stream=not body and not trailers)
        sock.sendall(conn.data_to_send())
        answer = H2Answer(0, {}, b"")
        # The body goes out only once Envoy's windows are known to hold it (its SETTINGS
        # and WINDOW_UPDATEs): sent before, past the 65,535-byte default, it would be a
        # flow-control error and the stream reset, whatever the frames' sizes.
        while not _ended(answer) and (
            "RemoteSettingsChanged" not in answer.events
            or min(conn.local_flow_control_window(stream), conn.outbound_flow_control_window)
            < len(body)
        ):
            _receive(sock, conn, answer)
        _send_body(sock, conn, stream, body, frame_bytes, trailers, answer)
        while not _ended(answer):
            _receive(sock, conn, answer)
        return answer


def _send_body(
    sock: socket.socket,
    conn: h2.connection.H2Connection,
    stream: int,
    body: bytes,
    frame_bytes: int,
    trailers: Mapping[str, str] | None,
    answer: H2Answer,
) -> None:
    """The DATA frames are written by hand (9-byte header, payload): built by `h2` one at a
    time they go out too slowly to be the flood a real attacker sends. Envoy's windows
    (256 MiB by default) hold any body these tests send, so flow control is not waited on."""
    view = memoryview(body)
    end_flag = b"\x00" if trailers else b"\x01"
    offsets = range(0, len(body), frame_bytes)
    batch: list[bytes] = []
    for index, offset in enumerate(offsets):
        piece = view[offset : offset + frame_bytes]
        last = index == len(offsets) - 1
        flags = end_flag if last else b"\x00"
        batch.append(len(piece).to_bytes(3, "big") + b"\x00" + flags + stream.to_bytes(4, "big"))
        batch.append(bytes(piece))
        if len(batch) >= 2 * _BATCH or last:
            try:
                sock.sendall(b"".join(batch))
            except OSError:
                return  # Envoy answered and closed while the body was still going out
            batch.clear()
            while select.select([sock], [], [], 0)[0] and not _ended(answer):
                _receive(sock, conn, answer)  # an early answer (a refusal) ends the upload
            if _ended(answer):
                return
    if trailers:
        conn.send_headers(stream, list(trailers.items()), end_stream=True)
        _flush(sock, conn)


def _flush(sock: socket.socket, conn: h2.connection.H2Connection) -> None:
    with contextlib.suppress(OSError):  # Envoy answered and closed while the body went out
        sock.sendall(conn.data_to_send())


def _ended(answer: H2Answer) -> bool:
    return "StreamEnded" in answer.events or answer.reset or "closed" in answer.events


def _receive(sock: socket.socket, conn: h2.connection.H2Connection, answer: H2Answer) -> None:
    try:
        data = sock.recv(65536)
    except OSError:
        data = b""
    if not data:
        answer.events.append("closed")
        return
    for event in conn.receive_data(data):
        answer.events.append(type(event).__name__)
        if isinstance(event, h2.events.ResponseReceived):
            answer.headers = {
                (k.decode() if isinstance(k, bytes) else k): (
                    v.decode() if isinstance(v, bytes) else v
                )
                for k, v in event.headers
            }
            answer.status = int(answer.headers.get(":status", "0"))
        elif isinstance(event, h2.events.DataReceived):
            answer.body += event.data
            conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamReset):
            answer.reset = True
    _flush(sock, conn)
