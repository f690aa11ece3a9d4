"""A large request body that flows on to the decode while it arrives.

Buffered, a body crosses gRPC twice: Envoy sends all of it to pdproc and pdproc sends all
of it back, rewritten. For a long prompt that round trip dominates Envoy's cost. Yet the
decode leg differs from the client's body only at its very end: the gateway's fields go in
before the closing brace. So a large body is streamed (Envoy's STREAMED body mode, asked
for in the answer to the request headers): every chunk goes on unchanged, except the last
`TAIL` bytes, which pdproc holds back and releases with the fields spliced in once the whole
body has arrived and passed every check. The decode leg is sent chunked.

The headers are answered at once (the fields are chosen at the end, a connector's `Plan`)
so that Envoy passes chunks on as they arrive rather than gathering the body meanwhile.

Pure: no I/O, so it is tested without servers.
"""

from __future__ import annotations

from pdproc.request_body import BodyError, Buffer, ClientBytes, closing_brace

# Bytes held back at the end of the body. The closing brace must fall among them: JSON
# allows whitespace after it, and a client that sends more than 15 bytes of it gets a 400.
# Small on purpose: a chunk that reaches into the tail is sent back whole (minus the tail),
# and Envoy's last chunk is often only the few bytes left over from a large read.
TAIL = 16

# Each chunk is one ext_proc message, and a message costs pdproc the same whether it holds
# 8 bytes or 16 KiB. So that a body's cost follows its bytes, not how finely its sender
# cut it, a streamed body may come in at most `max_chunks(length)` chunks: on average at
# least CHUNK_BYTES each, after a few small ones for free. Real senders are far above
# this: HTTP/2 clients send DATA frames of up to 16 KiB, and Envoy reads HTTP/1.1 bodies
# from the socket many TCP segments at a time; a client that sends hundreds of thousands
# of tiny frames gets a 400 instead. (Envoy coalesces frames while pdproc lags, see the
# pdproc cluster's buffer limit in the bootstrap, so the count stays under the frames.)
CHUNK_BYTES = 512
FREE_CHUNKS = 64


def max_chunks(length: int) -> int:
    """The most chunks a streamed body of `length` bytes may arrive in."""
    return FREE_CHUNKS + length // CHUNK_BYTES


def parse_content_length(value: str | None) -> int | None:
    """A content-length header's value, or None when there is none or it is not plain
    ASCII digits (Envoy itself refuses a bad one; this is only for choosing the mode)."""
    if not value or len(value) > 18 or not (value.isascii() and value.isdigit()):
        return None
    return int(value)


class StreamedBody:
    """One streamed body: what to answer for each chunk, and the held-back tail."""

    def __init__(self, length: int) -> None:
        if length <= TAIL:
            raise ValueError(f"a streamed body must be longer than {TAIL} bytes")
        self.length = length  # the client's content-length
        self._hold_from = length - TAIL
        # The body so far: its first chunk as it came, then one buffer that each chunk
        # extends (realloc moves a large buffer's pages without copying them), so its memory
        # is touched as the chunks arrive and the end of the body costs no join.
        self._first: Buffer | None = None
        self._buffer: bytearray | None = None
        self._received = 0
        self._released = 0  # bytes already passed on to the decode
        self._chunks_left = max_chunks(length)

    def feed(self, chunk: Buffer, end_of_stream: bool) -> Buffer | None:
        """Take one chunk; None when it goes on unchanged, else the bytes that replace it.
        BodyError when the body does not match its content-length."""
        self._chunks_left -= 1
        if self._chunks_left < 0:
            raise BodyError(
                f"request body arrives in too many pieces: more than {max_chunks(self.length)}"
                f" for {self.length} bytes (send it in larger HTTP/2 DATA frames or writes)"
            )
        start = self._received
        self._received += len(chunk)
        if self._received > self.length:
            raise BodyError("request body is longer than its content-length")
        self._keep(chunk)
        if end_of_stream:
            if self._received != self.length:
                raise BodyError("request body is shorter than its content-length")
            return None  # answered by `tail` once the body is checked
        if self._received <= self._hold_from:
            self._released = self._received
            return None
        # The chunk reaches into the tail: only what comes before the tail goes on.
        self._released = self._hold_from
        return memoryview(chunk)[: max(self._hold_from - start, 0)]

    def _keep(self, chunk: Buffer) -> None:
        if self._buffer is not None:
            self._buffer += chunk
        elif self._first is None:
            self._first = chunk
        else:
            self._buffer = bytearray(self._first)
            self._buffer += chunk
            self._first = None

    def whole(self) -> ClientBytes:
        """The client's body as it arrived (after the last chunk), once: the gathered buffer,
        or a body that came in one chunk as bytes (copied only if it was a view). Never
        resized afterwards: the parsed members are views of it."""
        first, buffer = self._first, self._buffer
        self._first = self._buffer = None
        if buffer is not None:
            return buffer
        if first is None:
            return b""
        return first if isinstance(first, bytes) else first.tobytes()

    def tail(
        self, whole: ClientBytes, insertion: bytes, *, empty_object: bool
    ) -> tuple[Buffer, ...]:
        """The held-back bytes, with `insertion` (JSON object members, no separator; may be
        empty) spliced in before the closing brace, as pieces (views of `whole`) that the
        answer joins: a body that came in one chunk is all tail, and is copied once.

        `whole` must be a JSON object (parse_body proved it); `empty_object` says it has no
        members (no comma before the insertion then)."""
        brace = closing_brace(whole)
        if len(whole) - 1 - brace >= TAIL:  # then the brace may have gone on already
            raise BodyError(
                f"more than {TAIL - 1} bytes of white space follow the request body's closing brace"
            )
        view = memoryview(whole)
        if not insertion:
            return (view[self._released :],)
        separator = b"" if empty_object else b","
        return (view[self._released : brace], separator, insertion, view[brace:])
