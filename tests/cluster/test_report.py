"""The scenario arithmetic (tests/cluster/report.py, the checks of scenarios.py) on made-up
outcomes: no bed needed, so these run in `make test` too."""

from __future__ import annotations

from tests.cluster import report, scenarios


def outcome(**events: float) -> report.Outcome:
    requests = [
        report.Request(0.5, 0.6, 200, None),
        report.Request(5.0, 25.0, 0, "timeout (20 s)"),
        report.Request(26.0, 26.1, 502, "502 bootstrap_error"),
    ]
    polls: dict[str, list[tuple[float, int | None]]] = {
        "p1": [(0.0, 10), (1.0, 12), (4.0, 13), (5.0, None), (30.0, None)],
        "p2": [(0.0, 0), (30.0, 40)],
        "p3": [(0.0, 5), (3.0, 5), (4.5, 5), (6.2, 6), (30.0, 9)],
    }
    return report.Outcome("made up", requests, polls, dict(events))


def test_counts_grow_from_the_first_answer_to_the_last() -> None:
    assert outcome().prefills() == {"p1": 3, "p2": 40, "p3": 4}
    assert report.shares({"p1": 1, "p2": 3}) == "p1 25 % (1) / p2 75 % (3)"


def test_first_prefill_is_timed_from_the_event() -> None:
    o = outcome()
    first = o.first_prefill_after("p3", 4.0)
    assert first is not None
    assert abs(first - 2.2) < 1e-9
    assert o.first_prefill_after("p1", 4.5) is None


def test_silent_death_bound() -> None:
    o = outcome(**{"p1 link down": 4.0})
    problems = scenarios.silent_death(o)
    # The 20 s answer breaks the 15 s bound and the 502 came 22 s after the death.
    assert any("over 15 s" in p for p in problems)
    assert any("over 20 s after" in p for p in problems)
    assert not any("had no prefill" in p for p in problems)


def test_a_pod_that_got_no_work_tests_nothing() -> None:
    o = outcome(**{"p3 out of DNS": 4.0})
    assert any("p3 had no prefill" in p for p in scenarios.removal(o))


def test_ties_need_a_quarter_each() -> None:
    o = report.Outcome(
        "ties",
        [report.Request(i, i + 0.1, 200, None) for i in range(8)],
        {"p1": [(0, 0), (9, 2)], "p2": [(0, 0), (9, 2)], "p3": [(0, 0), (9, 4)]},
    )
    assert scenarios.ties(o) == []
    o.polls["p1"] = [(0, 0), (9, 1)]
    o.polls["p3"] = [(0, 0), (9, 5)]
    assert scenarios.ties(o) == ["under 25 % of 8: {'p1': 1}"]


def test_the_table_says_which_bound_failed() -> None:
    o = outcome(**{"p1 link down": 4.0})
    row = report.row(o, "bound", scenarios.silent_death(o))
    text = report.table([row])
    assert "2 (1 x timeout (20 s), 1 x 502 bootstrap_error)" in text
    assert text.endswith("| bound | **no** |")


def timed(ttfts_ms: list[float], **measured: float) -> report.Outcome:
    requests = [report.Request(i, i + 0.1, 200, None, i + t / 1000) for i, t in enumerate(ttfts_ms)]
    return report.Outcome("latency", requests, {}, {}, dict(measured))


def test_ttft_quantiles_are_nearest_rank() -> None:
    o = timed([float(t) for t in range(100, 0, -1)])
    assert round(o.ttft(0.5) * 1000) == 50
    assert round(o.ttft(0.99) * 1000) == 99
    assert round(o.ttft(1.0) * 1000) == 100


def test_latency_needs_the_delay_on_the_path_and_a_bounded_rise() -> None:
    trips = {
        "round trip without lines": 0.05,
        "round trip with lines": 4.1,
        "round trip under load": 4.2,
    }
    base = {scenarios.baseline_key(0.5): 40.0, scenarios.baseline_key(0.99): 60.0}
    assert scenarios.latency(timed([45.0] * 99 + [70.0], **trips, **base)) == []
    no_delay = {**trips, "round trip under load": 0.04}
    assert scenarios.latency(timed([45.0] * 100, **no_delay, **base)) == [
        "gw-pod round trip under load 0.04 ms, under 2 x 2 ms: the delay is not on the path, "
        "nothing was tested"
    ]
    slow = scenarios.latency(timed([61.0] * 100, **trips, **base))
    assert slow == ["TTFT p50 rose 21 ms over healthy's (bound 20)"]
    unanswered = timed([], **trips, **base)
    assert len(scenarios.latency(unanswered)) == 2
