"""The client's `x-request-id`.

Envoy keeps a client's `x-request-id` unless configured otherwise. Before, pdproc logged it
raw and whole (a 50 KB log line), in `--log-format text` it could forge fields
(`request_id=evil" level=error msg=...`), and it was forwarded to the prefill as it came.
Now an id that is not a plain token of at most 128 characters is replaced by one pdproc
mints: in the logs, the span, the prefill leg and (while Envoy still holds the request
headers) the decode leg, so both legs still share one id. Only a short escaped excerpt of
the client's value is logged, and the text format quotes every field value.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable

import orjson
import pytest

from pdproc.config import KvConnector
from pdproc.logs import JsonFormatter, TextFormatter, text_value
from tests.waiting import eventually_async

from .conftest import CHAT_BYTES, Pd
from .pods import HostilePod

MakePd = Callable[..., Awaitable[Pd]]
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')


def unquoted(line: str) -> str:
    """A text log line without its quoted values: what a logfmt reader takes as fields."""
    return _QUOTED.sub('""', line)


EVIL = 'evil" level=error msg="forged line\nlevel=error msg=second ' + "A" * 50_000


def decode_request_id(outcome_answers: list[object]) -> str | None:
    """The x-request-id pdproc set on the decode leg in its body answer (None: unchanged)."""
    for answer in outcome_answers:
        body = getattr(answer, "request_body", None)
        if body is None or not answer.HasField("request_body"):  # type: ignore[attr-defined]
            continue
        for option in body.response.header_mutation.set_headers:
            if option.header.key == "x-request-id":
                return bytes(option.header.raw_value).decode()
    return None


@pytest.mark.parametrize("connector", [KvConnector.MOONCAKE, KvConnector.NIXLV2], ids=str)
async def test_unfit_request_id_is_replaced_on_both_legs_and_in_the_logs(
    pod: HostilePod, make_pdproc: MakePd, caplog: pytest.LogCaptureFixture, connector: KvConnector
) -> None:
    caplog.set_level(logging.DEBUG)
    pd = await make_pdproc(pod, kv_connector=connector)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address, extra_headers={"x-request-id": EVIL})
    assert outcome.status == 200
    (prefill,) = pod.prefills()
    minted = prefill.headers["x-request-id"]
    assert minted.startswith("pdproc-")
    assert len(minted) <= 128
    assert decode_request_id(outcome.answers) == minted  # the decode carries the same id

    def prefill_logged() -> bool:
        return any(r.getMessage().startswith("pd request prefilled") for r in caplog.records)

    await eventually_async(prefill_logged)
    assert_log_lines_short(caplog.records)
    assert_no_forged_fields(caplog.records, minted)


def assert_log_lines_short(records: list[logging.LogRecord]) -> None:
    """In either format every line is one short line, with no long run of the client's id."""
    for formatter in (JsonFormatter(), TextFormatter()):
        lines = [formatter.format(record) for record in records]
        assert lines
        for line in lines:
            assert len(line) < 2048, line[:200]
            assert "\n" not in line
            assert "A" * 200 not in line


def assert_no_forged_fields(records: list[logging.LogRecord], minted: str) -> None:
    """Text format: no field can be forged; the request id of every line is pdproc's."""
    for record in records:
        bare = unquoted(TextFormatter().format(record))
        assert "level=error" not in bare
        assert re.findall(r" request_id=(\S+)", bare) in ([], [minted])


async def test_plain_request_id_is_kept(pod: HostilePod, make_pdproc: MakePd) -> None:
    """An operator follows a request from Envoy's access log to pdproc's by its id."""
    pd = await make_pdproc(pod)
    plain = "0f8fad5b-d9cb-469f-a165-70867728950e"
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address, extra_headers={"x-request-id": plain})
    assert outcome.status == 200
    (prefill,) = pod.prefills()
    assert prefill.headers["x-request-id"] == plain
    assert decode_request_id(outcome.answers) is None  # nothing to change on the decode


@pytest.mark.parametrize(
    "value",
    ['x" level=error msg=forged', "a b", "k=v", "line\nbreak", "é", "", 'tab\there"'],
)
def test_text_log_values_cannot_forge_fields(value: str) -> None:
    record = logging.makeLogRecord(
        {"msg": "request rejected", "levelname": "WARNING", "request_id": value}
    )
    line = TextFormatter().format(record)
    assert "\n" not in line
    assert "level=error" not in unquoted(line)
    written = text_value(value)
    assert line.endswith(f" request_id={written}")
    assert written == value or orjson.loads(written) == value  # bare, or a JSON string
