"""`pdproc serve --workers N`: N processes on one port, for more than one core.

Python runs one request at a time per process; the kernel spreads Envoy's HTTP/2 connections
over the processes bound to the port (SO_REUSEPORT, set by `server.py`), and each process is
a full, independent pdproc (its own engine-id cache, as separate replicas would be). Metrics
are aggregated across the processes with prometheus_client's multiprocess mode, so any
process answers `/metrics` for all of them. The parent only supervises: it restarts a worker
that dies and forwards SIGTERM/SIGINT for a graceful drain.
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
from typing import Any

from pdproc.config import Settings

log = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def run_workers(settings: Settings) -> int:
    if settings.listen.port == 0:
        log.error("--workers needs a fixed --listen port: every worker must bind the same one")
        return 2
    metrics_dir = tempfile.mkdtemp(prefix="pdproc-metrics-")
    # Set before any worker starts: prometheus_client picks its storage at import time.
    os.environ[MULTIPROC_ENV] = metrics_dir
    context = multiprocessing.get_context("spawn")
    stopping: list[int] = []

    def start(index: int) -> BaseProcess:
        process = context.Process(target=_worker, args=(settings,), name=f"pdproc-worker-{index}")
        process.start()
        return process

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        for process in workers:
            if process.pid is not None and process.is_alive():
                os.kill(process.pid, signal.SIGTERM)

    workers = [start(i) for i in range(settings.workers)]
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    log.info("pdproc workers started", extra={"workers": [p.pid for p in workers]})
    try:
        while True:
            for index, process in enumerate(workers):
                if process.is_alive() or stopping:
                    continue
                log.error(
                    "worker exited (%s), restarting", process.exitcode, extra={"pid": process.pid}
                )
                _mark_dead(process)
                workers[index] = start(index)
            if stopping and not any(p.is_alive() for p in workers):
                break
            time.sleep(0.2)
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    codes = [p.exitcode or 0 for p in workers]
    return max(codes, default=0)


def _mark_dead(process: BaseProcess) -> None:
    from prometheus_client import multiprocess

    if process.pid is not None:
        multiprocess.mark_process_dead(process.pid)  # type: ignore[no-untyped-call]


def _worker(settings: Settings) -> None:
    from pdproc.logs import setup_logging
    from pdproc.server import run
    from pdproc.telemetry import provider_from_env

    setup_logging(settings.log_level, settings.log_format)
    sys.exit(run(settings, provider_from_env()))
