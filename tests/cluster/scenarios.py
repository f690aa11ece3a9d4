"""The scenarios: what happens to the bed when, and the bound each one holds pdproc to.

Each runs on a freshly started stack (pods, decode, pdproc with its defaults, Envoy) and the
same load: 8 streaming clients at 12 requests/s in all (the ties scenario: one client, 60
requests back to back). Times are seconds from the load's start; a client gives up on a
request after `client_timeout` seconds (a request that long has broken its bound anyway)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from tests.cluster import report
from tests.cluster.bed import (
    BOOTSTRAP_PORT,
    PODS,
    PREFILL_PORT,
    Bed,
    addr,
    pod_address,
    read_ready,
)

ANSWER_BOUND_S = 15.0  # every client answered within this, whatever fails
SCALE_UP_BOUND_S = 3.0  # a pod added to DNS gets its first prefill within this
DELAY_MS = 2.0  # the latency scenario's delay on every pod link, each way
# How far the latency scenario's time to first token may rise over healthy's: bounds on a
# regression, not measurements (docs/cluster-tests.md says why these figures). The delay adds
# ~5 ms to p50 and ~15 ms to p99; a busy shared machine alone moves p99 by over 100 ms.
TTFT_RISE_MS = {0.5: 20.0, 0.99: 150.0}
FAST_PATH_MS = 1.0  # a round trip on the bed without delay lines is under this

# What an action measured, by name (milliseconds), for the scenario's check; or nothing.
Measured = Mapping[str, float] | None


@dataclass(frozen=True)
class Step:
    at_s: float
    name: str
    act: Callable[[Bed], Measured]


@dataclass(frozen=True)
class Scenario:
    key: str  # test id, CLI name, file name
    name: str
    bound: str
    check: Callable[[report.Outcome], list[str]]
    steps: tuple[Step, ...] = ()
    before: Callable[[Bed], Measured] | None = None  # before the stack starts
    dns: tuple[str, ...] = PODS
    duration_s: float = 12.0
    load: tuple[str, ...] = ("--clients", "8", "--rate", "12")
    client_timeout: float = 20.0
    observed: Callable[[report.Outcome], str] = field(default=lambda _o: "")
    # the scenario whose time to first token this one's is compared with (run first if the
    # run has not had it)
    baseline: str | None = None


@dataclass
class Result:
    outcome: report.Outcome
    violations: list[str]
    row: report.Row


def run(
    bed: Bed,
    scenario: Scenario,
    client_timeout: float | None = None,
    done: dict[str, report.Outcome] | None = None,
) -> Result:
    """Start the stack, run the load and the steps, stop the stack: the outcome and which
    parts of the bound it broke. `done` holds the outcomes of the run's earlier scenarios
    (this one's is added)."""
    done = {} if done is None else done
    timeout = client_timeout or scenario.client_timeout
    measured = _baseline(bed, scenario, client_timeout, done)
    try:
        if scenario.before is not None:
            measured.update(scenario.before(bed) or {})
        bed.start(scenario.dns)
        out = bed.workdir / f"load-{scenario.key}.json"
        load = bed.load(
            out, [*scenario.load, "--duration", str(scenario.duration_s), "--timeout", str(timeout)]
        )
        t0 = read_ready(load)["t0"]
        events: dict[str, float] = {}
        for step in scenario.steps:
            time.sleep(max(0.0, t0 + step.at_s - time.monotonic()))
            measured.update(step.act(bed) or {})
            events[step.name] = time.monotonic() - t0
        load.popen.wait(scenario.duration_s + timeout + 30)
        if load.popen.returncode != 0:
            raise RuntimeError(f"load client failed: {load.tail()}")
        pods = {pod_address(p): p for p in PODS}
        outcome = report.Outcome.from_load(scenario.name, json.loads(out.read_text()), pods, events)
    finally:
        bed.stop()
    outcome.measured = measured
    done[scenario.key] = outcome
    violations = scenario.check(outcome)
    row = report.row(outcome, scenario.bound, violations, scenario.observed(outcome))
    return Result(outcome, violations, row)


def _baseline(
    bed: Bed, scenario: Scenario, client_timeout: float | None, done: dict[str, report.Outcome]
) -> dict[str, float]:
    """The baseline scenario's time to first token (p50, p99, in ms), run now if needed."""
    if scenario.baseline is None:
        return {}
    if scenario.baseline not in done:
        run(bed, select([scenario.baseline])[0], client_timeout, done)
    base = done[scenario.baseline]
    return {baseline_key(q): base.ttft(q) * 1000 for q in TTFT_RISE_MS}


# -- the checks ---------------------------------------------------------------------------


def answered_in_time(o: report.Outcome) -> list[str]:
    late = [r for r in o.requests if r.latency > ANSWER_BOUND_S or "timeout" in (r.error or "")]
    return [f"{len(late)} answers took over {ANSWER_BOUND_S:g} s"] if late else []


def no_failures(o: report.Outcome) -> list[str]:
    return [f"{len(o.failures)} client failures: {dict(o.error_kinds())}"] if o.failures else []


def healthy(o: report.Outcome) -> list[str]:
    return no_failures(o) + answered_in_time(o)


def silent_death(o: report.Outcome) -> list[str]:
    death = o.events["p1 link down"]
    problems = answered_in_time(o) + served_before(o, "p1", "p1 link down")
    if len(o.failures) > 3:
        problems.append(f"{len(o.failures)} failures (at most 3)")
    late = o.failures_after(death + 20.0)
    if late:
        problems.append(f"{len(late)} failures of requests sent over 20 s after p1 died")
    return problems


def served_before(o: report.Outcome, pod: str, event: str) -> list[str]:
    """The pod had prefills before the event: else the scenario tested nothing (the picker
    had sent it no work)."""
    counts = [n for t, n in o.polls[pod] if t <= o.events[event] and n is not None]
    if len(counts) < 2 or counts[-1] == counts[0]:
        return [f"{pod} had no prefill before {event}: nothing was tested"]
    return []


def removal(o: report.Outcome) -> list[str]:
    return no_failures(o) + served_before(o, "p3", "p3 out of DNS")


def scale_up(event: str, bound_s: float) -> Callable[[report.Outcome], list[str]]:
    def check(o: report.Outcome) -> list[str]:
        first = o.first_prefill_after("p3", o.events[event])
        if first is None or first > bound_s:
            seen = "never" if first is None else f"after {first:.1f} s"
            return [f"p3's first prefill {seen} (bound {bound_s:g} s after {event})"]
        return []

    return check


def dns_dead(o: report.Outcome) -> list[str]:
    return healthy(o) + scale_up("resolver back with p3", SCALE_UP_BOUND_S + 2.0)(o)


def ties(o: report.Outcome) -> list[str]:
    prefills = o.prefills()
    total = sum(prefills.values())
    low = {p: n for p, n in prefills.items() if n < 0.25 * total}
    problems = no_failures(o)
    if total < len(o.requests):
        problems.append(f"{total} prefills counted for {len(o.requests)} requests")
    if low:
        problems.append(f"under 25 % of {total}: {low}")
    return problems


def latency(o: report.Outcome) -> list[str]:
    """Healthy's bound, the delay on the path (else nothing was tested), and time to first
    token risen by at most TTFT_RISE_MS over the baseline's."""
    m = o.measured
    problems = healthy(o)
    if m["round trip without lines"] >= FAST_PATH_MS:
        problems.append(
            f"gw-pod round trip {m['round trip without lines']:.2f} ms without delay lines "
            f"(under {FAST_PATH_MS:g} ms expected): the bed is too slow to tell a delay"
        )
    for key in ("round trip with lines", "round trip under load"):
        if m[key] < 2 * DELAY_MS:
            problems.append(
                f"gw-pod {key} {m[key]:.2f} ms, under 2 x {DELAY_MS:g} ms: "
                "the delay is not on the path, nothing was tested"
            )
    for q, bound in TTFT_RISE_MS.items():
        _ttft, rise = ttft_rise_ms(o, q)
        if not rise <= bound:  # NaN (no answer to time) fails too
            problems.append(
                f"TTFT p{q * 100:g} rose {rise:.0f} ms over healthy's (bound {bound:g})"
            )
    return problems


def baseline_key(q: float) -> str:
    return f"baseline ttft p{q * 100:g}"


def ttft_rise_ms(o: report.Outcome, q: float) -> tuple[float, float]:
    """The `q` quantile of time to first token, and its rise over the baseline's (ms)."""
    ttft = o.ttft(q) * 1000
    return ttft, ttft - o.measured[baseline_key(q)]


def latency_observed(o: report.Outcome) -> str:
    m = o.measured
    ttfts = [(q, *ttft_rise_ms(o, q)) for q in TTFT_RISE_MS]
    rises = ", ".join(f"p{q * 100:g} {ttft:.0f} ms ({rise:+.0f})" for q, ttft, rise in ttfts)
    return (
        f"gw-pod round trip {m['round trip with lines']:.2f} ms "
        f"({m['round trip under load']:.2f} under load, {m['round trip without lines']:.2f} "
        f"without lines); TTFT {rises} vs healthy"
    )


def first_p3(event: str) -> Callable[[report.Outcome], str]:
    def observed(o: report.Outcome) -> str:
        first = o.first_prefill_after("p3", o.events[event])
        return "p3: no prefill" if first is None else f"p3's first prefill after {first:.1f} s"

    return observed


def failure_times(o: report.Outcome) -> str:
    if not o.failures:
        return ""
    death = o.events.get("p1 link down", 0.0)
    starts = [r.start - death for r in o.failures]
    return f"failures sent {min(starts):+.1f} s to {max(starts):+.1f} s from the event"


# -- the steps ----------------------------------------------------------------------------


def _partition_bootstrap(bed: Bed) -> None:
    rule = f"ip daddr {addr('p1')} tcp dport {BOOTSTRAP_PORT} drop"
    bed.nft(
        "gw", "pdc_partition", f"chain output {{ type filter hook output priority 0; {rule}; }}"
    )


def _round_trip(bed: Bed, worst: bool) -> float:
    """gw's TCP round trip to the pods: the slowest pod's or the fastest's."""
    trips = [bed.round_trip_ms("gw", pod, PREFILL_PORT) for pod in PODS]
    return max(trips) if worst else min(trips)


def _delay_pod_links(bed: Bed) -> Measured:
    """The round trip without and with the delay lines (no pod listens yet: the RST of a
    closed port answers the SYN, over the same links)."""
    without = _round_trip(bed, worst=True)
    bed.delay(DELAY_MS)
    return {"round trip without lines": without, "round trip with lines": _round_trip(bed, False)}


def _dns_host_dead(bed: Bed) -> None:
    bed.nft(
        "dns",
        "pdc_dead",
        "\n".join(
            f"chain {hook} {{ type filter hook {hook} priority 0; policy drop; }}"
            for hook in ("input", "output")
        ),
    )


def _dns_back_with_p3(bed: Bed) -> None:
    bed.nft_delete("dns", "pdc_dead")
    bed.set_dns(PODS)


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "healthy",
        "healthy",
        "0 client errors; every answer within 15 s",
        healthy,
        duration_s=20.0,  # as long as latency's, whose baseline it is: p99s of like counts
    ),
    Scenario(
        "silent-death",
        "silent pod death (p1's link down)",
        "every answer within 15 s; at most 3 failures, none sent over 20 s after the death "
        "(p1 having served prefills before)",
        silent_death,
        steps=(Step(4.0, "p1 link down", lambda bed: bed.link("p1", up=False)),),
        duration_s=30.0,
        observed=failure_times,
    ),
    Scenario(
        "bootstrap-partition",
        "bootstrap port partition (gw -/-> p1:8998)",
        "0 client failures",
        no_failures,
        before=_partition_bootstrap,
        duration_s=15.0,
    ),
    Scenario(
        "dns-removal",
        "p3 removed from DNS, stopped 2 s later",
        "0 client failures (p3 having served prefills before it left)",
        removal,
        steps=(
            Step(4.0, "p3 out of DNS", lambda bed: bed.set_dns(("p1", "p2"))),
            Step(6.0, "p3 stopped", lambda bed: bed.stop_proc("p3")),
        ),
        duration_s=18.0,
    ),
    Scenario(
        "dns-scale-up",
        "p3 added to DNS (scale-up)",
        "p3's first prefill within 3 s",
        scale_up("p3 into DNS", SCALE_UP_BOUND_S),
        steps=(Step(3.0, "p3 into DNS", lambda bed: bed.set_dns(PODS)),),
        dns=("p1", "p2"),
        duration_s=15.0,
        observed=first_p3("p3 into DNS"),
    ),
    Scenario(
        "dns-host-dead",
        "DNS host dead 11 s, back with p3 added",
        "0 client failures, answers within 15 s (last good set kept); p3's first prefill "
        "within 5 s of the resolver's return (a refresh period, ~2 s, plus the 3 s target)",
        dns_dead,
        steps=(
            Step(3.0, "resolver dead", _dns_host_dead),
            # 11 s dead: at least one refresh of today's 10 s period falls in it.
            Step(14.0, "resolver back with p3", _dns_back_with_p3),
        ),
        dns=("p1", "p2"),
        duration_s=22.0,
        observed=first_p3("resolver back with p3"),
    ),
    Scenario(
        "latency",
        f"+{DELAY_MS:g} ms each way on every pod link",
        f"0 client errors, answers within 15 s; TTFT p50 at most +{TTFT_RISE_MS[0.5]:g} ms, "
        f"p99 at most +{TTFT_RISE_MS[0.99]:g} ms over healthy's; gw-pod round trip at least "
        f"{2 * DELAY_MS:g} ms with the lines in, before and under load (under "
        f"{FAST_PATH_MS:g} ms without)",
        latency,
        before=_delay_pod_links,
        steps=(
            Step(
                19.0,
                "round trip under load",
                lambda bed: {"round trip under load": _round_trip(bed, worst=False)},
            ),
        ),
        duration_s=20.0,
        baseline="healthy",
        observed=latency_observed,
    ),
    Scenario(
        "ties",
        "ties: 60 sequential requests, 3 idle pods",
        "each pod at least 25 % of the prefills",
        ties,
        load=("--clients", "1", "--rate", "0", "--requests", "60"),
        duration_s=60.0,
    ),
)


def select(names: Sequence[str]) -> list[Scenario]:
    """These scenarios by key, in the table's order (all of them when none is given)."""
    unknown = set(names) - {s.key for s in SCENARIOS}
    if unknown:
        raise SystemExit(f"no scenario {sorted(unknown)}: {[s.key for s in SCENARIOS]}")
    return [s for s in SCENARIOS if not names or s.key in names]


def report_table(rows: Sequence[report.Row]) -> str:
    return report.table(rows)
