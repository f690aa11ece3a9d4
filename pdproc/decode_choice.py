"""The decode a pool-mode P/D request goes to, when pdproc picks it (`--decode-choice prefix`):
the one most likely to hold the prompt's prefix in its KV cache, within a load bound, and
whether that decode holds so much of the prompt that a prefill is not worth sending. No I/O.

A decode holds what it received (the prompt, computed there or pulled from a prefill) and
what it generated, so a conversation's next turn finds its history there. pdproc sees the
prompts only, so it remembers the prompt's blocks on the decode it named (the same 256-byte
block keys and bounded-load choice as the prefill pool: pdproc.prefix_affinity); the answer's
own blocks are a bonus the next turn's estimate does not count on. Load is the requests this
process named each decode for and that are still in flight (released when their ext_proc
stream ends).

Envoy carries the choice out (docs/prefix-routing.md): the body answer sets
pdproc.decode_endpoint, and the decode cluster's override_host policy picks that host when
it is one of its own (its least-request fallback otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdproc.pod_load import Claim, PodLoad
from pdproc.prefix_affinity import MAX_PROMPT_BLOCKS, PrefixAffinity, Prompt
from pdproc.targets import HostPort


def skips_pd(matched_blocks: int, prompt_blocks: int, fraction: float) -> bool:
    """Whether a decode predicted to hold `matched_blocks` of a prompt's `prompt_blocks`
    serves it alone (llm-d's decode-first rule): computing the rest there costs less than a
    prefill and a KV transfer. `fraction` 0 or above 1 never skips; a prompt longer than
    the keyed part (MAX_PROMPT_BLOCKS) never does either, since what follows is unknown."""
    if not 0 < fraction <= 1 or prompt_blocks <= 0 or prompt_blocks >= MAX_PROMPT_BLOCKS:
        return False
    return matched_blocks >= fraction * prompt_blocks


@dataclass(frozen=True, slots=True)
class DecodePick:
    """The decode named for one request, the load it holds there until released, and
    whether the prefill is skipped."""

    pod: HostPort
    claim: Claim
    matched_blocks: int
    prompt_blocks: int
    skip_pd: bool
    reason: str  # the affinity's: prefix, home or balance


class DecodePool:
    """The decode members of one process, the blocks named to each, and their load."""

    def __init__(
        self,
        members: Callable[[], Sequence[HostPort]],
        *,
        blocks_per_pod: int,
        balance: float,
        skip_fraction: float,
        on_choice: Callable[[str], None] | None = None,
    ) -> None:
        self._members = members
        self._skip_fraction = skip_fraction
        self._on_choice = on_choice
        self.affinity: PrefixAffinity[HostPort] = PrefixAffinity(blocks_per_pod, balance)
        self.load = PodLoad(_none_launched)
        self._last_members: frozenset[HostPort] = frozenset()

    def choose(self, prompt: Prompt) -> DecodePick | None:
        """The decode for `prompt` (None with no member), recorded as holding the prompt's
        blocks from now on, its load counted until the pick's claim is released."""
        members = self._members()
        self._forget_departed(members)
        choice = self.affinity.choose(prompt, members, self.load)
        if choice is None:
            return None
        blocks = len(prompt.keys)
        skip = skips_pd(choice.matched_blocks, blocks, self._skip_fraction)
        reason = "cached" if skip else choice.reason
        if self._on_choice is not None:
            self._on_choice(reason)
        return DecodePick(
            choice.pod, self.load.claim(choice.pod), choice.matched_blocks, blocks, skip, reason
        )

    def _forget_departed(self, members: Sequence[HostPort]) -> None:
        """Members gone from the pool (DNS no longer lists them) lose their sets."""
        if len(members) == len(self._last_members) and all(
            m in self._last_members for m in members
        ):
            return
        self._last_members = frozenset(members)
        self.affinity.retain(self._last_members)


def _none_launched(_: HostPort) -> int:
    # Nothing but the claims counts: pdproc launches no request to a decode itself.
    return 0
