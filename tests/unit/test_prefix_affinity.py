"""The prefix-aware choice of a prefill pool member (pdproc.prefix_affinity)."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from pdproc.prefix_affinity import (
    BLOCK_BYTES,
    MAX_PROMPT_BLOCKS,
    MIN_BLOCKS_PER_POD,
    PrefixAffinity,
    Prompt,
    block_keys,
    keys_of,
    prompt_bytes,
)
from pdproc.request_body import parse_body

PODS = ("p0", "p1", "p2", "p3")
SYSTEM = "You are a helpful assistant who answers briefly. " * 30  # ~1.5 KiB


def chat(*turns: tuple[str, str], system: str = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    messages += [{"role": role, "content": text} for role, text in turns]
    return {"model": "m", "messages": messages}


def idle(_: str) -> int:
    return 0


def test_keys_name_whole_prefixes() -> None:
    data = b"a" * BLOCK_BYTES * 3
    keys = block_keys(data)
    assert len(set(keys)) == 3
    assert block_keys(data[: BLOCK_BYTES * 2]) == keys[:2]
    assert block_keys(b"b" + data[1:])[1:] != keys[1:]  # a different start changes all


def test_a_long_prompt_is_keyed_up_to_a_bound() -> None:
    assert len(block_keys(b"x" * BLOCK_BYTES * (MAX_PROMPT_BLOCKS + 10))) == MAX_PROMPT_BLOCKS


def test_roles_models_and_apis_are_part_of_the_prompt() -> None:
    as_user = prompt_bytes({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    as_system = prompt_bytes({"model": "m", "messages": [{"role": "system", "content": "hi"}]})
    other_model = prompt_bytes({"model": "n", "messages": [{"role": "user", "content": "hi"}]})
    as_prompt = prompt_bytes({"model": "m", "prompt": [{"role": "user", "content": "hi"}]})
    assert len({as_user, as_system, other_model, as_prompt}) == 4
    assert b"hello" in prompt_bytes({"prompt": "hello"})
    assert b"hello" in prompt_bytes({"input": [{"role": "user", "content": "hello"}]})
    assert prompt_bytes({"token_ids": [1, 2]}) != prompt_bytes({"token_ids": [2, 1]})


def test_the_clients_own_bytes_are_the_key() -> None:
    """As pdproc parses a body: each member a slice of the client's JSON text."""
    raw = b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}'
    members = parse_body(raw)
    assert prompt_bytes(members).endswith(b'[{"role": "user", "content": "hi"}]')
    # Another request of the same conversation: other sampling fields, same key prefix.
    again = parse_body(raw.replace(b'"max_tokens": 5', b'"stream": true'))
    assert block_keys(prompt_bytes(again)) == block_keys(prompt_bytes(members))


def test_hostile_shapes_give_bytes_not_errors() -> None:
    deep: Any = "x"
    for _ in range(200):
        deep = [deep]
    for body in (
        {"messages": "no"},
        {"messages": [1, None, {"role": 5, "content": {"x": 1}}]},
        {"messages": [{"role": "user", "content": deep}]},
        {"prompt": deep},
        {"model": ["m"], "prompt": True},
        {},
    ):
        assert isinstance(prompt_bytes(body), bytes)


def test_the_next_turn_goes_where_the_conversation_is() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    turn1 = Prompt.of(chat(("user", "What is a KV cache?")))
    first = affinity.choose(turn1, PODS, idle)
    assert first is not None
    turn2 = Prompt.of(
        chat(("user", "What is a KV cache?"), ("assistant", "A cache."), ("user", "Why?"))
    )
    second = affinity.choose(turn2, PODS, idle)
    assert second is not None
    assert second.pod == first.pod
    assert second.reason == "prefix"
    assert second.matched_blocks == len(turn1.keys) - 1  # all but turn 1's partial block


def test_replicas_with_no_shared_state_agree_on_a_new_conversation() -> None:
    for i in range(20):
        prompt = Prompt.of(chat(("user", f"question {i}"), system=f"system prompt {i} " * 20))
        one: PrefixAffinity[str] = PrefixAffinity()
        other: PrefixAffinity[str] = PrefixAffinity()
        a = one.choose(prompt, PODS, idle)
        b = other.choose(prompt, tuple(reversed(PODS)), idle)
        assert a is not None
        assert b is not None
        assert a.pod == b.pod
        assert a.reason == "home"


def test_homes_spread_over_the_pool() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    homes = [
        affinity.home_order(Prompt.of(chat(system=f"system {i} " * 40)), PODS)[0]
        for i in range(200)
    ]
    assert min(homes.count(pod) for pod in PODS) >= 30


def test_a_pod_leaving_moves_only_its_own_prompts() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    prompts = [Prompt.of(chat(system=f"s{i} " * 50)) for i in range(100)]
    before = [affinity.home_order(p, PODS)[0] for p in prompts]
    after = [affinity.home_order(p, PODS[:3])[0] for p in prompts]
    moved = [b for b, a in zip(before, after, strict=True) if b != a]
    assert moved
    assert set(moved) == {"p3"}


def test_a_busy_home_spills_to_the_next_in_home_order() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity(slack=0)
    prompt = Prompt.of(chat(("user", "hi")))
    order = affinity.home_order(prompt, PODS)
    loads = dict.fromkeys(PODS, 1)
    loads[order[0]] = 3
    choice = affinity.choose(prompt, PODS, loads.__getitem__)
    assert choice is not None
    assert choice.pod == order[1]


