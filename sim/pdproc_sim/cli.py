"""`pdproc-sim ...` / `pdproc sim ...` / `python -m pdproc_sim ...`: run simulated vLLM servers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from pdproc_sim.connectors import (
    CONNECTORS,
    DEFAULT_CONNECTOR,
    DEFAULT_KV_TIMEOUT_S,
    MOONCAKE,
    SGLANG,
    SGLANG_BOOTSTRAP_TIMEOUT_S,
)
from pdproc_sim.decode import DecodeConfig
from pdproc_sim.openai_shapes import DEFAULT_MODEL
from pdproc_sim.prefill import FAULT_FIELDS as PREFILL_FAULTS
from pdproc_sim.prefill import PrefillConfig
from pdproc_sim.runner import RunningSim, start_decode, start_prefill
from pdproc_sim.state import JsonObject

log = logging.getLogger("pdproc_sim")

_DEFAULT_PREFILL_PORT = 8100
_DEFAULT_BOOTSTRAP_PORT = 8998
_DEFAULT_DECODE_PORT = 8200


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def port_number(text: str, *, lowest: int = 0) -> int:
    """A port flag's value; 0 (pick a free one) unless `lowest` is 1."""
    value = int(text)
    if not lowest <= value < 65536:
        raise argparse.ArgumentTypeError(f"port {value} out of range [{lowest}, 65535]")
    return value


def fixed_port(text: str) -> int:
    return port_number(text, lowest=1)


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _fault(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        value: Any = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = raw  # a bare word: a string (`--fault bootstrap=down`)
    return name, value


class _Format(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in --help, except where there is none to show (off, empty, connector's)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


_FORMAT = _Format


_PREFILL_PORT = "OpenAI API port of the prefill (0: pick a free one)"
_BOOTSTRAP_PORT = (
    "port of the prefill's bootstrap server: Mooncake /query, NIXL side channel (remote_port) "
    "or SGLang bootstrap_port (0: pick a free one)"
)
_DECODE_PORT = "OpenAI API port of the decode (0: pick a free one)"


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="listen address (IPv6 ok)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model name served")
    parser.add_argument(
        "--kv-connector",
        choices=CONNECTORS,
        default=DEFAULT_CONNECTOR,
        help="KV hand-over protocol both legs speak (see docs/simulator.md)",
    )
    parser.add_argument(
        "--record-limit", type=positive_int, default=10_000, help="request ring size"
    )
    parser.add_argument(
        "--fault",
        action="append",
        type=_fault,
        default=[],
        metavar="NAME=VALUE",
        help="start with this fault set, as POST /sim/faults would set it (repeatable; the "
        "value is JSON, else a string: --fault prefill_status=503 --fault bootstrap=down)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="stderr log level",
    )


def _add_prefill_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp-ranks", type=positive_int, default=1, help="data-parallel ranks")
    parser.add_argument("--engine-id-prefix", default=None, help="engine id base (else uuid4)")
    parser.add_argument(
        "--prefill-delay-ms", type=_seconds, default=0.0, help="compute time of each prefill"
    )
    parser.add_argument(
        "--prefill-ms-per-kib", type=_seconds, default=0.0, help="extra delay per KiB of body"
    )
    parser.add_argument(
        "--rank-concurrency",
        type=_non_negative_int,
        default=0,
        help="prefills one DP rank computes at once, the rest wait in FIFO order (0: no limit)",
    )
    parser.add_argument(
        "--kv-ttl-s", type=_seconds, default=600.0, help="keep finished transfers this long"
    )
    parser.add_argument(
        "--sglang-bootstrap-timeout-s",
        type=_seconds,
        default=SGLANG_BOOTSTRAP_TIMEOUT_S,
        help="sglang: how long a prefill waits for its decode to bootstrap, then answers 500 "
        "(SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)",
    )


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _add_cache_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-cache-blocks",
        type=_non_negative_int,
        default=0,
        help="prefix cache per engine, in 16-token (64-character) blocks, LRU (0: none); "
        "answers then carry usage.prompt_tokens_details.cached_tokens",
    )
    parser.add_argument(
        "--prefill-ms-per-token",
        type=_seconds,
        default=0.0,
        help="compute time per prompt token not found in the prefix cache",
    )


def _add_decode_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--first-token-delay-ms", type=_seconds, default=0.0, help="delay before the first token"
    )
    parser.add_argument("--itl-ms", type=_seconds, default=0.0, help="delay between tokens")
    parser.add_argument(
        "--kv-timeout-s",
        type=_seconds,
        default=None,
        help="how long a decode waits for its KV (default: the connector's, vLLM "
        f"{DEFAULT_KV_TIMEOUT_S[MOONCAKE]:g} s, SGLang {DEFAULT_KV_TIMEOUT_S[SGLANG]:g} s)",
    )
    parser.add_argument(
        "--default-tokens", type=positive_int, default=16, help="when max_tokens absent"
    )
    parser.add_argument(
        "--require-kv",
        action="store_true",
        help="reject (400) completions without a KV hand-over instead of serving them alone "
        "(an sglang decode always does)",
    )


