"""Closed-loop streaming load generator: `python -m bench.loadgen --url ... > result.json`.

It runs in a process of its own so its CPU and event loop never share a GIL with what it
measures, and it times each request itself: TTFT is the first SSE `data:` chunk as seen by
the client, end-to-end is the last byte. `--concurrency` workers each send one request after
another until `--requests` are done or `--time-limit` runs out, whichever comes first; the
warm-up requests before that use the same connection pool, so measured requests find their
connections open.

With `--sync` the measured phase waits for the caller: after the warm-up a line
`{"phase": "warm"}` goes to stdout and the client waits for a line on stdin; the result line
follows as soon as the measured phase ends (before the connections are closed). `bench.run`
reads every process's CPU time at those two points, so CPU per request covers exactly the
measured requests.

With `--pd-prefill` and `--pd-bootstrap` the client plays the P/D router itself (the same
bodies pdproc builds, from `pdproc.connectors.mooncake`): prefill and decode go straight to the
simulator, concurrently. That is the floor of the protocol with no proxy in the way. With
`--pd-prefill` and `--pd-nixl` it plays NIXL's router: the prefill first (the body pdproc
builds, `pdproc.connectors.nixlv2`), then the decode with the prefill's `kv_transfer_params`;
TTFT then counts from the prefill's first byte.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from pdproc.connectors import mooncake, nixlv2
from pdproc.engine_maps import parse_engine_map
from pdproc.request_body import KV_PARAMS, parse_body, with_field

DEFAULT_PATH = "/v1/chat/completions"
DEFAULT_MODEL = "sim-model"
# Same length as mooncake.new_transfer_id(), so swapping it in keeps content-length right.
_TRANSFER_PLACEHOLDER = b"xfer-00000000-0000-0000-0000-000000000000"
_DONE = b"data: [DONE]"
_FILLER = b"the quick brown fox jumps over the lazy dog "
# How long stragglers may run past --time-limit before they are cancelled.
_GRACE_S = 10.0


def make_body(size: int, max_tokens: int, model: str = DEFAULT_MODEL) -> bytes:
    """A streaming chat request whose JSON is `size` bytes long (or minimal if smaller)."""
    skeleton: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": ""}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    pad = max(0, size - len(orjson.dumps(skeleton)))
    content = (_FILLER * (pad // len(_FILLER) + 1))[:pad].decode()
    skeleton["messages"][0]["content"] = content
    return orjson.dumps(skeleton)


@dataclass
class PdPlan:
    """Templates for the client-side P/D mode; only the transfer id changes per request."""

    prefill_url: str
    prefill_template: bytes
    decode_template: bytes
    # NIXL: the prefill first, its answer's kv_transfer_params into the client's body
    nixl: bool = False
    client_body: bytes = b""


@dataclass
class Tally:
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    ok: int = 0
    failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    sent: int = 0

    def fail(self, reason: str) -> None:
        self.failed += 1
        self.errors[reason[:200]] += 1


UPLOAD_PIECE = 64 * 1024


async def _paced(body: bytes, bytes_per_s: float) -> AsyncIterator[bytes]:
    """The body in 64 KiB pieces at `bytes_per_s`, as a client on a real link sends it."""
    start = time.perf_counter()
    for offset in range(0, len(body), UPLOAD_PIECE):
        yield body[offset : offset + UPLOAD_PIECE]
        delay = start + (offset + UPLOAD_PIECE) / bytes_per_s - time.perf_counter()
        if delay > 0 and offset + UPLOAD_PIECE < len(body):
            await asyncio.sleep(delay)


async def _stream_one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    limits: aiohttp.ClientTimeout,
    upload_bytes_per_s: float = 0.0,
) -> tuple[float, float] | str:
    """One streaming request: (ttft_ms, e2e_ms), or why it failed. TTFT counts from the
    first byte sent, so a paced upload's own time is part of it (for every configuration)."""
    start = time.perf_counter()
    ttft: float | None = None
    tail = b""
    data: bytes | AsyncIterator[bytes] = body
    if upload_bytes_per_s > 0 and len(body) > UPLOAD_PIECE:
        # An explicit content-length keeps aiohttp from sending it chunked.
        headers = {**headers, "content-length": str(len(body))}
        data = _paced(body, upload_bytes_per_s)
    async with session.post(url, data=data, headers=headers, timeout=limits) as response:
        if response.status != 200:
            text = (await response.read())[:120].decode("utf-8", "replace")
            return f"http_{response.status}: {text}"
        async for chunk in response.content.iter_any():
            if ttft is None and b"data:" in (tail + chunk):
                ttft = (time.perf_counter() - start) * 1000
            # Only the last bytes matter for spotting [DONE], which may straddle two chunks.
            tail = (tail + chunk)[-64:]
    end = (time.perf_counter() - start) * 1000
    if ttft is None:
        return "no_data_chunk"
    if _DONE not in tail:
        # The decode reports a failed KV pull in-band and ends the stream without [DONE].
        return "stream_without_done"
    return ttft, end


