"""bench.instructions' pure parts: reading callgrind's count, naming what is measured, and
the messages that play Envoy's side (the measuring itself needs valgrind: not in CI)."""

from __future__ import annotations

import argparse

import orjson
import pytest

from bench.instructions import (
    FLOOR,
    Subject,
    callgrind_total,
    parse_subject,
    stream_messages,
)
from bench.loadgen import make_body
from pdproc.extproc_messages import header_dict
from pdproc.request_body import parse_body
from pdproc.targets import PREFILL_HEADER, HostPort


def test_the_count_is_the_totals_line_not_the_summary_written_before_the_run() -> None:
    text = "version: 1\nevents: Ir\nsummary: 0\nfn=(1) main\n0 12\ntotals: 588878732\n"
    assert callgrind_total(text) == 588_878_732
    assert callgrind_total("events: Ir\nsummary: 42\n") == 42
    with pytest.raises(ValueError, match="no totals"):
        callgrind_total("events: Ir\n")


def test_subjects_are_named_paths() -> None:
    assert parse_subject("before=/tmp/b/bin/pdproc") == Subject("before", "/tmp/b/bin/pdproc")
    assert parse_subject("pdproc") == Subject("pdproc", "pdproc")
    with pytest.raises(argparse.ArgumentTypeError):
        parse_subject("=pdproc")
    assert FLOOR == "floor"


def test_the_client_sends_what_envoy_sends_for_a_pd_request() -> None:
    body = make_body(1024, max_tokens=8)  # what the harness sends (bench.loadgen's body)
    assert len(body) == 1024
    assert orjson.loads(body)["stream"] is True
    assert "messages" in parse_body(body)  # a body pdproc takes
    pod = HostPort("127.0.0.1", 8100)
    headers, sent, response = stream_messages(7, body, pod)
    values = header_dict(headers.request_headers)
    assert values[PREFILL_HEADER] == "127.0.0.1:8100"
    assert values["content-length"] == str(len(body))
    assert (values[":method"], values["x-request-id"]) == ("POST", "instr-7")
    assert sent.request_body.body == body
    assert sent.request_body.end_of_stream
    assert header_dict(response.response_headers) == {":status": "200"}
