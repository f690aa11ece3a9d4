"""`pdproc demo`: the whole P/D path on loopback, ready for a curl.

A first run must not fail in a confusing way: a taken port is refused with a sentence
naming it (Envoy's `enable_reuse_port` would otherwise share it silently with whatever
holds it), a failure keeps the log folder and says where it is, and the printed curl
uses the model name the simulator serves.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from pdproc_sim.cli import fixed_port, positive_int
from pdproc_sim.connectors import CONNECTORS, DEFAULT_CONNECTOR
from pdproc_sim.devstack import Process, Stack, pdproc_has_flag, running_stack
from pdproc_sim.openai_shapes import DEFAULT_MODEL

DEMO_HOST = "127.0.0.1"
# How often the demo looks whether one of its processes died.
_WATCH_INTERVAL_S = 0.5

_CURL = """\
  curl -N {url}/v1/chat/completions -H 'content-type: application/json' -d '{{
    "model": "{model}", "stream": true, "max_tokens": 8,
    "messages": [{{"role": "user", "content": "Hello from pdproc"}}]}}'"""


class DemoError(Exception):
    """A failure the demo explains in one sentence (no traceback)."""


def port_in_use(host: str, port: int) -> bool:
    """True when something listens on host:port. The probe binds without SO_REUSEPORT, so
    a listener that shares ports (Envoy's enable_reuse_port, pdproc --workers) is found too;
    SO_REUSEADDR keeps a previous run's TIME_WAIT connections from counting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return True
    return False


def check_ports(ports: Sequence[tuple[int, str]], host: str = DEMO_HOST) -> None:
    """Refuse to start on a port something already holds; `ports` pairs a port with the flag
    that moves it."""
    for port, flag in ports:
        if port_in_use(host, port):
            raise DemoError(
                f"port {port} on {host} is already in use (another pdproc demo or Envoy?); "
                f"stop whatever holds it or choose another port with {flag} PORT"
            )


def _dead(stack: Stack) -> Process | None:
    for proc in (stack.sim.process, stack.pdproc, stack.envoy.process, *stack.extra):
        if proc.popen.poll() is not None:
            return proc
    return None


def _banner(stack: Stack, dp_ranks: int, connector: str) -> str:
    return (
        f"pdproc demo is up (logs in {stack.workdir}):\n"
        f"  Envoy      {stack.envoy.url}  (admin {stack.envoy.admin.url()})\n"
        f"  pdproc     {stack.pdproc_addr} (metrics {stack.metrics_addr.url()}/metrics)\n"
        f"  prefill    {stack.sim.prefill} (bootstrap {stack.sim.bootstrap}, "
        f"{dp_ranks} dp ranks, KV connector {connector})\n"
        f"  decode     {stack.sim.decode}\n\n"
        "Try a streaming chat request (each token is a separate SSE chunk):\n"
        f"{_CURL.format(url=stack.envoy.url, model=DEFAULT_MODEL)}\n\n"
        "Ctrl-C stops everything."
    )


def _serve(workdir: Path, port: int, dp_ranks: int, connector: str, stop: threading.Event) -> None:
    """Start the stack, print how to use it, watch it until `stop`; raise DemoError when a
    part fails to start or dies."""
    sim_args = ["--dp-ranks", str(dp_ranks), "--prefill-delay-ms", "20", "--itl-ms", "50"]
    pdproc_args = ["--log-format", "text"]
    # Both get --kv-connector; a pdproc from before the flag speaks only the default.
    has_flag = pdproc_has_flag("--kv-connector")
    if not has_flag and connector != DEFAULT_CONNECTOR:
        raise DemoError(
            f"this pdproc has no --kv-connector flag, so it only speaks {DEFAULT_CONNECTOR}; "
            f"--kv-connector {connector} needs a newer pdproc"
        )
    try:
        with running_stack(
            sim_args,
            pdproc_args,
            workdir=workdir,
            envoy_port=port,
            pool=True,
            kv_connector=connector if has_flag else None,
        ) as stack:
            print(_banner(stack, dp_ranks, connector), flush=True)
            while not stop.wait(_WATCH_INTERVAL_S):
                dead = _dead(stack)
                if dead is not None:
                    raise DemoError(
                        f"{dead.name} exited with code {dead.popen.returncode}:\n{dead.tail(10)}"
                    )
    except (RuntimeError, TimeoutError, OSError) as exc:
        # Start-up failures of devstack: a process that exited, a readiness timeout, a
        # missing binary. Their messages already name the part and quote its log.
        raise DemoError(str(exc)) from None


def run_demo(port: int = 10000, dp_ranks: int = 2, connector: str = DEFAULT_CONNECTOR) -> int:
    try:
        check_ports([(port, "--port")])
    except DemoError as exc:
        print(f"pdproc demo: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    workdir = Path(tempfile.mkdtemp(prefix="pdproc-demo-"))
    try:
        _serve(workdir, port, dp_ranks, connector, stop)
    except DemoError as exc:
        print(f"pdproc demo: {exc}\npdproc demo: logs kept in {workdir}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # A clean stop leaves nothing behind.
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


# SIGHUP: the terminal the demo runs in was closed. Left at its default, it would kill the
# demo without its clean-up and leave Envoy (and the rest) running, holding the port.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdproc demo",
        description="Envoy + pdproc + a simulated vLLM prefill/decode pair on loopback "
        f"({DEMO_HOST}). Other ports are picked free at run time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=fixed_port, default=10000, help="Envoy listener port")
    parser.add_argument(
        "--dp-ranks", type=positive_int, default=2, help="prefill data-parallel ranks"
    )
    parser.add_argument(
        "--kv-connector",
        choices=sorted(CONNECTORS),
        default=DEFAULT_CONNECTOR,
        help="KV connector the simulated pair and pdproc speak",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    with contextlib.suppress(KeyboardInterrupt):
        return run_demo(port=args.port, dp_ranks=args.dp_ranks, connector=args.kv_connector)
    return 130
