"""pdproc.request_ids: a client's x-request-id is kept only when it is a plain token."""

from __future__ import annotations

import re

import pytest

from pdproc.request_ids import MAX_CHARS, is_plain, new_request_id

MINTED = re.compile(r"pdproc-[0-9a-f]{32}")


@pytest.mark.parametrize(
    "value",
    [
        "req-1",
        "0f8fad5b-d9cb-469f-a165-70867728950e",
        "01ARZ3NDEKTSV4RRFFQ69G5FAV",
        "dGVzdA==",
        "trace:span",
        "a/b/c",
        "user@host",
        "x" * MAX_CHARS,
    ],
)
def test_plain_tokens_are_kept(value: str) -> None:
    assert is_plain(value)


@pytest.mark.parametrize(
    "value",
    [
        "x" * (MAX_CHARS + 1),  # too long to log whole
        'a" level="error',  # a forged log field
        "a\nb",  # a forged log line
        "a b",
        "é",
        "a\x00b",
    ],
)
def test_anything_else_is_replaced_by_a_minted_id(value: str) -> None:
    assert not is_plain(value)


def test_an_empty_id_is_not_plain() -> None:
    assert not is_plain("")


def test_minted_ids_differ_and_are_plain_themselves() -> None:
    ids = {new_request_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(MINTED.fullmatch(i) and is_plain(i) for i in ids)