async def _prefill_one(
    session: aiohttp.ClientSession, url: str, body: bytes, limits: aiohttp.ClientTimeout
) -> str | None:
    headers = {"content-type": "application/json", mooncake.RANK_HEADER: "0"}
    async with session.post(url, data=body, headers=headers, timeout=limits) as response:
        await response.read()
        return None if response.status == 200 else f"prefill_http_{response.status}"


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    headers: dict[str, str],
    limits: aiohttp.ClientTimeout,
    pd: PdPlan | None,
    upload_bytes_per_s: float = 0.0,
) -> tuple[float, float] | str:
    try:
        if pd is None:
            return await _stream_one(session, url, body, headers, limits, upload_bytes_per_s)
        if pd.nixl:
            return await _nixl_one(session, url, pd, headers, limits)
        transfer = mooncake.new_transfer_id().encode()
        prefill = asyncio.create_task(
            _prefill_one(
                session,
                pd.prefill_url,
                pd.prefill_template.replace(_TRANSFER_PLACEHOLDER, transfer),
                limits,
            )
        )
        decode_body = pd.decode_template.replace(_TRANSFER_PLACEHOLDER, transfer)
        try:
            result = await _stream_one(
                session, url, decode_body, headers, limits, upload_bytes_per_s
            )
        finally:
            prefill_error = await prefill
        return prefill_error or result
    except TimeoutError:
        return "timeout"
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"


async def _nixl_one(
    session: aiohttp.ClientSession,
    url: str,
    pd: PdPlan,
    headers: dict[str, str],
    limits: aiohttp.ClientTimeout,
) -> tuple[float, float] | str:
    """NIXL as its router does it: prefill, then the decode with the prefill's params. TTFT
    and end-to-end count from the prefill's first byte."""
    start = time.perf_counter()
    prefill_headers = {"content-type": "application/json"}
    async with session.post(
        pd.prefill_url, data=pd.prefill_template, headers=prefill_headers, timeout=limits
    ) as response:
        answer = await response.read()
        if response.status != 200:
            return f"prefill_http_{response.status}"
    try:
        params = orjson.loads(answer)[KV_PARAMS]
    except (ValueError, KeyError, TypeError):
        return "prefill_answer_without_kv_transfer_params"
    if not isinstance(params, dict):
        return "prefill_answer_without_kv_transfer_params"
    parsed = parse_body(pd.client_body)
    decode_body = with_field(pd.client_body, parsed, KV_PARAMS, params)
    offset = (time.perf_counter() - start) * 1000
    result = await _stream_one(session, url, decode_body, headers, limits)
    if isinstance(result, str):
        return result
    return result[0] + offset, result[1] + offset


@dataclass(frozen=True)
class Plan:
    url: str
    body: bytes
    headers: dict[str, str]
    concurrency: int
    requests: int
    warmup: int
    time_limit_s: float
    request_timeout_s: float
    pd: PdPlan | None
    sync: bool = False
    upload_bytes_per_s: float = 0.0


async def _phase(
    session: aiohttp.ClientSession, plan: Plan, count: int, deadline: float, tally: Tally
) -> None:
    """`plan.concurrency` workers share `count` requests and stop early at `deadline`."""
    remaining = count
    timeout = aiohttp.ClientTimeout(total=plan.request_timeout_s)

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0 and time.monotonic() < deadline:
            remaining -= 1
            tally.sent += 1
            result = await _one(
                session,
                plan.url,
                plan.body,
                plan.headers,
                timeout,
                plan.pd,
                plan.upload_bytes_per_s,
            )
            if isinstance(result, str):
                tally.fail(result)
            else:
                tally.ok += 1
                tally.ttft_ms.append(result[0])
                tally.e2e_ms.append(result[1])

    workers = [asyncio.create_task(worker()) for _ in range(plan.concurrency)]
    # Each request is bounded by its own timeout too; this caps the phase as a whole.
    _, pending = await asyncio.wait(workers, timeout=deadline - time.monotonic() + _GRACE_S)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if pending:
        tally.errors["cancelled_after_time_limit"] += len(pending)
        tally.failed += len(pending)


