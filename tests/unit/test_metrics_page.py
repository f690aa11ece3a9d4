"""The shared page of several workers shows per-target families as one process would."""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from pdproc.multiprocess.worker_metrics import bounded_per_target


def family(values: dict[str, float]) -> Metric:
    metric = Metric("pdproc_prefills_in_flight", "Prefills in flight per target.", "gauge")
    for target, value in values.items():
        metric.add_sample("pdproc_prefills_in_flight", {"target": target}, value)
    return metric


def shown(metric: Metric) -> dict[str, float]:
    return {sample.labels["target"]: sample.value for sample in metric.samples}


def test_zeros_are_left_out() -> None:
    assert shown(bounded_per_target(family({"a:1": 0, "b:1": 2}), 5, sum)) == {"b:1": 2}


def test_past_the_bound_targets_are_folded_into_other() -> None:
    values = {"a:1": 5, "b:1": 1, "c:1": 3, "d:1": 1, "other": 2}
    page = shown(bounded_per_target(family(values), 2, sum))
    assert page == {"a:1": 5, "c:1": 3, "other": 4}  # the largest kept; 1 + 1 + 2 folded
    breakers = {"a:1": 1, "b:1": 1, "c:1": 1}
    assert shown(bounded_per_target(family(breakers), 1, max)) == {"a:1": 1, "other": 1}


def test_within_the_bound_nothing_changes() -> None:
    values = {"a:1": 1, "b:1": 2}
    assert shown(bounded_per_target(family(values), 2, sum)) == values
