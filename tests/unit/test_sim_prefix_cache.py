"""The simulator's prefix cache: vLLM's chained full blocks and LRU, the cached tokens its
answers report, and the vLLM-named metrics it serves (pdproc_sim.prefix_cache)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from pdproc_sim import DecodeConfig, PrefillConfig, RunningDecode, RunningPrefill, start_pair
from pdproc_sim.openai_shapes import Api
from pdproc_sim.prefix_cache import (
    BLOCK_CHARS,
    BLOCK_TOKENS,
    PrefixCache,
    block_hashes,
    rendered_prompt,
)
from prometheus_client.parser import text_string_to_metric_families

CHAT = "/v1/chat/completions"
SYSTEM = "You are a careful assistant. " * 40  # ~1,100 characters, 17 full blocks


def samples(page: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples `name` of a Prometheus page, as (labels, value)."""
    return [
        (sample.labels, sample.value)
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name
    ]


def test_hashes_chain_so_equal_blocks_at_different_places_differ() -> None:
    block = "x" * BLOCK_CHARS
    hashes = block_hashes(block * 3)
    assert len(set(hashes)) == 3
    assert block_hashes(block * 2) == hashes[:2]
    assert block_hashes(block * 3 + "tail") == hashes  # a partial block is not cached


@given(st.text(max_size=600), st.text(max_size=600))
def test_a_shared_prefix_shares_exactly_its_full_blocks(common: str, rest: str) -> None:
    left, right = block_hashes(common + "a" + rest), block_hashes(common + "b" + rest)
    shared = len(common) // BLOCK_CHARS
    assert left[:shared] == right[:shared]
    if len(left) > shared and len(right) > shared:
        assert left[shared] != right[shared]


def test_lru_evicts_the_least_recently_used_block() -> None:
    cache = PrefixCache(capacity_blocks=2)
    a, b = block_hashes("a" * BLOCK_CHARS), block_hashes("b" * BLOCK_CHARS)
    cache.store(a)
    cache.store(b)
    assert cache.lookup(a, 100).cached_blocks == 1  # a lookup alone does not refresh
    cache.store(a)  # computing it again does
    c = block_hashes("c" * BLOCK_CHARS)
    cache.store(c)
    assert cache.lookup(b, 100).cached_blocks == 0
    assert cache.lookup(a, 100).cached_blocks == 1
    assert cache.used == 2
    assert cache.usage == 1.0


def test_a_hit_stops_at_the_first_missing_block_and_leaves_the_last_token() -> None:
    cache = PrefixCache(capacity_blocks=100)
    hashes = block_hashes("q" * BLOCK_CHARS * 4)
    cache.store(hashes[:2])
    assert cache.lookup(hashes, 4 * BLOCK_TOKENS).cached_tokens == 2 * BLOCK_TOKENS
    cache.store(hashes)
    # vLLM recomputes a fully cached prompt's last block for its logits.
    assert cache.lookup(hashes, 4 * BLOCK_TOKENS).cached_tokens == 3 * BLOCK_TOKENS


def test_a_chat_prompt_renders_so_the_next_turn_extends_it() -> None:
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    first = rendered_prompt(Api.CHAT, {"messages": turn})
    reply = "a reply"
    second = rendered_prompt(
        Api.CHAT,
        {
            "messages": [
                *turn,
                {"role": "assistant", "content": reply},
                {"role": "user", "content": "more"},
            ]
        },
    )
    assert second.startswith(first + reply)


@pytest_asyncio.fixture
async def cached_pair() -> AsyncIterator[tuple[RunningPrefill, RunningDecode]]:
    prefill, decode = await start_pair(
        PrefillConfig(engine_id_prefix="eng", prefix_cache_blocks=64, rank_concurrency=1),
        DecodeConfig(kv_timeout_s=5, prefix_cache_blocks=64),
    )
    yield prefill, decode
    await decode.close()
    await prefill.close()


def _chat(user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, **extra}


def _cached(answer: httpx.Response) -> int:
    details = answer.json()["usage"]["prompt_tokens_details"]
    assert isinstance(details, dict)
    value = details["cached_tokens"]
    assert isinstance(value, int)
    return value


