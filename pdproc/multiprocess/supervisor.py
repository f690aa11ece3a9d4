"""The parent of `pdproc serve --workers N`: it starts the workers, and only supervises them.

How many: `--workers`, or by default one per CPU that is pdproc's own (a container's CPU
limit), else one per two CPUs it may run on (a host it shares with the gateway's Envoy);
one when the port is 0, as processes cannot share a port each of them picks. The parent
makes the shared directory (pdproc.multiprocess.sharing) before any worker starts, starts
each worker with its share of the totals (budgets.py), restarts one that dies (its gauges
leave the page) and forwards SIGTERM/SIGINT, so every worker drains gracefully.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from pdproc.config import Settings
from pdproc.multiprocess.budgets import worker_settings
from pdproc.multiprocess.sharing import MULTIPROC_ENV

# The logger these lines have always had (log queries select on it), not the module's name.
log = logging.getLogger("pdproc.workers")


def worker_count(settings: Settings) -> int:
    """How many processes `settings` asks for; 0 means `default_workers()`."""
    if settings.workers:
        return settings.workers
    if settings.listen.port == 0:
        return 1  # processes cannot share a port each of them picks
    return default_workers()


def default_workers(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """One process per CPU that is pdproc's own: its cgroup's CPU limit (a container's
    `limits.cpu`, rounded up, at most the CPUs it may be scheduled on). Without a limit the
    CPUs are shared, with the gateway's Envoy above all (one worker thread per CPU by
    default): one process per two of them. One per CPU there oversubscribed the cores:
    on 2 CPUs shared with Envoy, 2 processes used 1.14-1.21x the CPU per request of one
    and answered fewer requests (docs/bench-summary.md)."""
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_limit(cgroup_root)
    if quota is not None:
        return max(1, min(cpus, quota))
    return max(1, cpus // 2)


def _cgroup_cpu_limit(root: str) -> int | None:
    base = Path(root)
    try:
        return cpus_from_cpu_max((base / "cpu.max").read_text("ascii"))  # cgroup v2
    except OSError:
        pass
    try:  # cgroup v1
        quota = (base / "cpu" / "cpu.cfs_quota_us").read_text("ascii").strip()
        period = (base / "cpu" / "cpu.cfs_period_us").read_text("ascii").strip()
    except OSError:
        return None
    return cpus_from_cpu_max(f"{quota} {period}")


def cpus_from_cpu_max(text: str) -> int | None:
    """`cpu.max` ("QUOTA PERIOD", "max PERIOD"; v1's quota -1 means none) -> CPUs, rounded
    up; None without a limit or when unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] in ("max", "-1"):
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return -(-quota // period)


def run_workers(settings: Settings) -> int:
    if settings.listen.port == 0:
        log.error("--workers needs a fixed --listen port: every worker must bind the same one")
        return 2
    metrics_dir = tempfile.mkdtemp(prefix="pdproc-metrics-")
    # Set before any worker starts: prometheus_client picks its storage at import time.
    os.environ[MULTIPROC_ENV] = metrics_dir
    count = worker_count(settings)
    supervisor = _Supervisor(worker_settings(settings, count))
    supervisor.start_all(count)
    signal.signal(signal.SIGTERM, supervisor.forward)
    signal.signal(signal.SIGINT, supervisor.forward)
    log.info("pdproc workers started", extra={"workers": [p.pid for p in supervisor.workers]})
    try:
        supervisor.supervise()
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return supervisor.exit_code()


class _Supervisor:
    """The parent's one job: keep `count` workers running until a signal asks them to stop."""

    def __init__(self, each: Settings) -> None:
        self.each = each
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[BaseProcess] = []
        self.stopping: list[int] = []

    def start(self, index: int) -> BaseProcess:
        process = self.context.Process(
            target=_worker, args=(self.each,), name=f"pdproc-worker-{index}"
        )
        process.start()
        return process

    def start_all(self, count: int) -> None:
        self.workers = [self.start(i) for i in range(count)]

    def forward(self, signum: int, _frame: Any) -> None:
        self.stopping.append(signum)
        for process in self.workers:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    def restart_dead(self) -> None:
        for index, process in enumerate(self.workers):
            if process.is_alive() or self.stopping:
                continue
            log.error(
                "worker exited (%s), restarting", process.exitcode, extra={"pid": process.pid}
            )
            _mark_dead(process)
            self.workers[index] = self.start(index)

    def all_stopped(self) -> bool:
        return bool(self.stopping) and not any(p.is_alive() for p in self.workers)

    def supervise(self) -> None:
        while True:
            self.restart_dead()
            if self.all_stopped():
                break
            time.sleep(0.2)

    def exit_code(self) -> int:
        return max((p.exitcode or 0 for p in self.workers), default=0)


def _mark_dead(process: BaseProcess) -> None:
    from prometheus_client import multiprocess

    if process.pid is not None:
        multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]


def _worker(settings: Settings) -> None:
    from pdproc.logs import setup_logging
    from pdproc.server import run
    from pdproc.telemetry import provider_from_env

    setup_logging(settings.log_level, settings.log_format)
    sys.exit(run(settings, provider_from_env(), share_ports=True))
