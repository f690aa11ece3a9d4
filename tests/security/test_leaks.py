"""Making pdproc repeat what it should not.

Earlier, a prefill pod's error body (vLLM's errors may quote the prompt) was put into the
client's 502 and into the log line, and a malformed `x-prefiller-host-port` value was
echoed whole in the 400 and the log (50 KB of the client's choosing per line). Now pod
bodies are logged only with `--log-bodies`, and client values are quoted short.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import Stack

from pdproc.logs import JsonFormatter
from tests.stacks import records, served
from tests.waiting import eventually_async

from .conftest import CHAT_BYTES, Pd, is_single_message, log_lines, log_mark, send
from .pods import HostilePod, answer

SECRET = "PRIVATE-PROMPT-TEXT"


@pytest.mark.parametrize("log_bodies", [False, True], ids=["default", "log-bodies"])
async def test_prefill_error_body_reaches_neither_client_nor_log(
    pod: HostilePod, make_pdproc: Any, caplog: pytest.LogCaptureFixture, log_bodies: bool
) -> None:
    caplog.set_level(logging.DEBUG)
    error = {"object": "error", "message": f"cannot tokenize {SECRET} ...", "code": 500}
    pod.on_prefill = answer(500, orjson.dumps(error), {"content-type": "application/json"})
    pd: Pd = await make_pdproc(pod, log_bodies=log_bodies)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": SECRET}]})
    outcome = await pd.play(body, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "prefill_failed"
    assert SECRET.encode() not in outcome.raw_error
    assert pod.hits["prefill"] == 1

    def failure_logged() -> bool:
        return any(r.getMessage().startswith("pd request prefill failed") for r in caplog.records)

    await eventually_async(failure_logged)
    assert_secret_logged_only_if_asked(caplog.records, log_bodies)


def assert_secret_logged_only_if_asked(records: list[logging.LogRecord], log_bodies: bool) -> None:
    # Each record as pdproc writes it: one JSON line, message and extra fields.
    lines = [JsonFormatter().format(record) for record in records]
    leaked = [line for line in lines if SECRET in line]
    if log_bodies:
        # Asked for: the prompt excerpt and the pod's error body are logged.
        (failed,) = [r for r in records if r.getMessage().startswith("pd request prefill")]
        assert SECRET in failed.__dict__["prefill_error_body"]
    else:
        assert leaked == []


LONG_VALUES = {
    "long-port": "10.0.0.1:" + "9" * 50_000,
    "long-host": "h" * 50_000 + ":80",
    "long-v6": "[" + "f" * 50_000 + "]:80",
}


@pytest.mark.e2e
@pytest.mark.parametrize("value", list(LONG_VALUES.values()), ids=list(LONG_VALUES))
def test_50_kb_malformed_header_gets_a_short_answer_and_log_line(fresh: Stack, value: str) -> None:
    mark = log_mark(fresh)
    response = send(fresh, CHAT_BYTES, value)
    if is_single_message(fresh):
        # Envoy's header_to_metadata drops header values over 8 KiB: pdproc never sees the
        # value, the request is served by the decode alone (as without the header).
        assert response.status_code == 200, response.text
        (decode,) = served(fresh, "decode", 1)
        assert "kv_transfer_params" not in decode["body"]
        lines = log_lines(fresh, mark)
    else:
        assert response.status_code == 400
        assert response.headers["x-pdproc-error"] == "bad_request"
        assert len(response.content) < 1024
        assert records(fresh, "decode") == []
        lines = log_lines(fresh, mark, until=lambda ls: any("request rejected" in s for s in ls))
    assert [len(line) for line in lines if len(line.encode()) >= 1024] == []
    assert records(fresh, "prefill") == []


async def test_50_kb_malformed_header_in_process(
    pod: HostilePod, make_pdproc: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    pd: Pd = await make_pdproc(pod)
    for value in LONG_VALUES.values():
        for single_message in (False, True):
            outcome = await pd.play(CHAT_BYTES, prefill=value, single_message=single_message)
            assert outcome.status == 400
            assert len(outcome.raw_error) < 1024
    lines = [JsonFormatter().format(record) for record in caplog.records]
    assert lines
    assert [len(line) for line in lines if len(line.encode()) >= 1024] == []
    assert pod.total_hits == 0
