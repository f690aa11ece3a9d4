"""`pdproc-sim ...` / `pdproc sim ...` / `python -m pdproc_sim ...`: run simulated vLLM servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence

import orjson

from pdproc_sim.decode import DecodeConfig
from pdproc_sim.openai_shapes import DEFAULT_MODEL
from pdproc_sim.prefill import PrefillConfig
from pdproc_sim.runner import RunningSim, start_decode, start_prefill

log = logging.getLogger("pdproc_sim")

_DEFAULT_PREFILL_PORT = 8100
_DEFAULT_BOOTSTRAP_PORT = 8998
_DEFAULT_DECODE_PORT = 8200


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (IPv6 ok)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name served")
    parser.add_argument(
        "--record-limit", type=_positive_int, default=10_000, help="request ring size"
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="stderr log level",
    )


def _add_prefill_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp-ranks", type=_positive_int, default=1, help="data-parallel ranks")
    parser.add_argument("--engine-id-prefix", default=None, help="engine id base (else uuid4)")
    parser.add_argument("--prefill-delay-ms", type=float, default=0.0)
    parser.add_argument(
        "--prefill-ms-per-kib", type=float, default=0.0, help="extra delay per KiB of body"
    )
    parser.add_argument("--kv-ttl-s", type=float, default=600.0, help="keep finished transfers")


def _add_decode_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--first-token-delay-ms", type=float, default=0.0)
    parser.add_argument("--itl-ms", type=float, default=0.0, help="delay between tokens")
    parser.add_argument("--kv-timeout-s", type=float, default=480.0, help="wait for the prefill")
    parser.add_argument(
        "--default-tokens", type=_positive_int, default=16, help="when max_tokens absent"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdproc sim", description="Simulated vLLM Mooncake prefill/decode servers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prefill = sub.add_parser("prefill", help="prefill server + Mooncake bootstrap server")
    _add_common(prefill)
    prefill.add_argument("--port", type=int, default=_DEFAULT_PREFILL_PORT)
    prefill.add_argument("--bootstrap-port", type=int, default=_DEFAULT_BOOTSTRAP_PORT)
    _add_prefill_flags(prefill)

    decode = sub.add_parser("decode", help="decode server")
    _add_common(decode)
    decode.add_argument("--port", type=int, default=_DEFAULT_DECODE_PORT)
    _add_decode_flags(decode)

    pair = sub.add_parser("pair", help="prefill, bootstrap and decode in one process")
    _add_common(pair)
    pair.add_argument("--prefill-port", type=int, default=_DEFAULT_PREFILL_PORT)
    pair.add_argument("--bootstrap-port", type=int, default=_DEFAULT_BOOTSTRAP_PORT)
    pair.add_argument("--decode-port", type=int, default=_DEFAULT_DECODE_PORT)
    _add_prefill_flags(pair)
    _add_decode_flags(pair)
    return parser


def prefill_config(args: argparse.Namespace, port: int) -> PrefillConfig:
    return PrefillConfig(
        host=args.host,
        port=port,
        bootstrap_port=args.bootstrap_port,
        dp_ranks=args.dp_ranks,
        engine_id_prefix=args.engine_id_prefix,
        prefill_delay_ms=args.prefill_delay_ms,
        prefill_ms_per_kib=args.prefill_ms_per_kib,
        kv_ttl_s=args.kv_ttl_s,
        model=args.model,
        record_limit=args.record_limit,
    )


def decode_config(args: argparse.Namespace, port: int) -> DecodeConfig:
    return DecodeConfig(
        host=args.host,
        port=port,
        first_token_delay_ms=args.first_token_delay_ms,
        itl_ms=args.itl_ms,
        kv_timeout_s=args.kv_timeout_s,
        default_tokens=args.default_tokens,
        model=args.model,
        record_limit=args.record_limit,
    )


async def _start_all(args: argparse.Namespace, started: list[RunningSim]) -> dict[str, object]:
    """Start what the subcommand asks for; `started` collects them for cleanup on failure."""
    ready: dict[str, object] = {"ready": True}
    if args.command in ("prefill", "pair"):
        port = args.port if args.command == "prefill" else args.prefill_port
        prefill = await start_prefill(prefill_config(args, port))
        started.append(prefill)
        ready["prefill"] = prefill.address
        ready["bootstrap"] = prefill.bootstrap_address
    if args.command in ("decode", "pair"):
        port = args.port if args.command == "decode" else args.decode_port
        decode = await start_decode(decode_config(args, port))
        started.append(decode)
        ready["decode"] = decode.address
    return ready


async def _serve(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started: list[RunningSim] = []
    try:
        try:
            ready = await _start_all(args, started)
        except OSError as exc:
            log.error("cannot listen: %s", exc)
            return 1
        sys.stdout.write(orjson.dumps(ready).decode() + "\n")
        sys.stdout.flush()
        log.info("simulator ready: %s", ready)
        await stop.wait()
        return 0
    finally:
        # Decode first: its long polls would otherwise hold the prefill's drain.
        for sim in reversed(started):
            await sim.close()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    logging.basicConfig(
        stream=sys.stderr,
        level=args.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    with (
        contextlib.suppress(KeyboardInterrupt),
        asyncio.Runner(loop_factory=_loop_factory()) as runner,
    ):
        return runner.run(_serve(args))
    return 0


def entry(argv: Sequence[str]) -> int:
    """`pdproc sim ...` and `pdproc demo ...` (pdproc's CLI delegates here; argv[0] is the
    subcommand)."""
    command, rest = argv[0], list(argv[1:])
    if command == "demo":
        from pdproc_sim.demo import main as demo_main

        return demo_main(rest)
    return main(rest)
