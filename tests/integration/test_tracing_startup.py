"""`pdproc serve` says at start where its spans go (an operator's first question when no
trace shows up)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def test_serve_logs_where_spans_go_at_start(tmp_path: Path) -> None:
    pdproc = Path(sys.executable).with_name("pdproc")
    env = {
        "PATH": "/usr/bin:/bin",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",  # nothing listens: never sent
    }
    argv = [str(pdproc), "serve", "--listen", "127.0.0.1:0", "--trace-flush-timeout", "0"]
    # No lame duck at the end: the test is over once the line shows.
    argv += ["--shutdown-delay", "0"]
    log = tmp_path / "stderr"
    with log.open("w") as err:
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
        )
        try:
            deadline = time.monotonic() + 60
            while "otlp grpc to http://127.0.0.1:9" not in log.read_text():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
