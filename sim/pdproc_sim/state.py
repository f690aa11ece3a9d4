"""In-memory state shared by the simulated servers: transfers, counters, request records."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

JsonObject = dict[str, Any]

# Strings longer than this are shortened in records of oversized bodies; short fields
# (kv_transfer_params, max_tokens, ids) stay intact, which is what tests inspect.
_RECORD_STRING_KEEP = 256


@dataclass(frozen=True, slots=True)
class TransferResult:
    """What the prefill side knows about one transfer (Mooncake transfer_id, NIXL request id,
    SGLang room) once its prefill finished: who computed the KV, for which prompt, whether it
    is kept for the decode, and (nixlv2) the blocks and request id the decode must name."""

    engine_id: str
    dp_rank: int
    shipped: bool
    prompt_digest: str = ""
    block_ids: tuple[int, ...] = ()
    request_id: str | None = None
    failure: str | None = None

    def to_json(self) -> JsonObject:
        return {
            "engine_id": self.engine_id,
            "dp_rank": self.dp_rank,
            "shipped": self.shipped,
            "prompt_digest": self.prompt_digest,
            "block_ids": list(self.block_ids),
            "request_id": self.request_id,
            "failure": self.failure,
        }

    @classmethod
    def from_json(cls, data: JsonObject) -> TransferResult:
        """The inverse of to_json; KeyError, TypeError or ValueError when malformed."""
        failure = data.get("failure")
        request_id = data.get("request_id")
        return cls(
            engine_id=str(data["engine_id"]),
            dp_rank=int(data["dp_rank"]),
            shipped=bool(data["shipped"]),
            prompt_digest=str(data.get("prompt_digest") or ""),
            block_ids=tuple(int(b) for b in data.get("block_ids") or ()),
            request_id=None if request_id is None else str(request_id),
            failure=None if failure is None else str(failure),
        )


WaitOutcome = TransferResult | str
"""A finished wait: the transfer, or the reason (str) it will never come."""


class TransferRegistry:
    """Finished prefills keyed by transfer_id, plus decodes long-polling for them.

    Finished entries are kept in insertion order so expiry and the size cap are a pop from
    the front: amortised O(1) per insert, no scans.
    """

    def __init__(
        self,
        ttl_s: float,
        cap: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ttl_s = ttl_s
        self._cap = max(1, cap)
        self._clock = clock
        self._done: collections.OrderedDict[str, tuple[float, TransferResult]] = (
            collections.OrderedDict()
        )
        self._waiters: dict[str, set[asyncio.Future[WaitOutcome]]] = {}
        # Waits cut off from their transfer (a restart): they end only at their timeout.
        self._orphans: set[asyncio.Future[WaitOutcome]] = set()

    @property
    def stored(self) -> int:
        return len(self._done)

    @property
    def waiting(self) -> int:
        return sum(len(futures) for futures in self._waiters.values()) + len(self._orphans)

    def complete(self, transfer_id: str, result: TransferResult) -> None:
        now = self._clock()
        self._done.pop(transfer_id, None)
        self._done[transfer_id] = (now, result)
        self._prune(now)
        for future in self._waiters.pop(transfer_id, ()):
            if not future.done():
                future.set_result(result)

    def lookup(self, transfer_id: str) -> TransferResult | None:
        entry = self._done.get(transfer_id)
        if entry is None:
            return None
        stamp, result = entry
        if self._clock() - stamp > self._ttl_s:
            del self._done[transfer_id]
            return None
        return result

    def pop(self, transfer_id: str) -> TransferResult | None:
        """Look up and forget: KV that is read once (NIXL frees the blocks after the read)."""
        found = self.lookup(transfer_id)
        if found is not None:
            del self._done[transfer_id]
        return found

    async def wait(self, transfer_id: str, timeout_s: float) -> WaitOutcome:
        found = self.lookup(transfer_id)
        if found is not None:
            return found
        future: asyncio.Future[WaitOutcome] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(transfer_id, set()).add(future)
        try:
            return await asyncio.wait_for(future, timeout=max(0.0, timeout_s))
        except TimeoutError:
            return "timeout"
        finally:
            self._drop_waiter(transfer_id, future)
            self._orphans.discard(future)

    def forget_all(self, reason: str) -> None:
        """Drop every transfer and end every wait with `reason` (the server shuts down)."""
        self._done.clear()
        waiters, self._waiters = self._waiters, {}
        orphans, self._orphans = self._orphans, set()
        for future in itertools.chain(orphans, *waiters.values()):
            if not future.done():
                future.set_result(reason)

    def orphan_all(self) -> None:
        """Drop every transfer and leave every wait without an answer: what a vLLM Mooncake
        decode sees when its prefill engine dies (its side-channel socket keeps waiting for
        its receive timeout). A wait ends at its own timeout; a shutdown still ends it."""
        self._done.clear()
        waiters, self._waiters = self._waiters, {}
        for futures in waiters.values():
            self._orphans.update(futures)

    def _drop_waiter(self, transfer_id: str, future: asyncio.Future[WaitOutcome]) -> None:
        futures = self._waiters.get(transfer_id)
        if futures is None:
            return
        futures.discard(future)
        if not futures:
            del self._waiters[transfer_id]

    def _prune(self, now: float) -> None:
        done = self._done
        while done:
            stamp, _ = next(iter(done.values()))
            if len(done) <= self._cap and now - stamp <= self._ttl_s:
                return
            done.popitem(last=False)


class RequestLog:
    """Bounded ring buffer of received requests, newest last."""

    def __init__(self, limit: int, max_body_bytes: int) -> None:
        self._records: collections.deque[JsonObject] = collections.deque(maxlen=max(1, limit))
        self._max_body_bytes = max_body_bytes
        self._seq = 0

    @property
    def total(self) -> int:
        return self._seq

    def add(
        self,
        *,
        method: str,
        path: str,
        query: str,
        headers: Mapping[str, str],
        raw_body: bytes,
        body: Any,
    ) -> JsonObject:
        self._seq += 1
        truncated = len(raw_body) > self._max_body_bytes
        record: JsonObject = {
            "seq": self._seq,
            "method": method,
            "path": path,
            "query": query,
            "headers": dict(headers),
            "body": _shorten_strings(body) if truncated else body,
            "body_bytes": len(raw_body),
            "body_truncated": truncated,
            "rank": None,
            "received_at": time.time(),
            "served_at": None,
            "status": None,
            "outcome": None,
        }
        self._records.append(record)
        return record

    def last(self, limit: int | None, path: str | None) -> list[JsonObject]:
        records = [r for r in self._records if path is None or r["path"] == path]
        if limit is not None:
            records = records[-limit:] if limit > 0 else []
        return records

    def clear(self) -> None:
        self._records.clear()


def _shorten_strings(value: Any) -> Any:
    if isinstance(value, str):
        if len(value) <= _RECORD_STRING_KEEP:
            return value
        return f"{value[:_RECORD_STRING_KEEP]}...<truncated, {len(value)} chars>"
    if isinstance(value, dict):
        return {k: _shorten_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shorten_strings(v) for v in value]
    return value


class RoleState:
    """Counters and records every simulated server keeps; roles add their own on top."""

    role = "base"
    # Errors in SGLang's shape (`{"object": "error", ...}`) instead of vLLM's.
    sglang_errors = False

    def __init__(self, record_limit: int, record_max_body_bytes: int) -> None:
        self.log = RequestLog(record_limit, record_max_body_bytes)
        self.requests: dict[str, collections.Counter[str]] = {}
        self.in_flight = 0
        self.cancelled = 0

    def count_response(self, path: str, status: str) -> None:
        counter = self.requests.get(path)
        if counter is None:
            counter = self.requests[path] = collections.Counter()
        counter[status] += 1

    def stats_json(self) -> JsonObject:
        return {
            "role": self.role,
            "in_flight": self.in_flight,
            "cancelled": self.cancelled,
            "requests": {path: dict(c) for path, c in self.requests.items()},
        }

    def reset(self) -> None:
        """Clear records and counters; in_flight is a live gauge, so it stays."""
        self.log.clear()
        self.requests.clear()
        self.cancelled = 0

    def injected_status(self) -> int | None:
        """The error status an injected fault answers this request with, if any."""
        return None

    def faults_json(self) -> JsonObject:
        return {}

    def apply_faults(self, patch: JsonObject) -> None:
        if patch:
            raise ValueError(f"unknown fault fields: {sorted(patch)}")


def fault_status(name: str, value: Any) -> int | None:
    """Validate an injected HTTP status: null (no fault) or an error status."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 400 <= value <= 599:
        raise ValueError(f"{name} must be null or an HTTP status in [400, 599], got {value!r}")
    return value
