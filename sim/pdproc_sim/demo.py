"""`pdproc demo`: the whole P/D path on loopback, ready for a curl."""

from __future__ import annotations

import argparse
import signal
import threading
from collections.abc import Sequence

from pdproc_sim.devstack import running_stack

_CURL = """\
  curl -N {url}/v1/chat/completions -H 'content-type: application/json' -d '{{
    "model": "sim", "stream": true, "max_tokens": 8,
    "messages": [{{"role": "user", "content": "Hello from pdproc"}}]}}'"""


def run_demo(port: int = 10000, dp_ranks: int = 2) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    sim_args = ["--dp-ranks", str(dp_ranks), "--prefill-delay-ms", "20", "--itl-ms", "50"]
    with running_stack(sim_args, ["--log-format", "text"], envoy_port=port, pool=True) as stack:
        print(
            f"pdproc demo is up (logs in {stack.workdir}):\n"
            f"  Envoy      {stack.envoy.url}  (admin {stack.envoy.admin.url()})\n"
            f"  pdproc     {stack.pdproc_addr} (metrics {stack.metrics_addr.url()}/metrics)\n"
            f"  prefill    {stack.sim.prefill} (bootstrap {stack.sim.bootstrap}, "
            f"{dp_ranks} dp ranks)\n"
            f"  decode     {stack.sim.decode}\n\n"
            f"Try a streaming chat request (each token is a separate SSE chunk):\n"
            f"{_CURL.format(url=stack.envoy.url)}\n\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        stop.wait()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdproc demo",
        description="Envoy + pdproc + a simulated vLLM prefill/decode pair on loopback.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--port", type=int, default=10000, help="Envoy listener port")
    parser.add_argument("--dp-ranks", type=int, default=2, help="prefill data-parallel ranks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    return run_demo(port=args.port, dp_ranks=args.dp_ranks)
