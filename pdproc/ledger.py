"""One request's outcome: recorded once, whatever decides it, and always by the stream's end.

Many things can decide how a request ends (a refusal, the decode serving it alone, the
prefill's outcome, the client leaving); the first to decide records it here, and later ones
change nothing. When the stream ends, the stream settles the ledger (pdproc.stream): a
request nothing decided yet is counted then, as its processor says (abandoned, cancelled), so
every request is counted exactly once. The only outcome recorded after the stream's end is
a concurrent prefill's that was still running once the decode had answered.

Pure bookkeeping: the counter and the span are handed in.
"""

from __future__ import annotations

from typing import Protocol

from opentelemetry.trace import Span

from pdproc.outcomes import Outcome
from pdproc.telemetry import ATTR_OUTCOME


class OutcomeCounter(Protocol):
    def count(self, path: str, outcome: Outcome) -> None: ...


class Ledger:
    __slots__ = ("_counter", "_path", "_span", "outcome")

    def __init__(self, counter: OutcomeCounter, path: str, span: Span | None = None) -> None:
        self._counter = counter
        self._path = path
        self._span = span
        self.outcome: Outcome | None = None

    @property
    def settled(self) -> bool:
        return self.outcome is not None

    def record(self, outcome: Outcome) -> None:
        """The request's outcome, unless one was recorded already."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._counter.count(self._path, outcome)
        if self._span is not None and self._span.is_recording():
            self._span.set_attribute(ATTR_OUTCOME, outcome.value)
