"""The bed's client: paced streaming completions through Envoy, and a poller of each prefill
pod's counters. Run inside the client namespace by the bed:

    python -m tests.cluster.load --url URL --clients 8 --rate 12 --duration 20 \
        --timeout 20 --poll 10.213.0.11:8100 ... --out result.json

Bounded: it sends for --duration seconds (or --requests requests), every request has a total
timeout of --timeout seconds, and then it stops. Its first stdout line is
`{"t0": <CLOCK_MONOTONIC>}`: the scenario's time zero, a clock every namespace shares.
Times in the result are seconds from t0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

PROMPT = "The cluster bed sends this prompt to the gateway. " * 4
# Every request opens its own conversation, as many users would: pdproc's default pool
# policy keeps one conversation on one pod (its prefix cache), so one prompt repeated would
# measure that stickiness, not how the pool shares out and routes around failures.
_conversations = itertools.count()


@dataclass
class Sent:
    start: float
    end: float
    status: int
    error: str | None
    first: float | None  # the first streamed event (the first token): time to first token


@dataclass
class Clock:
    t0: float

    def now(self) -> float:
        return time.monotonic() - self.t0


async def complete(
    session: aiohttp.ClientSession, url: str, timeout_s: float, clock: Clock, first: list[float]
) -> tuple[int, str | None]:
    """One streamed completion: (status, None) when it streamed to its `[DONE]`, else what
    went wrong (`502 bootstrap_error`, `in-band error`, `timeout` ...). Appends the time of
    its first event to `first`."""
    prompt = f"Conversation {next(_conversations)}. {PROMPT}"
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 8, "stream": True}
    try:
        async with session.post(
            url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            if resp.status != 200:
                await resp.read()
                # pdproc names why it answered itself; anything else is Envoy's or the decode's.
                kind = resp.headers.get("x-pdproc-error", "not pdproc's")[:40]
                return resp.status, f"{resp.status} {kind}"
            done = False
            async for line in resp.content:
                text = line.decode("utf-8", "replace").strip()
                if text.startswith("data:") and not first:
                    first.append(clock.now())
                if text == "data: [DONE]":
                    done = True
                elif text.startswith("data:") and '"error"' in text:
                    return resp.status, "in-band error"
            return resp.status, None if done else "no [DONE]"
    except TimeoutError:
        return 0, f"timeout ({timeout_s:g} s)"
    except aiohttp.ClientError as exc:
        return 0, type(exc).__name__


async def client(
    clock: Clock,
    url: str,
    offset: float,
    period: float,
    args: argparse.Namespace,
    sent: list[Sent],
    budget: list[int],
) -> None:
    """One client: a request every `period` seconds from `offset`, never two at once (a slot
    missed while a request runs is skipped, not caught up: no burst after a stall)."""
    connector = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        due = offset
        while due < args.duration and budget[0] != 0:
            budget[0] -= 1
            await asyncio.sleep(max(0.0, due - clock.now()))
            start = clock.now()
            first: list[float] = []
            status, error = await complete(session, url, args.timeout, clock, first)
            sent.append(Sent(start, clock.now(), status, error, first[0] if first else None))
            due += period
            while period and due < clock.now():
                due += period


async def poll(clock: Clock, pod: str, every_s: float, stop: asyncio.Event, out: list[Any]) -> None:
    """The pod's prefill count (`/sim/stats`) every `every_s`: (time, count), or (time, None)
    while it does not answer."""
    timeout = aiohttp.ClientTimeout(total=min(1.0, every_s * 5))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            count: int | None
            try:
                async with session.get(f"http://{pod}/sim/stats") as resp:
                    stats = await resp.json()
                count = sum(int(n) for n in stats.get("prefills_per_rank", {}).values())
            except (aiohttp.ClientError, TimeoutError, ValueError):
                count = None
            out.append((round(clock.now(), 3), count))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    clock = Clock(time.monotonic())
    sys.stdout.write(json.dumps({"t0": clock.t0}) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    polls: dict[str, list[Any]] = {pod: [] for pod in args.poll}
    pollers = [asyncio.create_task(poll(clock, p, 0.1, stop, polls[p])) for p in args.poll]
    await asyncio.sleep(0.3)  # every pod's count before the first request
    sent: list[Sent] = []
    budget = [args.requests or -1]
    period = args.clients / args.rate if args.rate else 0.0
    clients = [
        client(clock, args.url, 0.3 + i * period / args.clients, period, args, sent, budget)
        for i in range(args.clients)
    ]
    await asyncio.gather(*clients)
    await asyncio.sleep(0.3)  # the last prefills' counts
    stop.set()
    await asyncio.gather(*pollers)
    return {
        "t0": clock.t0,
        "requests": [asdict(s) for s in sorted(sent, key=lambda s: s.start)],
        "polls": polls,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument(
        "--rate", type=float, default=12.0, help="requests/s of all clients (0: back to back)"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of sending")
    parser.add_argument(
        "--requests", type=int, default=0, help="stop after this many (0: no count)"
    )
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds a request may take")
    parser.add_argument("--poll", action="append", default=[], help="prefill pod HOST:PORT")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    result = asyncio.run(main_async(args))
    with open(args.out, "w") as out:
        json.dump(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
