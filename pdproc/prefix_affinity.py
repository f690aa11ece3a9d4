"""Which pool member should prefill a prompt: the one most likely to hold its prefix in its
KV cache, unless that would overload it. Pure logic, no I/O.

The key is the client's own bytes, no tokenizer: the prompt member of the body (chat
messages, a completion's prompt, a response's input, token ids) as the client wrote it, cut
into 256-byte blocks; block i's key is a hash of everything up to the end of block i (one running
hash, so each key names its whole prefix, as an engine's chained block hashes do). Engines
cache 16-token blocks, and 256 bytes is about 64 tokens: a match here is a prefix an engine
that computed it still holds, unless it evicted it.

Per pod an LRU set of the block keys pdproc sent it, bounded in count; a prompt's score on a
pod is how many of its leading blocks that set holds. The choice:

1. Only members whose load (prefills in flight, from the caller) is under a bound relative
   to the mean may be chosen: `load + 1 <= ceil(balance * (total load + 1) / members) +
   slack` (consistent hashing with bounded loads; the slack of one lets a nearly idle pool
   keep its affinity), and whose share of the recent picks (a count that decays over about
   the last 64) is under the same bound unless it is idle: in-flight counts alone stay
   small at modest concurrency, and let one popular prompt's home take most of the
   requests one after the other. Affinity never builds a hot spot.
2. Among those, the lowest estimated wait wins: the prefills queued ahead (each costing the
   recent mean of blocks computed per prefill) plus the blocks the pod must compute (those
   past the longest prefix it holds). Ties go to the prompt's "home" order, a rendezvous
   hash of its first blocks over the member set. Every pdproc process and
   replica computes the same order from the same bytes with no shared state, so a new
   conversation (or a shared system prompt) lands on the same pod whichever replica routes
   it, and spills to the same next pod when that one is full.

What pods report corrects the sets: a prefill that found fewer tokens cached than predicted
shrinks that pod's set (the pod evicts sooner than pdproc forgets); a new engine id, an open
breaker or a member leaving DNS drops the pod's set.
"""

from __future__ import annotations

import collections
import hashlib
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

BLOCK_BYTES = 256
# Blocks of one prompt that are hashed and indexed (1 MiB): the rest of a longer prompt is
# not used for the choice, which bounds the work and memory one request can cost.
MAX_PROMPT_BLOCKS = 4096
# The home is the rendezvous hash of this many leading blocks (or all, when fewer): long
# enough to tell system prompts apart, short enough that a conversation's turns share it.
HOME_BLOCKS = 4
DEFAULT_BLOCKS_PER_POD = 16384  # 4 MiB of prompt text per pod, ~2 MiB of index
DEFAULT_BALANCE = 1.25
DEFAULT_SLACK = 1
# A pod's set never shrinks below this many blocks on feedback.
MIN_BLOCKS_PER_POD = 64
_MASK64 = (1 << 64) - 1
_WORK_WEIGHT = 0.05
# Each pick multiplies every member's count of recent picks by this: the counts cover
# about the last 1 / (1 - decay) picks (64), a window short enough to follow a shift in
# popularity and long enough that one burst does not decide it.
_SHARE_DECAY = 1 - 1 / 64
# Below this many recent picks a pod is never held back by its share: a pool that has seen
# only a few requests keeps their affinity.
_SHARE_FLOOR = 4.0

Pod = TypeVar("Pod", bound=Hashable)


_PROMPT_FIELDS = ("messages", "prompt", "input", "token_ids")


def _member_bytes(value: Any, limit: int) -> bytes | memoryview:
    """A body member's bytes, at most `limit`: the client's own JSON text when the body was
    parsed lazily (msgspec.Raw, as pdproc parses it), else a canonical JSON encoding."""
    if isinstance(value, msgspec.Raw | bytes | bytearray | memoryview):
        return memoryview(value)[:limit]
    try:
        return msgspec.json.encode(value)[:limit]
    except (TypeError, ValueError, RecursionError):
        return b""


def prompt_parts(body: Mapping[str, Any]) -> list[bytes | memoryview]:
    """The model and the prompt member of an OpenAI-style body (or vLLM's
    /inference/v1/generate) as the client wrote them, as views of the body (a long prompt
    is not copied): a conversation's next turn repeats the previous turn's messages, so its
    bytes start with theirs. Engines serving other models share no cache, so the model
    comes first."""
    limit = MAX_PROMPT_BLOCKS * BLOCK_BYTES
    model = body.get("model")
    parts = [_member_bytes(model, 256) if model is not None else b"", b"\x1e"]
    for name in _PROMPT_FIELDS:
        if name in body:
            parts.append(name.encode())
            parts.append(_member_bytes(body[name], limit))
            break
    return parts


def prompt_bytes(body: Mapping[str, Any]) -> bytes:
    """prompt_parts joined."""
    return b"".join(prompt_parts(body))