async def test_answers_report_cached_tokens_and_metrics_count_them(
    cached_pair: tuple[RunningPrefill, RunningDecode],
) -> None:
    prefill, _ = cached_pair
    async with httpx.AsyncClient(timeout=10) as client:
        first = await client.post(prefill.url + CHAT, json=_chat("one"))
        second = await client.post(prefill.url + CHAT, json=_chat("two"))
        page = (await client.get(prefill.url + "/metrics")).text
    assert _cached(first) == 0
    shared_blocks = (len("<|system|>") + len(SYSTEM)) // BLOCK_CHARS
    assert _cached(second) == shared_blocks * BLOCK_TOKENS
    by_source = {
        labels["source"]: value
        for labels, value in samples(page, "vllm:prompt_tokens_by_source_total")
    }
    prompt_total = first.json()["usage"]["prompt_tokens"] + second.json()["usage"]["prompt_tokens"]
    assert by_source["local_cache_hit"] == _cached(second)
    assert by_source["local_compute"] + by_source["local_cache_hit"] == prompt_total
    assert by_source["external_kv_transfer"] == 0
    usage = [value for _, value in samples(page, "vllm:kv_cache_usage_perc")]
    assert usage
    assert 0 < usage[0] <= 1


async def test_a_restart_empties_the_cache(
    cached_pair: tuple[RunningPrefill, RunningDecode],
) -> None:
    prefill, _ = cached_pair
    async with httpx.AsyncClient(timeout=10) as client:
        await client.post(prefill.url + CHAT, json=_chat("one"))
        await client.post(prefill.url + "/sim/restart")
        again = await client.post(prefill.url + CHAT, json=_chat("one"))
    assert _cached(again) == 0


async def test_one_rank_computes_one_prefill_at_a_time_the_rest_wait() -> None:
    prefill, decode = await start_pair(
        PrefillConfig(prefix_cache_blocks=8, rank_concurrency=1, prefill_ms_per_token=2),
        DecodeConfig(),
    )
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            posts = [
                asyncio.create_task(client.post(prefill.url + CHAT, json=_chat(f"u{i}")))
                for i in range(3)
            ]
            seen_waiting = 0.0
            while not all(p.done() for p in posts):
                page = (await client.get(prefill.url + "/metrics")).text
                waiting = sum(v for _, v in samples(page, "vllm:num_requests_waiting"))
                running = sum(v for _, v in samples(page, "vllm:num_requests_running"))
                assert running <= 1
                seen_waiting = max(seen_waiting, waiting)
                await asyncio.sleep(0.01)
            assert all(p.result().status_code == 200 for p in posts)
        assert seen_waiting >= 1
    finally:
        await decode.close()
        await prefill.close()


async def test_a_decode_caches_what_it_received_and_generated(
    cached_pair: tuple[RunningPrefill, RunningDecode],
) -> None:
    prefill, decode = cached_pair
    kv = {"do_remote_prefill": False, "do_remote_decode": True, "transfer_id": "t1"}
    first = _chat("one", max_tokens=1, kv_transfer_params=kv)
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.post(prefill.url + CHAT, json=first)).status_code == 200
        decode_kv = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "transfer_id": "t1",
            "remote_bootstrap_addr": prefill.bootstrap_url,
            "remote_engine_id": "eng_dp0",
        }
        answer = await client.post(
            decode.url + CHAT, json=_chat("one", max_tokens=40, kv_transfer_params=decode_kv)
        )
        assert answer.status_code == 200
        reply = answer.json()["choices"][0]["message"]["content"]
        # The next turn, served by this decode alone, finds the prompt and the reply cached.
        turn = _chat("one")
        turn["messages"] += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "next"},
        ]
        alone = await client.post(decode.url + CHAT, json=turn)
        page = (await client.get(decode.url + "/metrics")).text
    rendered_before = len(rendered_prompt(Api.CHAT, _chat("one"))) + len(reply)
    assert _cached(alone) == rendered_before // BLOCK_CHARS * BLOCK_TOKENS
    by_source = {
        labels["source"]: value
        for labels, value in samples(page, "vllm:prompt_tokens_by_source_total")
    }
    assert by_source["external_kv_transfer"] == answer.json()["usage"]["prompt_tokens"]
    assert by_source["local_cache_hit"] == _cached(alone)
