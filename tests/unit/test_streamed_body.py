"""pdproc.streamed_body, pure: which chunks of a streamed body go on unchanged, which are
cut short, and the held-back tail with the decode's fields spliced in."""

from __future__ import annotations

import itertools
import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproc.request_body import BodyError, members
from pdproc.streamed_body import (
    CHUNK_BYTES,
    FREE_CHUNKS,
    TAIL,
    StreamedBody,
    max_chunks,
    parse_content_length,
)
from tests.hypothesis_budget import examples

KV = {"kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "xfer-1"}}


def chat(size: int) -> bytes:
    """A JSON object of exactly `size` bytes (compact, no trailing whitespace)."""
    head = b'{"model":"m","prompt":"'
    end = b'"}'
    assert size >= len(head) + len(end)
    return head + b"x" * (size - len(head) - len(end)) + end


def feed_all(streamed: StreamedBody, chunks: list[bytes]) -> tuple[list[bytes | None], list[bytes]]:
    """Feed every chunk (the last one ends the stream): the answers, and what the decode got
    for each chunk but the last (the chunk itself when it went on unchanged)."""
    answers: list[bytes | None] = []
    released: list[bytes] = []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        answer = streamed.feed(chunk, last)
        answers.append(answer)
        if not last:
            released.append(chunk if answer is None else answer)
    return answers, released


def test_chunks_before_the_tail_pass_unchanged() -> None:
    raw = chat(1000)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw[:300], False) is None
    assert streamed.feed(raw[300:600], False) is None
    # Up to exactly the first held byte: still unchanged.
    assert streamed.feed(raw[600 : len(raw) - TAIL], False) is None


def test_the_chunk_crossing_into_the_tail_is_cut_before_it() -> None:
    raw = chat(1000)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw[:500], False) is None
    cut = streamed.feed(raw[500:995], False)
    assert cut == raw[500 : len(raw) - TAIL]
    # Every later chunk before the end is held back whole.
    assert streamed.feed(raw[995:998], False) == b""
    assert streamed.feed(raw[998:999], False) == b""
    assert streamed.feed(b"", False) == b""
    assert streamed.feed(raw[999:], True) is None  # answered by tail()
    assert streamed.whole() == raw
    assert b"".join(streamed.tail(raw, b"", empty_object=False)) == raw[-TAIL:]


def test_a_chunk_wholly_inside_the_tail_gives_empty_bytes() -> None:
    raw = chat(100)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw[: len(raw) - TAIL], False) is None
    assert streamed.feed(raw[len(raw) - TAIL : len(raw) - 1], False) == b""
    assert streamed.feed(raw[-1:], True) is None
    assert b"".join(streamed.tail(raw, b"", empty_object=False)) == raw[-TAIL:]


def test_a_first_chunk_that_reaches_into_the_tail_is_cut() -> None:
    raw = chat(100)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw[:-1], False) == raw[: len(raw) - TAIL]
    assert streamed.feed(raw[-1:], True) is None


def test_end_of_stream_gives_none_and_the_tail_is_the_rest() -> None:
    raw = chat(200)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw[:50], False) is None
    assert streamed.feed(raw[50:], True) is None
    # Nothing past byte 50 went on yet: the tail carries all of it.
    assert b"".join(streamed.tail(raw, b"", empty_object=False)) == raw[50:]


def test_a_body_in_one_end_of_stream_chunk_is_all_tail() -> None:
    raw = chat(200)
    streamed = StreamedBody(len(raw))
    assert streamed.feed(raw, True) is None
    tail = b"".join(streamed.tail(raw, members(KV), empty_object=False))
    assert orjson.loads(tail) == {**orjson.loads(raw), **KV}


def test_tail_splices_the_insertion_before_the_closing_brace() -> None:
    raw = chat(500)
    streamed = StreamedBody(len(raw))
    _, released = feed_all(streamed, [raw[:200], raw[200:490], raw[490:]])
    tail = b"".join(streamed.tail(raw, members(KV), empty_object=False))
    assert tail == raw[len(raw) - TAIL : -1] + b"," + members(KV) + b"}"
    body = b"".join(released) + tail
    assert orjson.loads(body) == {**orjson.loads(raw), **KV}


def test_tail_with_an_empty_insertion_is_the_held_bytes_verbatim() -> None:
    raw = chat(500)[:-1] + b"}\r\n\t "
    streamed = StreamedBody(len(raw))
    _, released = feed_all(streamed, [raw[:480], raw[480:500], raw[500:]])
    assert released == [raw[:480], raw[480 : len(raw) - TAIL]]
    tail = b"".join(streamed.tail(raw, b"", empty_object=False))
    assert tail == raw[len(raw) - TAIL :]
    assert b"".join(released) + tail == raw