def keys_of(parts: Sequence[bytes | memoryview]) -> tuple[list[int], int]:
    """The prefix keys of the parts' bytes taken together, cut into 256-byte blocks (the
    partial last one included; a key per block: the hash of all bytes up to its end), and
    how many bytes were keyed (at most MAX_PROMPT_BLOCKS blocks)."""
    hasher = hashlib.blake2b(digest_size=8)
    keys: list[int] = []
    room = BLOCK_BYTES
    size = 0
    limit = MAX_PROMPT_BLOCKS * BLOCK_BYTES
    for part in parts:
        view = memoryview(part)[: limit - size]
        size += len(view)
        while view:
            piece = view[:room]
            hasher.update(piece)
            room -= len(piece)
            view = view[len(piece) :]
            if not room:
                keys.append(int.from_bytes(hasher.digest(), "little"))
                room = BLOCK_BYTES
    if room != BLOCK_BYTES:
        keys.append(int.from_bytes(hasher.digest(), "little"))
    return keys, size


def block_keys(data: bytes | memoryview) -> list[int]:
    """The prefix keys of one byte string."""
    return keys_of([data])[0]


def _mix(value: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit mix."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK64
    return value ^ (value >> 31)


def pod_seed(pod: object) -> int:
    """A pod's stable 64-bit identity for rendezvous hashing (the same in every process:
    Python's own hash() of a string is salted per process)."""
    return int.from_bytes(hashlib.blake2b(str(pod).encode(), digest_size=8).digest(), "little")


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's keys, computed once per request."""

    keys: tuple[int, ...]
    size: int  # bytes of the rendered prompt

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> Prompt:
        keys, size = keys_of(prompt_parts(body))
        return cls(tuple(keys), size)

    @property
    def home_key(self) -> int:
        keys = self.keys
        return keys[min(len(keys), HOME_BLOCKS) - 1] if keys else 0


@dataclass(frozen=True, slots=True)
class Choice(Generic[Pod]):
    pod: Pod
    matched_blocks: int  # leading blocks the pod was predicted to hold
    # "prefix" (a cached prefix won), "home", or "balance" (no member was under both bounds:
    # the load in flight decided)
    reason: str


class _PodBlocks:
    """The block keys sent to one pod, least recently used first, and how many to keep."""

    __slots__ = ("blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        self.blocks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.capacity = capacity

    def matched(self, keys: Sequence[int]) -> int:
        blocks = self.blocks
        count = 0
        for key in keys:
            if key not in blocks:
                break
            count += 1
        return count

    def add(self, keys: Sequence[int]) -> None:
        blocks = self.blocks
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        self._trim()

    def _trim(self) -> None:
        blocks = self.blocks
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def shrink(self, fraction: float) -> None:
        self.capacity = max(MIN_BLOCKS_PER_POD, int(self.capacity * fraction))
        self._trim()


class PrefixAffinity(Generic[Pod]):
    """The per-pod block sets of one pdproc process, and the choice over them."""

    def __init__(
        self,
        blocks_per_pod: int = DEFAULT_BLOCKS_PER_POD,
        balance: float = DEFAULT_BALANCE,
        slack: int = DEFAULT_SLACK,
    ) -> None:
        if blocks_per_pod < 1:
            raise ValueError("blocks_per_pod must be >= 1")
        if balance < 1:
            raise ValueError("balance must be >= 1")
        self.blocks_per_pod = blocks_per_pod
        self.balance = balance
        self.slack = max(0, slack)
        self._pods: dict[Pod, _PodBlocks] = {}
        # The recent mean of blocks a chosen pod had to compute (an exponential average):
        # what one prefill queued ahead costs.
        self._work = 1.0
        self._seeds: dict[Pod, int] = {}
        # Recent picks per pod, for the share bound, kept in units that grow by 1 / decay
        # each pick (so no pick has to decay every pod's count): a pod's decayed count is
        # its entry / self._unit.
        self._recent: dict[Pod, float] = {}
        self._unit = 1.0

    def _seed(self, pod: Pod) -> int:
        seed = self._seeds.get(pod)
        if seed is None:
            if len(self._seeds) > 4 * max(16, len(self._pods)):
                self._seeds.clear()  # pods come and go with DNS: keep the memo bounded
            seed = self._seeds[pod] = pod_seed(pod)
        return seed

    def home_order(self, prompt: Prompt, members: Sequence[Pod]) -> list[Pod]:
        """The members in the prompt's rendezvous order (highest score first)."""
        home = prompt.home_key
        return sorted(members, key=lambda pod: _mix(home ^ self._seed(pod)), reverse=True)

    def choose(
        self,
        prompt: Prompt,
        members: Sequence[Pod],
        load: Callable[[Pod], int],
    ) -> Choice[Pod] | None:
        """The member to prefill `prompt` (None when there is none), recorded as holding
        the prompt's blocks from now on. `members` are those the caller may use (breakers
        closed); `load` their prefills in flight."""
        if not members:
            return None
        eligible, reason = self._eligible(members, [load(pod) for pod in members])
        best, best_matched = self._cheapest(prompt, eligible)
        self._work += (len(prompt.keys) - best_matched - self._work) * _WORK_WEIGHT
        self._count_pick(best)
        self.record(best, prompt)
        return Choice(best, best_matched, reason or ("prefix" if best_matched else "home"))

    def _eligible(
        self, members: Sequence[Pod], loads: list[int]
    ) -> tuple[list[tuple[Pod, int]], str]:
        """The members under both bounds, with their loads; when none is, those under the
        bound in flight, and the reason "balance"."""
        bound = math.ceil(self.balance * (sum(loads) + 1) / len(members)) + self.slack
        recent, unit = self._recent, self._unit
        shares = [recent.get(pod, 0.0) / unit for pod in members]
        share_bound = max(self.balance * (sum(shares) + 1) / len(members), _SHARE_FLOOR)
        eligible = [
            (pod, pod_load)
            for pod, pod_load, share in zip(members, loads, shares, strict=True)
            # An idle pod is never held back by its share: spreading a lone stream of
            # requests over idle pods would only throw their cache hits away.
            if pod_load + 1 <= bound and (share + 1 <= share_bound or not pod_load)
        ]
        if eligible:
            return eligible, ""
        # The two bounds can exclude every member (the least loaded now is not the least
        # picked lately): the load in flight decides then, as it is what the prefill waits
        # for (the least loaded member is always under its bound).
        fallback = [(pod, n) for pod, n in zip(members, loads, strict=True) if n + 1 <= bound]
        least = min(range(len(members)), key=loads.__getitem__)
        return fallback or [(members[least], loads[least])], "balance"

    def _cheapest(self, prompt: Prompt, eligible: Sequence[tuple[Pod, int]]) -> tuple[Pod, int]:
        """The eligible pod with the lowest estimated wait, and its matched blocks; ties go
        to the prompt's home order."""
        best, _ = eligible[0]
        best_matched = 0
        best_cost = math.inf
        best_score = -1
        home = prompt.home_key
        keys = prompt.keys
        work = self._work
        for pod, pod_load in eligible:
            blocks = self._pods.get(pod)
            matched = blocks.matched(keys) if blocks is not None else 0
            # What the prefill waits for there: the queue ahead (at the recent mean work of
            # a prefill), then the blocks it must compute.
            cost = pod_load * work + len(keys) - matched
            score = _mix(home ^ self._seed(pod))
            if cost < best_cost or (cost == best_cost and score > best_score):
                best, best_matched, best_cost, best_score = pod, matched, cost, score
        return best, best_matched

    def _count_pick(self, pod: Pod) -> None:
        """One more recent pick for `pod`, every older one weighing a little less."""
        recent = self._recent
        self._unit /= _SHARE_DECAY
        recent[pod] = recent.get(pod, 0.0) + self._unit
        if self._unit > 1e150:  # rescale long before a float overflows
            for other in recent:
                recent[other] /= self._unit
            self._unit = 1.0

    def record(self, pod: Pod, prompt: Prompt) -> None:
        """The pod computes (or finds) the prompt's blocks: they are its most recent now."""
        blocks = self._pods.get(pod)
        if blocks is None:
            blocks = self._pods[pod] = _PodBlocks(self.blocks_per_pod)
        blocks.add(prompt.keys)

    def reported(self, pod: Pod, predicted_blocks: int, prompt: Prompt, cached: float) -> None:
        """The pod answered that `cached` (a fraction of the prompt, 0..1) was in its cache
        when pdproc predicted `predicted_blocks` leading blocks: a shortfall of more than a
        block means the pod evicts what pdproc still remembers, so its set shrinks."""
        blocks = self._pods.get(pod)
        if blocks is None or not prompt.keys:
            return
        found_blocks = cached * prompt.size / BLOCK_BYTES
        if found_blocks + 1 < predicted_blocks:
            blocks.shrink(max(0.5, found_blocks / predicted_blocks))
        elif blocks.capacity < self.blocks_per_pod:
            blocks.capacity += 1  # predictions hold: let the set grow back slowly

    def forget(self, pod: Pod) -> None:
        """Drop what pdproc believed the pod holds (it restarted, failed or left)."""
        self._pods.pop(pod, None)

    def retain(self, members: Sequence[Pod] | frozenset[Pod]) -> None:
        """Keep the sets of these pods only (the others left the pool)."""
        keep = set(members)
        for pod in [pod for pod in self._pods if pod not in keep]:
            del self._pods[pod]
        for pod in [pod for pod in self._recent if pod not in keep]:
            del self._recent[pod]

    def known(self) -> Mapping[Pod, int]:
        """Blocks remembered per pod."""
        return {pod: len(blocks.blocks) for pod, blocks in self._pods.items()}

    @property
    def blocks(self) -> int:
        return sum(len(blocks.blocks) for blocks in self._pods.values())
