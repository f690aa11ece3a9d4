"""pdproc.logs: one JSON object per line, and text logs no field value can forge."""

from __future__ import annotations

import logging

import orjson
import pytest

from pdproc.logs import JsonFormatter, TextFormatter, text_value


def record(message: str, **extra: object) -> logging.LogRecord:
    made = logging.makeLogRecord({"name": "pdproc.test", "levelname": "INFO", "msg": message})
    made.__dict__.update(extra)
    return made


def test_json_lines_carry_the_extra_fields_at_the_top_level() -> None:
    line = JsonFormatter().format(record("pd request", request_id="r-1", status=502))
    assert "\n" not in line
    entry = orjson.loads(line)
    assert entry["msg"] == "pd request"
    assert entry["level"] == "info"
    assert entry["logger"] == "pdproc.test"
    assert (entry["request_id"], entry["status"]) == ("r-1", 502)


def test_json_lines_keep_a_hostile_value_inside_its_field() -> None:
    hostile = 'x", "level": "error"\n{"msg": "forged"}'
    entry = orjson.loads(JsonFormatter().format(record("m", request_id=hostile)))
    assert entry["request_id"] == hostile
    assert entry["level"] == "info"


def test_json_lines_write_what_orjson_cannot_as_text() -> None:
    entry = orjson.loads(JsonFormatter().format(record("m", where=object())))
    assert entry["where"].startswith("<object object")


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("plain", "plain"),
        ("10.0.0.1:8000", "10.0.0.1:8000"),
        (502, "502"),
        ("two words", '"two words"'),
        ('a" status=200', '"a\\" status=200"'),
        ("line\nbreak", '"line\\nbreak"'),
        ("k=v", '"k=v"'),
        ("é", '"é"'),
        ("", '""'),
    ],
)
def test_text_values_are_bare_only_when_they_cannot_forge_a_field(
    value: object, shown: str
) -> None:
    assert text_value(value) == shown


def test_text_lines_append_the_extra_fields_escaped() -> None:
    line = TextFormatter().format(record("pd request", request_id="a b\nstatus=200"))
    assert "\n" not in line
    assert line.endswith('pd request request_id="a b\\nstatus=200"')


def test_json_lines_carry_what_a_logger_call_and_a_record_factory_added() -> None:
    """Through the logging module itself: the call's `extra=` fields in their order, what a
    record factory added (OpenTelemetry's adds trace ids), and none of a record's own
    attributes."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    default_factory = logging.getLogRecordFactory()

    def with_trace(*args: object, **kwargs: object) -> logging.LogRecord:
        made = default_factory(*args, **kwargs)
        made.trace_id = "t-1"  # type: ignore[attr-defined]
        return made

    logger = logging.getLogger("pdproc.test.extras")
    # A plain formatter first: it sets `message` and `asctime` on the record.
    plain = Keep()
    plain.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    handler = Keep()
    handler.setFormatter(JsonFormatter())
    logger.addHandler(plain)
    logger.addHandler(handler)
    logger.propagate = False
    logging.setLogRecordFactory(with_trace)
    try:
        logger.warning("pd request %s", "failed", extra={"request_id": "r-2", "prefill_ms": 1.5})
    finally:
        logging.setLogRecordFactory(default_factory)
        logger.removeHandler(plain)
        logger.removeHandler(handler)
    entry = orjson.loads(lines[1])
    assert list(entry) == [
        "ts",
        "level",
        "logger",
        "pid",
        "msg",
        "trace_id",
        "request_id",
        "prefill_ms",
    ]
    assert entry["msg"] == "pd request failed"
