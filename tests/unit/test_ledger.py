"""A request's ledger: the first outcome recorded is the one counted (pdproc.ledger)."""

from __future__ import annotations

from pdproc.ledger import Ledger
from pdproc.outcomes import Outcome

from .fakes import Counted, recording_span


def test_the_first_outcome_is_counted_once_and_set_on_the_span() -> None:
    counted = Counted()
    span = recording_span()
    ledger = Ledger(counted, "/v1/completions", span)
    assert not ledger.settled
    ledger.record(Outcome.DECODE_ONLY)
    ledger.record(Outcome.PD)
    assert ledger.settled
    assert ledger.outcome is Outcome.DECODE_ONLY
    assert counted.outcomes == [("/v1/completions", Outcome.DECODE_ONLY)]
    assert span.attributes is not None
    assert span.attributes["pdproc.outcome"] == "decode_only"


def test_an_ended_span_is_left_alone() -> None:
    counted = Counted()
    span = recording_span()
    span.end()
    Ledger(counted, "", span).record(Outcome.ABANDONED)
    assert counted.only is Outcome.ABANDONED
    assert span.attributes is not None
    assert "pdproc.outcome" not in span.attributes
