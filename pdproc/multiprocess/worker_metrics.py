"""The metrics of several workers, as one page that reads as one process's would.

Each worker writes its values to its own files in the shared directory (prometheus_client's
multiprocess mode, chosen by the environment before prometheus_client is imported), and any
worker answers `/metrics` with all of them: counters and histograms summed, each gauge
combined as its `multiprocess_mode` says (in-flight counts summed over the live workers, a
breaker open in any of them open). prometheus_client's files keep every series ever written
(it cannot remove one there), so a worker sets a finished per-target series to 0 instead of
removing it and names at most `max_targets` targets over its life (later ones share
`other`); the page leaves out the zeros and folds whatever is past `max_targets` into
`other`. The page also has what the files do not: every declared family (also those with
no sample yet), the build info, the Python platform, and the process metrics of the live
workers added up (CPU, memory and descriptors summed; the earliest start time).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest, multiprocess
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from pdproc.metrics import BREAKER_OPEN, BUILD, IN_FLIGHT, OTHER_TARGETS, Metrics
from pdproc.targets import HostPort


class WorkerMetrics(Metrics):
    """One worker's metrics, kept in the shared `directory`'s files; its page is every
    worker's."""

    # The files cannot drop a series: a finished one is a 0, which the page leaves out.
    _removes_series = False

    def __init__(
        self, directory: str, registry: CollectorRegistry | None = None, max_targets: int = 1024
    ) -> None:
        super().__init__(registry, max_targets)
        self._directory = directory
        # The targets this process has written a series for, and the open breakers of
        # those past the bound (counted under `other`).
        self._named: set[str] = set()
        self._open_others: set[HostPort] = set()

    def exposition(self) -> bytes:
        """The /metrics page of every worker."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_WorkersPage(self._directory, self.registry, self._max_targets))
        return generate_latest(registry)

    def _label(self, target: HostPort, in_use: int) -> str:
        """A target's own label while this process has named fewer than the bound over its
        life (a series written stays in the files), else `other`."""
        name = str(target)
        if name in self._named:
            return name
        if len(self._named) < self._max_targets:
            self._named.add(name)
            return name
        return OTHER_TARGETS

    def breaker_changed(self, target: HostPort, is_open: bool) -> None:
        """A closed breaker is a 0 (which the page leaves out); the open ones past the bound
        share `other`, open while any of them is."""
        label = self._label(target, 0) if is_open else str(target)
        if label in self._named:
            self.breaker_open.labels(label).set(1 if is_open else 0)
            return
        if is_open:
            self._open_others.add(target)
        else:
            self._open_others.discard(target)
        self.breaker_open.labels(OTHER_TARGETS).set(1 if self._open_others else 0)


class _WorkersPage(Collector):
    """The page of several worker processes (--workers): prometheus_client's multiprocess
    view of their metric files, plus what that view leaves out, so the page has what one
    process's page has."""

    def __init__(self, directory: str, own: CollectorRegistry, max_targets: int) -> None:
        self._directory = directory
        self._own = own
        self._max_targets = max_targets

    def collect(self) -> Iterator[Metric]:
        seen: set[str] = set()
        multi = multiprocess.MultiProcessCollector(None, self._directory)  # type: ignore[no-untyped-call]
        for family in multi.collect():  # type: ignore[no-untyped-call]
            seen.add(family.name)
            if family.name == IN_FLIGHT:
                yield bounded_per_target(family, self._max_targets, sum)
            elif family.name == BREAKER_OPEN:
                yield bounded_per_target(family, self._max_targets, max)
            else:
                yield family
        for family in self._own.collect():
            if family.name.startswith(("pdproc_", "python_")) and family.name not in seen:
                if family.name in (BUILD, "python_info"):
                    yield family  # the same in every worker
                else:
                    yield Metric(family.name, family.documentation, family.type)
        yield from _summed_process_metrics(_live_pids(self._directory))


def bounded_per_target(
    family: Metric, limit: int, combine: Callable[[list[float]], float]
) -> Metric:
    """A per-target family as one process would show it: no series for a target with
    nothing to report (0), at most `limit` targets of their own (the largest values), the
    rest combined into `other`."""
    values: dict[str, float] = {}
    for sample in family.samples:
        target = sample.labels.get("target", OTHER_TARGETS)
        if sample.value:
            values[target] = combine([values.get(target, 0.0), sample.value])
    named = sorted((t for t in values if t != OTHER_TARGETS), key=lambda t: (-values[t], t))
    folded = [values[t] for t in named[limit:]]
    if OTHER_TARGETS in values:
        folded.append(values[OTHER_TARGETS])
    bounded = Metric(family.name, family.documentation, family.type)
    for target in named[:limit]:
        bounded.add_sample(family.name, {"target": target}, values[target])
    if folded:
        bounded.add_sample(family.name, {"target": OTHER_TARGETS}, combine(folded))
    return bounded


def _live_pids(directory: str) -> list[int]:
    """Workers that wrote metric files and are still running."""
    pids = set()
    for name in os.listdir(directory):
        stem, _, suffix = name.rpartition(".")
        pid = stem.rpartition("_")[2]
        if suffix == "db" and pid.isdigit() and os.path.exists(f"/proc/{pid}"):
            pids.add(int(pid))
    return sorted(pids)


_EARLIEST = {"process_start_time_seconds", "process_max_fds"}


def _constant(pid: int) -> Callable[[], int]:
    return lambda: pid


def _summed_process_metrics(pids: list[int]) -> Iterator[Metric]:
    merged: dict[str, Metric] = {}
    for pid in pids:
        for family in ProcessCollector(registry=None, pid=_constant(pid)).collect():
            total = merged.get(family.name)
            if total is None:
                merged[family.name] = family
                continue
            pick = min if family.name in _EARLIEST else sum
            total.samples = [
                mine._replace(value=pick((mine.value, theirs.value)))
                for mine, theirs in zip(total.samples, family.samples, strict=False)
            ]
    yield from merged.values()
