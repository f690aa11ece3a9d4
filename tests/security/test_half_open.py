"""Half-open connections to pdproc's own listeners.

The attack held 1,500 half-sent requests on the metrics port for 30 s and 300 incomplete
handshakes on the gRPC port for at least 22 s; under a 1,024-descriptor limit, prefill
connects then failed with "Too many open files" and were held against healthy pods. Now
(pdproc.limits) both listeners drop such connections after a bounded time, the metrics
listener keeps at most a bounded number open (the oldest go first, so a health probe still
gets through), and `pdproc serve` raises its descriptor limit and refuses a limit too low
to run. A real `pdproc serve`, raw sockets playing the attacker.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdproc_sim.devstack import free_port, start_pdproc

from pdproc import limits
from pdproc.targets import HostPort

pytestmark = pytest.mark.e2e

SECONDS = 60.0  # bounded waits only; nothing is timed


def until(check: Callable[[], Any], what: str, within_s: float = SECONDS) -> Any:
    deadline = time.monotonic() + within_s
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.1)
    return found


@pytest.fixture(scope="module")
def pdproc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HostPort, HostPort]]:
    workdir = tmp_path_factory.mktemp("half-open")
    process, listen, metrics = start_pdproc(workdir, ["--shutdown-delay", "0"])
    try:
        yield listen, metrics
    finally:
        process.stop()


def closed_by_peer(sock: socket.socket) -> bool:
    """The peer closed (or reset) this connection; the socket is non-blocking. What the
    peer sent first (gRPC's own SETTINGS frame) is read and dropped."""
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    return True


def connect_many(address: HostPort, count: int, first_bytes: bytes) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection((address.host, address.port), timeout=5)
        if first_bytes:
            sock.sendall(first_bytes)
        sock.setblocking(False)
        socks.append(sock)
    return socks


def test_half_sent_requests_on_the_metrics_port_are_bounded_and_dropped(
    pdproc: tuple[HostPort, HostPort],
) -> None:
    _, metrics = pdproc
    flood = limits.HTTP_MAX_CONNECTIONS + 100
    socks = connect_many(metrics, flood, b"GET /metrics HTTP/1.1\r\nhost: x\r\n")
    try:
        # Beyond the bound, the oldest were closed at once...
        until(
            lambda: sum(map(closed_by_peer, socks[:100])) == 100,
            "the oldest connections beyond the bound stay open",
        )
        # ...and a health probe still gets through, the flood still open.
        assert httpx.get(metrics.url() + "/healthz", timeout=10).status_code == 200
        # Then every half-sent request is dropped (the connection lifetime; aiohttp
        # before 3.14 keeps them forever, 3.14 for its keep-alive timeout, an hour).
        until(
            lambda: all(map(closed_by_peer, socks)),
            "half-sent requests held",
            within_s=3 * limits.HTTP_CONNECTION_LIFETIME_S,
        )
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(metrics.url() + "/metrics", timeout=10).status_code == 200


def test_incomplete_grpc_handshakes_are_dropped(pdproc: tuple[HostPort, HostPort]) -> None:
    listen, metrics = pdproc
    silent = connect_many(listen, 100, b"")  # TCP only: no HTTP/2 preface
    half = connect_many(listen, 100, b"PRI * HTTP/2.0\r\n")  # a preface cut short
    try:
        # gRPC's own default drops them only after about 50 s (measured with 1.85).
        until(
            lambda: all(map(closed_by_peer, silent + half)),
            "incomplete handshakes held open",
            within_s=3 * limits.GRPC_HANDSHAKE_TIMEOUT_S,
        )
    finally:
        for sock in silent + half:
            sock.close()
    # pdproc serves on.
    assert httpx.get(metrics.url() + "/readyz", timeout=10).status_code == 200


def test_serve_refuses_a_descriptor_limit_too_low_to_run(tmp_path: Path) -> None:
    low = limits.MIN_DESCRIPTORS - 1

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, low))

    script = Path(sys.executable).with_name("pdproc")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pdproc.cli"]
    done = subprocess.run(
        [*head, "serve", "--listen", "127.0.0.1:0", "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=SECONDS,
        preexec_fn=cap,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"the open-file limit is {low}" in done.stderr
    assert "Traceback" not in done.stderr


def test_serve_raises_its_soft_descriptor_limit_and_warns_below_what_it_can_use(
    tmp_path: Path,
) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < limits.MIN_DESCRIPTORS + 100:
        pytest.skip("hard descriptor limit too low on this machine")
    hard_cap = limits.MIN_DESCRIPTORS + 100

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.MIN_DESCRIPTORS, hard_cap))

    process = start_pdproc_with(tmp_path, cap)
    try:
        limit_line = next(
            line
            for line in Path(f"/proc/{process.pid}/limits").read_text().splitlines()
            if line.startswith("Max open files")
        )
        assert limit_line.split()[3:5] == [str(hard_cap), str(hard_cap)]
    finally:
        process.terminate()
        _, err = process.communicate(timeout=SECONDS)
    assert "open-file limit is" in err
    assert "--max-prefill-connections" in err


def start_pdproc_with(tmp_path: Path, preexec: Callable[[], None]) -> subprocess.Popen[str]:
    metrics = HostPort("127.0.0.1", free_port())
    script = Path(sys.executable).with_name("pdproc")
    head = [str(script)] if script.exists() else [sys.executable, "-m", "pdproc.cli"]
    argv = [*head, "serve", "--listen", "127.0.0.1:0", "--workers", "1"]
    argv += ["--metrics-listen", str(metrics), "--shutdown-delay", "0"]
    process = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=preexec
    )

    def ready() -> bool:
        assert process.poll() is None, "pdproc exited"
        with contextlib.suppress(httpx.TransportError):
            return httpx.get(metrics.url() + "/readyz", timeout=2).status_code == 200
        return False

    try:
        until(ready, "pdproc not ready")
    except BaseException:
        process.kill()
        process.communicate()
        raise
    return process