def build_parser(prog: str = "pdproc sim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Simulated vLLM / SGLang prefill and decode servers that speak the "
        "Mooncake, NIXL v2 or SGLang KV hand-over.",
        formatter_class=_FORMAT,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    prefill = sub.add_parser(
        "prefill", help="prefill server + its bootstrap server", formatter_class=_FORMAT
    )
    _add_common(prefill)
    prefill.add_argument(
        "--port", type=port_number, default=_DEFAULT_PREFILL_PORT, help=_PREFILL_PORT
    )
    prefill.add_argument(
        "--bootstrap-port", type=port_number, default=_DEFAULT_BOOTSTRAP_PORT, help=_BOOTSTRAP_PORT
    )
    _add_prefill_flags(prefill)
    _add_cache_flags(prefill)

    decode = sub.add_parser("decode", help="decode server", formatter_class=_FORMAT)
    _add_common(decode)
    decode.add_argument("--port", type=port_number, default=_DEFAULT_DECODE_PORT, help=_DECODE_PORT)
    _add_decode_flags(decode)
    _add_cache_flags(decode)

    pair = sub.add_parser(
        "pair", help="prefill, bootstrap and decode in one process", formatter_class=_FORMAT
    )
    _add_common(pair)
    pair.add_argument(
        "--prefill-port", type=port_number, default=_DEFAULT_PREFILL_PORT, help=_PREFILL_PORT
    )
    pair.add_argument(
        "--bootstrap-port", type=port_number, default=_DEFAULT_BOOTSTRAP_PORT, help=_BOOTSTRAP_PORT
    )
    pair.add_argument(
        "--decode-port", type=port_number, default=_DEFAULT_DECODE_PORT, help=_DECODE_PORT
    )
    _add_prefill_flags(pair)
    _add_decode_flags(pair)
    _add_cache_flags(pair)
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
        kv_connector=args.kv_connector,
        sglang_bootstrap_timeout_s=args.sglang_bootstrap_timeout_s,
        prefix_cache_blocks=args.prefix_cache_blocks,
        prefill_ms_per_token=args.prefill_ms_per_token,
        rank_concurrency=args.rank_concurrency,
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
        kv_connector=args.kv_connector,
        require_kv=args.require_kv,
        prefix_cache_blocks=args.prefix_cache_blocks,
        prefill_ms_per_token=args.prefill_ms_per_token,
    )


def split_faults(command: str, faults: list[tuple[str, Any]]) -> tuple[JsonObject, JsonObject]:
    """--fault values as (prefill patch, decode patch): in a pair each goes to the role that
    knows the field; a lone server takes all (and rejects what it does not know)."""
    prefill: JsonObject = {}
    decode: JsonObject = {}
    for name, value in faults:
        to_prefill = command == "prefill" or (command == "pair" and name in PREFILL_FAULTS)
        (prefill if to_prefill else decode)[name] = value
    return prefill, decode


async def _start_all(args: argparse.Namespace, started: list[RunningSim]) -> dict[str, object]:
    """Start what the subcommand asks for; `started` collects them for cleanup on failure."""
    ready: dict[str, object] = {"ready": True, "kv_connector": args.kv_connector}
    prefill_faults, decode_faults = split_faults(args.command, args.fault)
    if args.command in ("prefill", "pair"):
        port = args.port if args.command == "prefill" else args.prefill_port
        prefill = await start_prefill(prefill_config(args, port))
        started.append(prefill)
        prefill.state.apply_faults(prefill_faults)
        ready["prefill"] = prefill.address
        ready["bootstrap"] = prefill.bootstrap_address
    if args.command in ("decode", "pair"):
        port = args.port if args.command == "decode" else args.decode_port
        decode = await start_decode(decode_config(args, port))
        started.append(decode)
        decode.state.apply_faults(decode_faults)
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
        except ValueError as exc:
            sys.stderr.write(f"{_prog()}: --fault: {exc}\n")
            return 2
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


def _prog() -> str:
    return "pdproc-sim" if Path(sys.argv[0]).name == "pdproc-sim" else "pdproc sim"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(_prog())
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
