"""The prefix-aware pool policy in service: pdproc.prefix_affinity fed with the pool, the
breakers and the prefills in flight of one process, and told what pods reveal.

The header-time pick (pdproc.picker) names a member before the body is known (the
least-loaded one, whose engine map is prefetched); once the body is in, `refine` may move
the request to the member that likely holds its prompt's prefix. No I/O.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import msgspec

from pdproc.connectors import ClientRequest
from pdproc.prefix_affinity import BLOCK_BYTES, PrefixAffinity, Prompt
from pdproc.targets import HostPort

# Members whose engine map was seen, at most (beyond, the oldest memo is dropped): a DNS
# pool that churns cannot grow this without bound.
_SEEN_CAP = 4096
# Predictions awaiting the prefill's answer, at most (the oldest are dropped beyond).
_PREDICTIONS_CAP = 4096
# A member whose prefill just failed is left out of the prefix choice this long: a
# conversation's home that went silent would otherwise get every turn until its breaker
# opens.
SUSPECT_S = 5.0


class _Details(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: _Details | None = None


class _Answer(msgspec.Struct):
    usage: _Usage | None = None


_ANSWER = msgspec.json.Decoder(_Answer)


@dataclass(frozen=True, slots=True)
class Refined:
    """The member to prefill a request, and what the policy predicted that member holds of
    its prompt (for the prefill's log line, where an operator or a test compares it with
    the cached tokens the pod reports; empty when the header-time pick was kept)."""

    target: HostPort
    facts: Mapping[str, int] = field(default_factory=dict)


def cached_share(answer: bytes) -> float | None:
    """The share of the prompt a prefill's answer says it found cached (vLLM's
    usage.prompt_tokens_details.cached_tokens over usage.prompt_tokens), or None when the
    answer does not say (or says nonsense: a pod's answer may be hostile)."""
    try:
        usage = _ANSWER.decode(answer).usage
    except (msgspec.DecodeError, RecursionError):
        return None
    if usage is None or usage.prompt_tokens_details is None:
        return None
    cached, prompt = usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens
    if cached is None or prompt is None or prompt <= 0 or not 0 <= cached <= prompt:
        return None
    return cached / prompt


class PrefixPool:
    def __init__(
        self,
        members: Callable[[], Sequence[HostPort]],
        *,
        is_open: Callable[[HostPort], bool],
        allow: Callable[[HostPort], bool],
        in_flight: Callable[[HostPort], int],
        blocks_per_pod: int,
        balance: float,
        on_choice: Callable[[str], None] | None = None,
        on_index: Callable[[int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._failed: dict[HostPort, float] = {}
        self._predictions: collections.OrderedDict[str, tuple[HostPort, int, Prompt]] = (
            collections.OrderedDict()
        )
        self._on_choice = on_choice
        self._on_index = on_index
        self._members = members
        self._is_open = is_open
        self._allow = allow
        self._in_flight = in_flight
        self.affinity: PrefixAffinity[HostPort] = PrefixAffinity(blocks_per_pod, balance)
        self._engines: dict[HostPort, Mapping[int, str]] = {}
        self._last_members: frozenset[HostPort] = frozenset()

    def refine(self, request: ClientRequest, provisional: HostPort) -> Refined:
        """The member to prefill this request: the one the affinity names, or `provisional`
        (the header-time pick) when that one cannot be used."""
        members = self._members()
        self._forget_departed(members)
        usable = [m for m in members if not self._is_open(m) and not self._suspect(m)]
        prompt = Prompt.of(request.parsed)
        choice = self.affinity.choose(prompt, usable, self._in_flight)
        if choice is None or (choice.pod != provisional and not self._allow(choice.pod)):
            self._chose("kept")
            return Refined(provisional)
        # (A suspect provisional pick is left for the one the policy named.)
        self._chose(choice.reason)
        if request.request_id:
            # Kept until the prefill's answer says how much the pod found cached.
            predictions = self._predictions
            predictions[request.request_id] = (choice.pod, choice.matched_blocks, prompt)
            if len(predictions) > _PREDICTIONS_CAP:
                predictions.popitem(last=False)
        matched = min(choice.matched_blocks * BLOCK_BYTES, prompt.size)
        facts = {"prefix_matched_bytes": matched, "prefix_prompt_bytes": prompt.size}
        return Refined(choice.pod, facts)

    def answered(self, request_id: str, target: HostPort, answer: bytes | None) -> None:
        """A prefill ended: its answer (when read) tells how much the pod found cached."""
        prediction = self._predictions.pop(request_id, None)
        if prediction is None or answer is None:
            return
        pod, matched, prompt = prediction
        share = cached_share(answer) if pod == target else None
        if share is not None:
            self.affinity.reported(pod, matched, prompt, share)

    def _chose(self, reason: str) -> None:
        if self._on_choice is not None:
            self._on_choice(reason)
        if self._on_index is not None:
            self._on_index(self.affinity.blocks)

    def _forget_departed(self, members: Sequence[HostPort]) -> None:
        """Members gone from the pool (DNS no longer lists them) lose their sets."""
        if len(members) == len(self._last_members) and all(
            m in self._last_members for m in members
        ):
            return
        current = frozenset(members)
        self.affinity.retain(current)
        for gone in [pod for pod in self._engines if pod not in current]:
            del self._engines[gone]
        self._last_members = current

    def engines_seen(self, target: HostPort, engines: Mapping[int, str]) -> None:
        """A pod's engine ids as its bootstrap server lists them: new ids mean a restarted
        engine, whose cache is empty."""
        previous = self._engines.get(target)
        if previous is not None and previous != engines:
            self.affinity.forget(target)
        if previous is None and len(self._engines) >= _SEEN_CAP:
            self._engines.pop(next(iter(self._engines)))
        self._engines[target] = dict(engines)

    def _suspect(self, member: HostPort) -> bool:
        failed = self._failed.get(member)
        if failed is None:
            return False
        if self._clock() - failed < SUSPECT_S:
            return True
        del self._failed[member]
        return False

    def prefill_failed(self, target: HostPort) -> None:
        """The pod failed a prefill (its own fault): not chosen for its cache for a while,
        and what it held is not counted on."""
        if len(self._failed) >= _SEEN_CAP:
            self._failed.clear()
        self._failed[target] = self._clock()
        self.affinity.forget(target)

    def breaker_opened(self, target: HostPort) -> None:
        """A failing pod may come back restarted: what it held is not counted on."""
        self.affinity.forget(target)