def test_tail_of_a_padded_empty_object_has_no_comma() -> None:
    raw = b"{" + b" \n\t" * 20 + b"}"  # an empty object, longer than TAIL
    assert orjson.loads(raw) == {}
    streamed = StreamedBody(len(raw))
    _, released = feed_all(streamed, [raw[:10], raw[10:55], raw[55:]])
    tail = b"".join(streamed.tail(raw, members(KV), empty_object=True))
    assert tail == raw[len(raw) - TAIL : -1] + members(KV) + b"}"
    body = b"".join(released) + tail
    assert orjson.loads(body) == KV


@pytest.mark.parametrize("blanks", [b" ", b"\n", b"\r\n", b" \t\r\n" * 3 + b"   "])
def test_trailing_whitespace_inside_the_tail_is_kept_after_the_brace(blanks: bytes) -> None:
    assert len(blanks) <= TAIL - 1
    raw = chat(300) + blanks
    streamed = StreamedBody(len(raw))
    _, released = feed_all(streamed, [raw[:100], raw[100:]])
    tail = b"".join(streamed.tail(raw, members(KV), empty_object=False))
    assert tail.endswith(b"}" + blanks)
    body = b"".join(released) + tail
    assert orjson.loads(body) == {**orjson.loads(raw), **KV}


def test_fifteen_trailing_blanks_are_the_most_allowed() -> None:
    raw = chat(300) + b" " * (TAIL - 1)
    streamed = StreamedBody(len(raw))
    # Up to the first held byte, which is the closing brace itself.
    _, released = feed_all(streamed, [raw[: len(raw) - TAIL], raw[len(raw) - TAIL :]])
    assert raw[len(raw) - TAIL] == ord("}")
    tail = b"".join(streamed.tail(raw, members(KV), empty_object=False))
    assert tail == b"," + members(KV) + b"}" + b" " * (TAIL - 1)
    assert orjson.loads(b"".join(released) + tail) == {**orjson.loads(raw), **KV}


@pytest.mark.parametrize("extra", [TAIL, TAIL + 1, 100])
def test_too_much_trailing_whitespace_is_a_body_error(extra: int) -> None:
    raw = chat(300) + b" " * extra
    streamed = StreamedBody(len(raw))
    # The chunks before the last reach into the tail: the closing brace has gone on.
    _, released = feed_all(streamed, [raw[:100], raw[100:-1], raw[-1:]])
    assert b"}" in b"".join(released)
    with pytest.raises(BodyError, match="closing brace"):
        b"".join(streamed.tail(raw, members(KV), empty_object=False))


@pytest.mark.parametrize("insertion", [members(KV), b""], ids=["fields", "none"])
def test_too_much_trailing_whitespace_is_refused_even_with_the_brace_still_held(
    insertion: bytes,
) -> None:
    """The same limit whichever chunk the brace came in (the same body, cut differently,
    gets the same answer)."""
    raw = chat(300) + b" " * TAIL
    streamed = StreamedBody(len(raw))
    feed_all(streamed, [raw])  # one chunk: nothing went on before the end
    with pytest.raises(BodyError, match="closing brace"):
        b"".join(streamed.tail(raw, insertion, empty_object=False))


def test_a_body_longer_than_its_content_length_is_a_body_error() -> None:
    raw = chat(300)
    streamed = StreamedBody(len(raw) - 1)
    assert streamed.feed(raw[:100], False) is None
    with pytest.raises(BodyError, match="longer"):
        streamed.feed(raw[100:], False)


def test_a_last_chunk_past_the_content_length_is_a_body_error() -> None:
    raw = chat(300)
    streamed = StreamedBody(len(raw) - 5)
    assert streamed.feed(raw[:100], False) is None
    with pytest.raises(BodyError, match="longer"):
        streamed.feed(raw[100:], True)


def test_a_body_shorter_than_its_content_length_is_a_body_error() -> None:
    raw = chat(300)
    streamed = StreamedBody(len(raw) + 1)
    assert streamed.feed(raw[:100], False) is None
    with pytest.raises(BodyError, match="shorter"):
        streamed.feed(raw[100:], True)


def test_an_empty_end_of_stream_chunk_short_of_the_length_is_a_body_error() -> None:
    raw = chat(300)
    streamed = StreamedBody(len(raw) + 20)
    assert streamed.feed(raw, False) is None  # still before the tail of 320 bytes
    with pytest.raises(BodyError, match="shorter"):
        streamed.feed(b"", True)