async def run(plan: Plan) -> dict[str, Any]:
    connector = aiohttp.TCPConnector(limit=plan.concurrency * (2 if plan.pd else 1))
    async with aiohttp.ClientSession(connector=connector) as session:
        warm = Tally()
        if plan.warmup:
            await _phase(session, plan, plan.warmup, time.monotonic() + plan.time_limit_s, warm)
        if plan.sync:
            _emit({"phase": "warm", "sent": warm.sent, "failed": warm.failed})
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        measured = Tally()
        cpu_start = _own_cpu_s()
        start = time.perf_counter()
        deadline = time.monotonic() + plan.time_limit_s
        await _phase(session, plan, plan.requests, deadline, measured)
        wall = time.perf_counter() - start
        cpu = _own_cpu_s() - cpu_start
        result = {
            "ok": measured.ok,
            "failed": measured.failed,
            "errors": dict(measured.errors),
            "sent": measured.sent,
            "warmup_sent": warm.sent,
            "warmup_failed": warm.failed,
            "warmup_errors": dict(warm.errors),
            "wall_s": wall,
            "rps": measured.ok / wall if wall > 0 else 0.0,
            "hit_time_limit": measured.sent < plan.requests,
            "client_cpu_s": cpu,
            "body_bytes": len(plan.body),
            "ttft_ms": [round(v, 3) for v in measured.ttft_ms],
            "e2e_ms": [round(v, 3) for v in measured.e2e_ms],
        }
        # Out before the pool closes, so closing connections is not in the caller's bracket.
        _emit(result)
    return result


def _emit(line: dict[str, Any]) -> None:
    sys.stdout.buffer.write(orjson.dumps(line) + b"\n")
    sys.stdout.buffer.flush()


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _pd_plan(
    prefill: str, bootstrap: str, path: str, body: bytes, timeout_s: float
) -> PdPlan:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            bootstrap.rstrip("/") + "/query", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response,
    ):
        engines = parse_engine_map(await response.read())
    engine_id = engines[min(engines)]
    parsed = parse_body(body)
    placeholder = _TRANSFER_PLACEHOLDER.decode()
    return PdPlan(
        prefill_url=prefill.rstrip("/") + path,
        prefill_template=bytes(
            mooncake.prefill_body(path, parsed, mooncake.prefill_params(placeholder))
        ),
        decode_template=with_field(
            body,
            parsed,
            KV_PARAMS,
            mooncake.decode_params(placeholder, bootstrap.rstrip("/"), engine_id),
        ),
    )


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"header must be NAME:VALUE, got {text!r}")
    return name.strip().lower(), value.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.loadgen", description=__doc__)
    parser.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8080")
    parser.add_argument("--path", default=DEFAULT_PATH)
    parser.add_argument("--size", type=int, default=1024, help="request body bytes")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--requests", type=int, default=100, help="measured requests")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured requests first")
    parser.add_argument("--time-limit", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--request-timeout", type=float, default=30.0)
    parser.add_argument("--header", type=_header, action="append", default=[])
    parser.add_argument(
        "--upload-mbps",
        type=float,
        default=0.0,
        help="send bodies over 64 KiB in 64 KiB pieces at this many MB/s, as a client on a "
        "real link would (0: as fast as loopback goes)",
    )
    parser.add_argument("--pd-prefill", help="client-side P/D: prefill base URL")
    parser.add_argument("--pd-bootstrap", help="client-side P/D: bootstrap base URL")
    parser.add_argument(
        "--pd-nixl", action="store_true", help="client-side P/D with NIXL (prefill, then decode)"
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help='after the warm-up, print {"phase": "warm"} and wait for a line on stdin',
    )
    return parser


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    body = make_body(args.size, args.max_tokens)
    pd = None
    if args.pd_nixl:
        if not args.pd_prefill:
            raise SystemExit("--pd-nixl needs --pd-prefill")
        template = bytes(nixlv2.prefill_body(args.path, parse_body(body)))
        pd = PdPlan(args.pd_prefill.rstrip("/") + args.path, template, b"", True, body)
    elif args.pd_prefill or args.pd_bootstrap:
        if not (args.pd_prefill and args.pd_bootstrap):
            raise SystemExit("--pd-prefill and --pd-bootstrap go together")
        pd = await _pd_plan(
            args.pd_prefill, args.pd_bootstrap, args.path, body, args.request_timeout
        )
    plan = Plan(
        url=args.url.rstrip("/") + args.path,
        body=body,
        headers={"content-type": "application/json", **dict(args.header)},
        concurrency=max(1, args.concurrency),
        requests=max(0, args.requests),
        warmup=max(0, args.warmup),
        time_limit_s=args.time_limit,
        request_timeout_s=args.request_timeout,
        pd=pd,
        sync=args.sync,
        upload_bytes_per_s=args.upload_mbps * 1e6,
    )
    return await run(plan)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvloop
    except ImportError:
        asyncio.run(_main(args))
    else:
        # The client should be the cheapest process on the box; uvloop helps every config alike.
        uvloop.run(_main(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
