"""`pdproc serve` refuses a gRPC or metrics port another process holds.

Before, pdproc bound its ports with SO_REUSEPORT whatever --workers said, so a second
instance silently joined the first one's ports and the kernel spread Envoy's streams and
the scrapes over both. Now a port held by another process (shared or not) is refused with a
sentence naming the flag and the port; pdproc's own workers still share theirs. Real
`pdproc serve` processes, ports picked free at run time.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pdproc_sim.devstack import free_port

from pdproc.multiprocess.listeners import port_held

pytestmark = pytest.mark.e2e

SECONDS = 30.0


def serve(grpc_port: int, metrics_port: int, workers: int) -> list[str]:
    script = Path(sys.executable).with_name("pdproc")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pdproc.cli"]
    return [
        *head,
        "serve",
        "--listen",
        f"127.0.0.1:{grpc_port}",
        "--metrics-listen",
        f"127.0.0.1:{metrics_port}",
        "--workers",
        str(workers),
        "--shutdown-delay",
        "0",
        "--drain-timeout",
        "2",
        "--prefill-timeout",
        "1",
    ]


def refused(argv: list[str]) -> str:
    """Run a pdproc that must refuse to start; its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SECONDS, check=False)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    return done.stderr


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another process holds the way a pdproc worker does (SO_REUSEPORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("workers", [1, 2])
def test_a_held_grpc_or_metrics_port_is_refused(held_port: int, workers: int) -> None:
    text = refused(serve(held_port, free_port(), workers))
    assert f"--listen 127.0.0.1:{held_port}" in text
    assert "already in use" in text
    text = refused(serve(free_port(), held_port, workers))
    assert f"--metrics-listen 127.0.0.1:{held_port}" in text


def wait_ready(metrics_port: int) -> None:
    deadline = time.monotonic() + SECONDS
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{metrics_port}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "pdproc not ready"
        time.sleep(0.1)


def test_a_second_pdproc_on_the_same_ports_is_refused_and_the_first_serves_on() -> None:
    grpc_port, metrics_port = free_port(), free_port()
    first = subprocess.Popen(
        serve(grpc_port, metrics_port, 2), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_ready(metrics_port)  # its two workers share both ports
        for workers in (1, 2):
            text = refused(serve(grpc_port, metrics_port, workers))
            assert f"port {grpc_port}" in text
        assert first.poll() is None
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
        assert "pdproc_requests_total" in page or "pdproc_requests" in page
    finally:
        first.terminate()
        first.communicate(timeout=SECONDS)
    assert not port_held("127.0.0.1", grpc_port)
    assert not port_held("127.0.0.1", metrics_port)


def test_the_dev_stack_picks_other_ports_when_pdproc_refuses_one(
    held_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port picked free can be taken by another process before pdproc binds it: pdproc
    refuses it now (it used to share it), so the dev stack tries other ports."""
    from pdproc_sim import devstack

    ports = iter([held_port, free_port(), free_port(), free_port()])
    monkeypatch.setattr(devstack, "free_port", lambda host="127.0.0.1": next(ports))
    process, listen, _ = devstack.start_pdproc(tmp_path, ["--shutdown-delay", "0"])
    try:
        assert listen.port != held_port
    finally:
        process.stop()
