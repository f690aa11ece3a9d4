"""The decode choice (pdproc.decode_choice): a conversation's next turn goes to the decode that
got its earlier turns, skips P/D when that decode holds most of its prompt, spreads when one
decode would be overloaded, and never names a decode that left the pool."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from pdproc.config import DecodeChoice, Settings
from pdproc.decode_choice import DecodePool, skips_pd
from pdproc.discovery import DnsPool
from pdproc.prefix_affinity import BLOCK_BYTES, MAX_PROMPT_BLOCKS, Prompt
from pdproc.targets import HostPort

DECODES = [HostPort("10.0.0.1", 8200), HostPort("10.0.0.2", 8200), HostPort("10.0.0.3", 8200)]
SYSTEM = "You are a careful assistant. " * 200  # ~5.8 KB: 23 blocks


def chat(*contents: str) -> Prompt:
    messages = [
        {"role": "user" if i % 2 else "system", "content": c} for i, c in enumerate(contents)
    ]
    body: dict[str, Any] = {"model": "m", "messages": messages}
    return Prompt.of(body)


def pool(
    members: Sequence[HostPort] = DECODES, fraction: float = 0.8, seen: list[str] | None = None
) -> DecodePool:
    return DecodePool(
        lambda: members,
        blocks_per_pod=4096,
        balance=1.25,
        skip_fraction=fraction,
        on_choice=None if seen is None else seen.append,
    )


@pytest.mark.parametrize(
    ("matched", "blocks", "fraction", "skips"),
    [
        (8, 10, 0.8, True),
        (7, 10, 0.8, False),
        (10, 10, 1.0, True),
        (9, 10, 1.0, False),
        (10, 10, 0.0, False),  # 0: never
        (10, 10, 1.5, False),  # above 1: never
        (0, 0, 0.8, False),  # no prompt
        (MAX_PROMPT_BLOCKS, MAX_PROMPT_BLOCKS, 0.8, False),  # the rest of it is unknown
    ],
)
def test_skips_pd(matched: int, blocks: int, fraction: float, skips: bool) -> None:
    assert skips_pd(matched, blocks, fraction) is skips


def test_the_next_turn_goes_to_the_same_decode_and_skips_pd() -> None:
    seen: list[str] = []
    decodes = pool(seen=seen)
    first = decodes.choose(chat(SYSTEM, "question one"))
    assert first is not None
    assert not first.skip_pd  # nothing was held anywhere
    first.claim.release()
    second = decodes.choose(chat(SYSTEM, "question one", "an answer", "question two"))
    assert second is not None
    assert second.pod == first.pod
    assert second.matched_blocks >= second.prompt_blocks - 2
    assert second.skip_pd
    assert seen == ["home", "cached"]


def test_a_prefix_below_the_fraction_is_p_d_on_the_decode_holding_it() -> None:
    seen: list[str] = []
    decodes = pool(seen=seen)
    first = decodes.choose(chat(SYSTEM, "q"))
    assert first is not None
    first.claim.release()
    # A question as long as the system prompt: about half the prompt is held.
    second = decodes.choose(chat(SYSTEM, "q", "a", "x" * len(SYSTEM)))
    assert second is not None
    assert second.pod == first.pod
    assert 0 < second.matched_blocks < 0.8 * second.prompt_blocks
    assert not second.skip_pd
    assert seen == ["home", "prefix"]


def test_load_in_flight_spreads_a_hot_prompt() -> None:
    """Requests still in flight count against their decode: the same prompt sent many
    times at once does not all go to the one decode that holds it."""
    decodes = pool()
    prompt = chat(SYSTEM, "the same question")
    picks = [decodes.choose(prompt) for _ in range(9)]
    chosen = [pick.pod for pick in picks if pick is not None]
    assert len(chosen) == 9
    assert len(set(chosen)) >= 2
    # The bound: load + 1 <= ceil(1.25 * (total + 1) / members) + 1, at most 5 here.
    assert max(chosen.count(pod) for pod in DECODES) <= 5
    for pick in picks:
        assert pick is not None
        pick.claim.release()
    assert all(decodes.load(pod) == 0 for pod in DECODES)


def test_no_member_no_pick() -> None:
    assert pool(members=[]).choose(chat("hello")) is None


def test_a_decode_that_leaves_dns_is_not_named_and_loses_its_set() -> None:
    """Members from a real DnsPool (its resolver stubbed): the decode a conversation lives on
    leaves the answer, the next turn goes elsewhere, and coming back it holds nothing."""
    answers: dict[str, list[str]] = {"decode.svc": ["10.0.0.1", "10.0.0.2"]}

    async def resolver(name: str, port: int) -> list[str]:
        return list(answers[name])

    async def scenario() -> None:
        dns = DnsPool([HostPort("decode.svc", 8200)], 1.0, resolver)
        await dns.refresh()
        decodes = DecodePool(
            lambda: dns.members, blocks_per_pod=4096, balance=1.25, skip_fraction=0.8
        )
        first = decodes.choose(chat(SYSTEM, "q1"))
        assert first is not None
        first.claim.release()
        home = first.pod
        assert decodes.affinity.known()[home] > 0
        answers["decode.svc"] = [m.host for m in dns.members if m != home]
        await dns.refresh()
        second = decodes.choose(chat(SYSTEM, "q1", "a1", "q2"))
        assert second is not None
        assert second.pod != home
        assert not second.skip_pd  # the new decode holds nothing of it
        assert home not in decodes.affinity.known()
        second.claim.release()
        answers["decode.svc"] = ["10.0.0.1", "10.0.0.2"]
        await dns.refresh()
        third = decodes.choose(chat(SYSTEM, "q1", "a1", "q2", "a2", "q3"))
        assert third is not None
        assert third.pod == second.pod  # the one that holds it now

    asyncio.run(scenario())


def test_blocks_are_prompt_bytes() -> None:
    prompt = chat(SYSTEM)
    assert len(prompt.keys) == -(-prompt.size // BLOCK_BYTES)


def test_the_choice_needs_decodes_to_name() -> None:
    with pytest.raises(ValueError, match="--decode-choice prefix needs"):
        Settings(decode_choice=DecodeChoice.PREFIX)
    Settings(decode_choice=DecodeChoice.PREFIX, decode_dns=(HostPort("decode.svc", 8200),))