@pytest.mark.parametrize("length", [0, 1, TAIL])
def test_a_body_no_longer_than_the_tail_cannot_be_streamed(length: int) -> None:
    with pytest.raises(ValueError, match="longer than"):
        StreamedBody(length)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("262144", 262144),
        ("007", 7),
        ("9" * 18, 10**18 - 1),
    ],
)
def test_parse_content_length_accepts_plain_digits(value: str, expected: int) -> None:
    assert parse_content_length(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "+1",
        "-1",
        "1 ",
        " 1",
        "1,1",
        "1_000",
        "0x10",
        "1e3",
        "1.0",
        "²",  # str.isdigit() says yes
        "١٢٣",  # Arabic-Indic digits: isdigit() too
        "1" * 19,
        "9" * 40,
    ],
)
def test_parse_content_length_refuses_anything_else(value: str | None) -> None:
    assert parse_content_length(value) is None


# --- property -----------------------------------------------------------------------------

json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_value = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=10,
)
json_object = st.dictionaries(st.text(max_size=10), json_value, max_size=5)
blank = st.sampled_from(" \t\r\n")
blanks = st.text(alphabet=blank, max_size=TAIL - 1)


@st.composite
def streamed_case(
    draw: st.DrawFn,
) -> tuple[dict[str, Any], bytes, list[bytes], dict[str, Any]]:
    """An object, its bytes (any spacing, up to 15 trailing blanks, longer than TAIL), the
    bytes split into chunks (the last may be empty), and fields the gateway adds."""
    original = draw(json_object)
    indent = draw(st.sampled_from([None, 0, 2]))
    text = json.dumps(original, indent=indent, ensure_ascii=draw(st.booleans()))
    raw = text.encode()
    # Pad inside the braces, after "{", until the body is longer than TAIL.
    pad = draw(st.text(alphabet=blank, max_size=40)).encode()
    if len(raw) + len(pad) <= TAIL:
        pad += b" " * (TAIL + 1 - len(raw) - len(pad))
    raw = raw[:1] + pad + raw[1:] + draw(blanks).encode()
    assert len(raw) > TAIL
    cuts = sorted(draw(st.lists(st.integers(0, len(raw)), max_size=8)))
    bounds = [0, *cuts, len(raw)]
    chunks = [raw[a:b] for a, b in itertools.pairwise(bounds)]
    if draw(st.booleans()):
        chunks.append(b"")  # Envoy may end the stream with an empty chunk
    fields = draw(
        st.dictionaries(
            st.text(max_size=10).filter(lambda key: key not in original), json_value, max_size=3
        )
    )
    return original, raw, chunks, fields


@settings(max_examples=examples(300), deadline=None)
@given(case=streamed_case())
def test_streamed_chunks_and_tail_make_the_rewritten_body(
    case: tuple[dict[str, Any], bytes, list[bytes], dict[str, Any]],
) -> None:
    original, raw, chunks, fields = case
    assert orjson.loads(raw) == original
    streamed = StreamedBody(len(raw))
    sent = b""
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        answer = streamed.feed(chunk, last)
        if last:
            assert answer is None
            break
        sent += chunk if answer is None else answer
        # What went on before the end is the client's own bytes, never the held tail.
        assert raw.startswith(sent)
        assert len(sent) <= len(raw) - TAIL
    assert streamed.whole() == raw
    body = sent + b"".join(streamed.tail(raw, members(fields), empty_object=not original))
    assert orjson.loads(body) == {**original, **fields}
    if not fields:
        assert body == raw


def test_the_whole_body_is_handed_over_once_and_the_chunks_let_go() -> None:
    raw = b'{"model":"m","prompt":"' + b"x" * 4096 + b'"}'
    one = StreamedBody(len(raw))
    assert one.feed(raw, True) is None
    assert one.whole() is raw  # one chunk: that chunk, no copy
    many = StreamedBody(len(raw))
    for start in range(0, len(raw), 1000):
        many.feed(raw[start : start + 1000], start + 1000 >= len(raw))
    assert many.whole() == raw
    assert many.whole() == b""  # nothing held any more


def test_a_body_may_come_in_as_many_chunks_as_its_bytes_allow() -> None:
    length = 64 * 1024
    allowed = max_chunks(length)
    assert allowed == FREE_CHUNKS + length // CHUNK_BYTES
    streamed = StreamedBody(length)
    piece = length // allowed
    for _ in range(allowed - 1):
        streamed.feed(b"x" * piece, False)
    streamed.feed(b"x" * (length - piece * (allowed - 1)), True)  # the last one allowed


def test_one_chunk_more_than_its_bytes_allow_is_a_body_error() -> None:
    length = 64 * 1024
    streamed = StreamedBody(length)
    for _ in range(max_chunks(length)):
        streamed.feed(b"x" * 8, False)
    with pytest.raises(BodyError, match="too many pieces"):
        streamed.feed(b"x" * 8, False)