@given(
    st.lists(st.integers(0, 50), min_size=1, max_size=8),
    st.floats(1.0, 3.0),
    st.integers(0, 3),
    st.lists(st.integers(0, 7), max_size=20),
)
def test_the_choice_never_exceeds_the_load_bound(
    loads: list[int], balance: float, slack: int, history: list[int]
) -> None:
    pods = [f"p{i}" for i in range(len(loads))]
    affinity: PrefixAffinity[str] = PrefixAffinity(balance=balance, slack=slack)
    prompt = Prompt.of(chat(("user", "same question")))
    for index in history:  # whatever pods were believed to hold the prompt
        affinity.record(pods[index % len(pods)], prompt)
    choice = affinity.choose(prompt, pods, dict(zip(pods, loads, strict=True)).__getitem__)
    assert choice is not None
    bound = math.ceil(balance * (sum(loads) + 1) / len(pods)) + slack
    assert loads[pods.index(choice.pod)] + 1 <= bound


@given(st.lists(st.tuples(st.integers(0, 3), st.text(max_size=300)), max_size=40))
def test_memory_per_pod_stays_bounded(records: list[tuple[int, str]]) -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity(blocks_per_pod=5)
    for pod, text in records:
        affinity.record(PODS[pod], Prompt.of({"prompt": text * 7}))
    assert all(count <= 5 for count in affinity.known().values())


def test_reports_of_fewer_cached_tokens_shrink_the_pods_set() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity(blocks_per_pod=1000)
    prompts = [Prompt.of({"prompt": f"{i} " + "x" * 4096}) for i in range(100)]
    for prompt in prompts:
        affinity.record("p0", prompt)
    assert affinity.known()["p0"] == 1000
    predicted = len(prompts[-1].keys)
    affinity.reported("p0", predicted, prompts[-1], cached=0.0)
    assert affinity.known()["p0"] == 500
    for _ in range(20):
        affinity.reported("p0", 2, prompts[-1], cached=0.0)
    assert affinity.known()["p0"] == MIN_BLOCKS_PER_POD
    affinity.reported("p0", 2, prompts[-1], cached=1.0)  # held as predicted: grows back
    affinity.record("p0", prompts[0])
    assert affinity.known()["p0"] == MIN_BLOCKS_PER_POD + 1


def test_forget_and_retain_drop_what_pods_held() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    prompt = Prompt.of(chat(("user", "hi")))
    for pod in PODS:
        affinity.record(pod, prompt)
    affinity.forget("p0")
    affinity.retain(["p1", "p2"])
    assert set(affinity.known()) == {"p1", "p2"}


def test_no_members_no_choice() -> None:
    assert PrefixAffinity[str]().choose(Prompt.of({}), (), idle) is None


@given(st.lists(st.binary(max_size=700), max_size=6))
def test_keys_of_parts_are_the_keys_of_their_bytes(parts: list[bytes]) -> None:
    keys, size = keys_of(parts)
    assert keys == block_keys(b"".join(parts))
    assert size == len(b"".join(parts))


def test_a_prompt_is_keyed_from_views_of_the_body() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}'
    prompt = Prompt.of(parse_body(raw))
    assert prompt.keys == tuple(block_keys(prompt_bytes(parse_body(raw))))
    assert prompt.size == len(prompt_bytes(parse_body(raw)))


def busy(_: str) -> int:
    return 1


def test_a_popular_prompt_on_a_busy_pool_is_spread_by_the_share_bound() -> None:
    # Every pod has one prefill in flight here, so the bound on prefills in flight never
    # bites: only the share of recent picks keeps the prompt's home from getting them all.
    affinity: PrefixAffinity[str] = PrefixAffinity()
    prompt = Prompt.of(chat(("user", "the same question every time")))
    picks = [affinity.choose(prompt, PODS, busy) for _ in range(400)]
    counts = {pod: sum(1 for p in picks if p is not None and p.pod == pod) for pod in PODS}
    mean = 400 / len(PODS)
    assert max(counts.values()) <= 1.25 * mean + 8
    home = affinity.home_order(prompt, PODS)[0]
    assert counts[home] == max(counts.values())  # affinity still prefers the home


def test_the_share_bound_keeps_conversations_where_they_are_when_load_is_even() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    conversations = [chat(system=f"system {i} " * 40) for i in range(40)]
    first = [affinity.choose(Prompt.of(c), PODS, idle) for c in conversations]
    again = [affinity.choose(Prompt.of(c), PODS, idle) for c in conversations]
    stayed = sum(1 for a, b in zip(first, again, strict=True) if a and b and a.pod == b.pod)
    assert stayed >= 36


def test_the_share_bound_still_holds_after_a_long_run() -> None:
    # Past ~22,000 picks the decayed counts are rescaled: the bound must read the same.
    affinity: PrefixAffinity[str] = PrefixAffinity()
    prompt = Prompt.of(chat(("user", "the same question every time")))
    for _ in range(23_000):
        affinity.choose(prompt, PODS, busy)
    picks = [affinity.choose(prompt, PODS, busy) for _ in range(400)]
    counts = [sum(1 for p in picks if p is not None and p.pod == pod) for pod in PODS]
    assert max(counts) <= 1.25 * 100 + 8
    assert min(counts) > 0


def test_one_conversation_on_an_idle_pool_stays_on_its_pod() -> None:
    affinity: PrefixAffinity[str] = PrefixAffinity()
    turns: list[tuple[str, str]] = []
    pods = set()
    for index in range(50):
        turns += [("user", f"question {index}"), ("assistant", f"answer {index}")]
        choice = affinity.choose(Prompt.of(chat(*turns)), PODS, idle)
        assert choice is not None
        pods.add(choice.pod)
    assert len(pods) == 1
