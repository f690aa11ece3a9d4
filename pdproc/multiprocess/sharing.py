"""What one pdproc process shares with the other workers of its pdproc: the seam the server
(pdproc.server) builds its process-wide parts through, so that it knows nothing else of
workers.

The shared directory is the parent's (supervisor.py), named by the environment every worker
inherits; prometheus_client reads the same variable when it is imported, to keep its values
in files there. A process without it shares nothing: its metrics are its own registry's and
its engine maps are its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdproc.metrics import Metrics
from pdproc.multiprocess.siblings import Siblings
from pdproc.multiprocess.worker_metrics import WorkerMetrics

# Set (by supervisor.py) before any worker starts: prometheus_client picks its storage then.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


@dataclass(frozen=True, slots=True)
class Sharing:
    """`reuse_port`: bind the ports with SO_REUSEPORT, as every worker binds the same ones
    (alone, without it, so a port another process holds is refused: listeners.py).
    `directory`: the workers' shared directory, if any."""

    reuse_port: bool
    directory: str | None

    @classmethod
    def of_this_process(cls, *, worker: bool) -> Sharing:
        return cls(reuse_port=worker, directory=os.environ.get(MULTIPROC_ENV))

    def metrics(self, max_targets: int) -> Metrics:
        """This process's metrics, and with a shared directory every worker's page."""
        if self.directory is None:
            return Metrics(max_targets=max_targets)
        return WorkerMetrics(self.directory, max_targets=max_targets)

    def siblings(self) -> Siblings | None:
        """The stale engine-map marks of the other workers, if any."""
        if self.directory is None:
            return None
        return Siblings(os.path.join(self.directory, "stale-engine-maps"))
