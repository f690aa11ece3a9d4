"""What the workers of one pdproc tell each other about engine maps.

Each worker caches the prefill pods' engine maps on its own, and each map is true on its
own: it is never used past its age bound (pdproc.engine_maps). What one worker learns
sooner, from a failed prefill or an answer that changed, the others would only learn from
their own failures: a pod that restarted faster than the bound would cost each worker one.
So a worker that drops a map, or finds it changed, marks the pod's host: a file per prefill
host in the shared directory, whose modification time is the last moment one of them found
that host's map stale. Every worker takes a map queried before the mark as stale too. One
stat per lookup, no lock, nothing on the network; replicas do not share this, the age
bound covers them.
"""

from __future__ import annotations

import logging
import os
import time

# The logger these lines have always had (log queries select on it), not the module's name.
log = logging.getLogger("pdproc.engine_maps")

# File times come from the kernel's coarse clock (a tick behind time.time()): a map queried
# this long after another worker's mark is still taken as older than the mark.
_MARK_SLACK_S = 0.05


class Siblings:
    """The stale marks of one pdproc's workers, kept in `directory` (made if missing)."""

    def __init__(self, directory: str) -> None:
        self._directory = directory
        os.makedirs(directory, exist_ok=True)

    def _path(self, host: str) -> str:
        # Hosts are DNS names or IP literals (targets.py): no "/" and no "..".
        return os.path.join(self._directory, host)

    def stale_since(self, host: str) -> float | None:
        """When a process last found the host's map stale (wall-clock time), if ever."""
        try:
            return os.stat(self._path(host)).st_mtime
        except OSError:
            return None

    def stale(self, host: str, queried_at: float) -> bool:
        """Whether a worker found the host's map stale after a map queried at `queried_at`
        (wall-clock time) was asked for."""
        marked = self.stale_since(host)
        return marked is not None and marked + _MARK_SLACK_S >= queried_at

    def mark_stale(self, host: str) -> float:
        """Tell the other workers the host's map is stale. Returns the query time (wall
        clock) a map received just now carries so that this mark does not retire it."""
        path = self._path(host)
        try:
            with open(path, "a"):
                pass
            os.utime(path)
        except OSError as exc:  # a full disk must not fail a request
            log.warning("cannot tell the other workers about a stale engine map: %s", exc)
        return time.time() + _MARK_SLACK_S
