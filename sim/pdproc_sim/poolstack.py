"""Several simulated prefill pods and decodes on loopback, for pool mode: each prefill on its
own loopback address (127.0.0.2, .3, ...), all with the same bootstrap port, as pods of one
Deployment share a port on different IPs (pdproc's --mooncake-bootstrap-port is one setting
for the whole pool). The decodes listen on 127.0.0.1.

Used by the end-to-end tests of the pool policies and by bench/multiturn.py.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import orjson
from pdproc.targets import HostPort, parse_host_port

from pdproc_sim.devstack import Process, console_script, free_port, spawn

_ATTEMPTS = 5


@dataclass
class SimPool:
    prefills: list[HostPort]
    bootstrap_port: int
    decodes: list[HostPort]
    processes: list[Process] = field(default_factory=list)

    def stop(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()


def _ready(proc: Process) -> dict[str, str]:
    assert proc.popen.stdout is not None
    line = proc.popen.stdout.readline()
    if not line:
        proc.popen.wait(5)
        raise RuntimeError(f"simulator did not start: {proc.tail()}")
    ready: dict[str, str] = orjson.loads(line)
    return ready


def _start(workdir: Path, name: str, argv: Sequence[str]) -> Process:
    return spawn(
        name, [*console_script("pdproc-sim", "pdproc_sim"), *argv], workdir, subprocess.PIPE
    )


def _common_bootstrap_port(hosts: Sequence[str]) -> int:
    """A port free on every host (picked, then checked: another process may still take it
    first, which start_pool's retry covers)."""
    for _ in range(50):
        port = free_port(hosts[0])
        if all(free_port_is(host, port) for host in hosts[1:]):
            return port
    raise RuntimeError("no port free on every prefill address")


def free_port_is(host: str, port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _start_prefills(workdir: Path, count: int, args: Sequence[str], pool: SimPool) -> None:
    hosts = [f"127.0.0.{i + 2}" for i in range(count)]
    for attempt in range(_ATTEMPTS):
        port = _common_bootstrap_port(hosts)
        started: list[Process] = []
        try:
            for index, host in enumerate(hosts):
                argv = ["prefill", "--host", host, "--port", "0", "--bootstrap-port", str(port)]
                argv += ["--engine-id-prefix", f"prefill{index}", *args]
                proc = _start(workdir, f"prefill{index}", argv)
                started.append(proc)
                pool.prefills.append(parse_host_port(_ready(proc)["prefill"]))
        except RuntimeError:
            for proc in started:
                proc.stop()
            pool.prefills.clear()
            if attempt + 1 == _ATTEMPTS:
                raise
            continue
        pool.processes += started
        pool.bootstrap_port = port
        return


@contextlib.contextmanager
def running_pool(
    workdir: Path,
    prefills: int,
    decodes: int = 1,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
) -> Iterator[SimPool]:
    """`prefills` simulated prefill pods and `decodes` decodes, stopped on exit."""
    pool = SimPool([], 0, [])
    try:
        _start_prefills(workdir, prefills, prefill_args, pool)
        for index in range(decodes):
            argv = ["decode", "--host", "127.0.0.1", "--port", "0", *decode_args]
            proc = _start(workdir, f"decode{index}", argv)
            pool.processes.append(proc)
            pool.decodes.append(parse_host_port(_ready(proc)["decode"]))
        yield pool
    finally:
        pool.stop()
