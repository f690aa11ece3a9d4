"""The outcome enums: every label value pdproc_requests_total and pdproc_prefills_total can
carry, typed (mypy --strict refuses a bare string where an outcome goes), unique, and the
ones dashboards and alerts use spelled exactly as before the enums."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from pdproc.errors import ErrorKind
from pdproc.metrics import Metrics
from pdproc.outcomes import PREFILL_OUTCOMES, REQUEST_OUTCOMES, Outcome, PrefillResult

# The label values as dashboards, alerts and docs know them: renaming one breaks them.
KNOWN_REQUEST_OUTCOMES = {
    "pd",
    "passthrough",
    "decode_only",
    "short_prompt",
    "decode_cached",
    "unfinished_body",
    "abandoned",
    "cancelled",
    "prefill_answer_refused",
    "bad_request",
    "forbidden",
    "too_large",
    "bootstrap_error",
    "prefill_failed",
    "prefill_timeout",
    "prefill_unavailable",
    "overloaded",
    "internal_error",
}
KNOWN_PREFILL_OUTCOMES = {
    "2xx",
    "3xx",
    "4xx",
    "5xx",
    "timeout",
    "connect_error",
    "dead_peer",
    "error",
    "cancelled",
    "exhausted",
    "internal",
}


def test_label_values_are_the_ones_dashboards_use() -> None:
    assert set(REQUEST_OUTCOMES) == KNOWN_REQUEST_OUTCOMES
    assert set(PREFILL_OUTCOMES) == KNOWN_PREFILL_OUTCOMES
    assert len(REQUEST_OUTCOMES) == len(KNOWN_REQUEST_OUTCOMES)
    assert len(PREFILL_OUTCOMES) == len(KNOWN_PREFILL_OUTCOMES)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_every_error_kind_is_an_outcome_of_the_same_name(kind: ErrorKind) -> None:
    assert Outcome.of(kind).value == kind.value


def test_an_outcome_is_its_label_value() -> None:
    # StrEnum: prometheus_client and the log formatter see the plain value.
    assert str(Outcome.PD) == "pd"
    assert f"{PrefillResult.OK}" == "2xx"


@pytest.mark.parametrize(
    ("status", "result"),
    [
        (100, PrefillResult.ERROR),
        (200, PrefillResult.OK),
        (204, PrefillResult.OK),
        (301, PrefillResult.REDIRECT),
        (400, PrefillResult.CLIENT_ERROR),
        (499, PrefillResult.CLIENT_ERROR),
        (500, PrefillResult.SERVER_ERROR),
        (599, PrefillResult.SERVER_ERROR),
        (700, PrefillResult.SERVER_ERROR),
    ],
)
def test_prefill_result_of_an_http_status(status: int, result: PrefillResult) -> None:
    assert PrefillResult.of_status(status) is result


# The label values as dashboards, alerts and docs/observability.md's metrics table spell them,
# written out here (not derived from the enums) so that a renamed, dropped or added value fails.
REQUEST_OUTCOME_VALUES = [
    "pd",
    "passthrough",
    "decode_only",
    "short_prompt",
    "decode_cached",
    "unfinished_body",
    "abandoned",
    "cancelled",
    "prefill_answer_refused",
    "bad_request",
    "forbidden",
    "too_large",
    "bootstrap_error",
    "prefill_failed",
    "prefill_timeout",
    "prefill_unavailable",
    "overloaded",
    "internal_error",
]
PREFILL_OUTCOME_VALUES = [
    "2xx",
    "3xx",
    "4xx",
    "5xx",
    "timeout",
    "connect_error",
    "dead_peer",
    "error",
    "cancelled",
    "exhausted",
    "internal",
]


def _listed_in_help(page: str, family: str) -> list[str]:
    """The outcomes a family's `# HELP` line lists in its parentheses, as /metrics shows it."""
    (line,) = [line for line in page.splitlines() if line.startswith(f"# HELP {family} ")]
    return line[line.index("(") + 1 : line.index(")")].split(", ")


def test_the_help_text_lists_every_outcome() -> None:
    page = generate_latest(Metrics().registry).decode()
    assert _listed_in_help(page, "pdproc_requests_total") == REQUEST_OUTCOME_VALUES
    assert _listed_in_help(page, "pdproc_prefills_total") == PREFILL_OUTCOME_VALUES
    assert [o.value for o in Outcome] == REQUEST_OUTCOME_VALUES
    assert [r.value for r in PrefillResult] == PREFILL_OUTCOME_VALUES
