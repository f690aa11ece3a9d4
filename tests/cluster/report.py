"""What a scenario run looked like to its clients and pods (pure: no I/O).

An `Outcome` holds the load client's result (requests, the pods' prefill counts over time)
and the times of the scenario's events, all in seconds from the load's start."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Request:
    start: float
    end: float
    status: int
    error: str | None
    first: float | None = None  # when its first token arrived

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class Outcome:
    scenario: str
    requests: list[Request]
    # pod name -> [(time, prefill count or None while the pod did not answer)]
    polls: dict[str, list[tuple[float, int | None]]]
    events: dict[str, float] = field(default_factory=dict)
    # what the scenario measured besides the load (round trips, a baseline's figures)
    measured: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_load(
        cls, scenario: str, load: Mapping[str, Any], pods: Mapping[str, str],
        events: Mapping[str, float],
    ) -> Outcome:  # fmt: skip
        """`pods` maps the poller's HOST:PORT to the pod's name."""
        requests = [Request(**r) for r in load["requests"]]
        polls = {pods[addr]: [(t, n) for t, n in series] for addr, series in load["polls"].items()}
        return cls(scenario, requests, polls, dict(events))

    @property
    def failures(self) -> list[Request]:
        return [r for r in self.requests if r.error is not None]

    def failures_after(self, t: float) -> list[Request]:
        return [r for r in self.failures if r.start > t]

    @property
    def worst(self) -> float:
        return max((r.latency for r in self.requests), default=0.0)

    @property
    def p50(self) -> float:
        return statistics.median(r.latency for r in self.requests) if self.requests else 0.0

    def ttft(self, q: float) -> float:
        """The `q` quantile of the answered requests' time to first token (nearest rank)."""
        ttfts = sorted(r.first - r.start for r in self.requests if r.first is not None)
        if not ttfts:
            return float("nan")
        return ttfts[max(0, math.ceil(q * len(ttfts)) - 1)]

    def prefills(self) -> dict[str, int]:
        """Prefills each pod received during the run (its count's growth)."""
        return {pod: _growth(series) for pod, series in self.polls.items()}

    def first_prefill_after(self, pod: str, t: float) -> float | None:
        """Seconds from `t` until the pod's count first grew (poll resolution, 0.1 s), None
        when it never did."""
        series = [(when, n) for when, n in self.polls.get(pod, []) if n is not None]
        before = [n for when, n in series if when <= t]
        base = before[-1] if before else (series[0][1] if series else 0)
        grown = next((when for when, n in series if when > t and n > base), None)
        return None if grown is None else grown - t

    def error_kinds(self) -> Counter[str]:
        return Counter(r.error for r in self.failures if r.error)


def _growth(series: Sequence[tuple[float, int | None]]) -> int:
    counts = [n for _t, n in series if n is not None]
    return counts[-1] - counts[0] if counts else 0


def shares(prefills: Mapping[str, int]) -> str:
    """`p1 40 % (24) / p2 …`: each pod's part of all prefills."""
    total = sum(prefills.values())
    return " / ".join(
        f"{pod} {100 * n / total:.0f} % ({n})" if total else f"{pod} 0"
        for pod, n in prefills.items()
    )


@dataclass(frozen=True)
class Row:
    scenario: str
    requests: int
    errors: str
    worst_s: float
    p50_ms: float
    share: str
    extra: str
    bound: str
    met: bool


def row(outcome: Outcome, bound: str, violations: Sequence[str], extra: str = "") -> Row:
    kinds = outcome.error_kinds()
    errors = str(len(outcome.failures))
    if kinds:
        errors += " (" + ", ".join(f"{n} x {kind}" for kind, n in kinds.most_common()) + ")"
    return Row(
        outcome.scenario,
        len(outcome.requests),
        errors,
        outcome.worst,
        outcome.p50 * 1000,
        shares(outcome.prefills()),
        extra,
        bound,
        not violations,
    )


def table(rows: Iterable[Row]) -> str:
    """The scenario table as Markdown."""
    lines = [
        "| scenario | requests | client errors | worst latency | p50 | prefills per pod | "
        "observed | bound | met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.scenario} | {r.requests} | {r.errors} | {r.worst_s:.2f} s | {r.p50_ms:.0f} ms "
            f"| {r.share} | {r.extra or '-'} | {r.bound} | {'yes' if r.met else '**no**'} |"
        )
    return "\n".join(lines)
