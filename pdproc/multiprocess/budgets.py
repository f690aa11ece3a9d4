"""Each worker's share of the totals a pdproc promises.

--max-inflight-bytes, --max-prefill-connections and --max-named-host-connections bound the
pdproc (its memory, its connections to the pods), not one of its processes: divided between
the workers, they stay totals whatever the worker count. Each share is at least 1, so a
total smaller than the count lets each worker work (and only then adds up to more).
Everything else a worker is told is the operator's setting as given.
"""

from __future__ import annotations

from dataclasses import replace

from pdproc.config import Settings


def worker_settings(settings: Settings, count: int) -> Settings:
    """One worker's share of `settings`: one process, and its part of the pdproc's totals."""
    return replace(
        settings,
        workers=1,
        max_inflight_bytes=max(1, settings.max_inflight_bytes // count),
        max_prefill_connections=max(1, settings.max_prefill_connections // count),
        max_named_host_connections=max(1, settings.max_named_host_connections // count),
    )
