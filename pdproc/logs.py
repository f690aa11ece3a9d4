"""Log set-up: one JSON object per line (default) or plain text for a terminal.

Structured fields travel in `extra=` and become top-level JSON keys. Nothing secret is ever
passed there (no authorization header, no prompt text).
"""

from __future__ import annotations

import itertools
import logging
import re
import sys
from typing import Any

import orjson

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}
# LogRecord.__init__ sets its attributes first and makeRecord adds `extra=` after them, so a
# record's own attributes are the first this many of its __dict__: the search for extras
# starts past them (one line per request is logged, and they are most of its keys).
_OWN = len(logging.LogRecord("", 0, "", 0, "", (), None).__dict__)


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The record's `extra=` fields (and any attribute a filter or factory added), in order."""
    found = dict(itertools.islice(record.__dict__.items(), _OWN, None))
    for key in found.keys() & _STANDARD:  # set by a formatter that ran before this one
        del found[key]
    return found


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        entry.update(extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


# A field value written bare in text logs; anything else is quoted and escaped like a JSON
# string, so no value (a client's request id, a pod's error) can forge another field or line.
_BARE = re.compile(r"[^\s\"\\=\x00-\x1f\x7f]+")


def text_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if _BARE.fullmatch(text) and text.isascii():
        return text
    return orjson.dumps(text).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = " ".join(f"{key}={text_value(value)}" for key, value in extras(record).items())
        return f"{line} {fields}" if fields else line


def setup_logging(level: str = "info", fmt: str = "json") -> None:
    # Neither format shows where a call was made from nor the thread or process name:
    # the logging module's documented switches leave those look-ups out of every record
    # (a few microseconds of the per-request line, for every request).
    logging._srcfile = None  # private, and documented for this
    logging.logThreads = False
    logging.logMultiprocessing = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
