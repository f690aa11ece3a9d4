"""Reading a pdproc's metrics registry in process, for the gRPC-level test harnesses."""

from __future__ import annotations

from prometheus_client import CollectorRegistry


def sample_sum(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels` (0 when none)."""
    return sum(
        sample.value
        for family in registry.collect()
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )
