"""Pool mode's prefix policy through Envoy: three simulated prefill pods with prefix caches,
multi-turn conversations; each conversation stays on one pod (which then finds its earlier
turns cached), conversations spread over the pool, and two pdproc replicas with no shared
state agree on where a conversation goes."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from pdproc_sim.devstack import Envoy, scrape_metric, start_envoy, start_pdproc
from pdproc_sim.poolstack import SimPool, running_pool
from prometheus_client.parser import text_string_to_metric_families

from pdproc.prefix_affinity import MIN_BLOCKS_PER_POD
from pdproc.targets import HostPort

pytestmark = pytest.mark.e2e

CACHE = ("--prefix-cache-blocks", "512")
SYSTEM = "You answer questions about gardening with care and precision. " * 30


@contextlib.contextmanager
def pool_front(
    workdir: Path,
    pool: SimPool,
    replicas: int = 1,
    args: Sequence[str] = (),
    metrics: list[HostPort] | None = None,
) -> Iterator[Envoy]:
    """pdproc replica(s) with the pool as static members, behind one Envoy; their metrics
    addresses go to `metrics`."""
    procs = []
    addrs: list[HostPort] = []
    try:
        for index in range(replicas):
            argv = ["--prefill-allow", "127.0.0.0/8"]
            argv += ["--mooncake-bootstrap-port", str(pool.bootstrap_port), *args]
            for member in pool.prefills:
                argv += ["--prefill", str(member)]
            proc, addr, metrics_addr = start_pdproc(workdir, argv, name=f"pdproc{index}")
            procs.append(proc)
            addrs.append(addr)
            if metrics is not None:
                metrics.append(metrics_addr)
        envoy = start_envoy(workdir, pool.decodes, addrs)
        procs.append(envoy.process)
        yield envoy
    finally:
        for proc in reversed(procs):
            proc.stop()


def conversation_turns(
    client: httpx.Client, url: str, name: str, turns: int, system: str = SYSTEM
) -> None:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{name}: question {turn} " * 8})
        body = {"model": "m", "messages": messages, "max_tokens": 8}
        response = client.post(url + "/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        messages.append(
            {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
        )


def served_by(pool: SimPool) -> dict[str, set[int]]:
    """Conversation name -> the prefill pods that served its turns."""
    out: dict[str, set[int]] = {}
    for index, member in enumerate(pool.prefills):
        records = httpx.get(member.url() + "/sim/requests", timeout=10).json()["requests"]
        for record in records:
            text = record["body"]["messages"][1]["content"]
            out.setdefault(text.split(":")[0], set()).add(index)
    return out


def cache_hits(pool: SimPool) -> float:
    total = 0.0
    for member in pool.prefills:
        page = httpx.get(member.url() + "/metrics", timeout=10).text
        for family in text_string_to_metric_families(page):
            for sample in family.samples:
                if sample.labels.get("source") == "local_cache_hit":
                    total += sample.value
    return total


def test_conversations_stick_to_a_pod_and_spread_over_the_pool(tmp_path: Path) -> None:
    metrics: list[HostPort] = []
    with (
        running_pool(tmp_path, 3, prefill_args=CACHE, decode_args=CACHE) as pool,
        pool_front(tmp_path, pool, metrics=metrics) as envoy,
        httpx.Client(timeout=30) as client,
    ):
        names = [f"conv{i}" for i in range(12)]
        for index, name in enumerate(names):
            # Six system prompts, two conversations each: homes differ by system prompt.
            system = f"{index % 6} {SYSTEM}"
            conversation_turns(client, envoy.url, name, 3, system)
        where = served_by(pool)
        assert set(where) == set(names)
        assert all(len(pods) == 1 for pods in where.values()), where
        assert len({next(iter(pods)) for pods in where.values()}) >= 2, where
        # Every later turn found at least the system prompt and the earlier turns cached.
        assert cache_hits(pool) >= 12 * 2 * len(SYSTEM) // 4 * 0.9
        # Every later turn was a prefix choice, every first turn a home one.
        choices = "pdproc_pool_choices_total"
        assert scrape_metric(metrics[0], choices, reason="prefix") >= 12 * 2
        assert scrape_metric(metrics[0], choices, reason="home") >= 6
        assert scrape_metric(metrics[0], "pdproc_prefix_index_blocks") > 0


def test_replicas_agree_without_shared_state(tmp_path: Path) -> None:
    """Two pdproc replicas behind one Envoy: whichever one gets a turn sends it to the
    conversation's pod (its rendezvous home, the same in both)."""
    with (
        running_pool(tmp_path, 3, prefill_args=CACHE) as pool,
        pool_front(tmp_path, pool, replicas=2) as envoy,
        httpx.Client(timeout=30) as client,
    ):
        for i in range(8):
            conversation_turns(client, envoy.url, f"conv{i}", 3)
        where = served_by(pool)
        assert len(where) == 8
        assert all(len(pods) == 1 for pods in where.values()), where


def test_the_prefill_log_line_says_what_the_policy_predicted(tmp_path: Path) -> None:
    """Each prefill's log line carries the bytes of the prompt the policy predicted its pod
    holds: nothing for a conversation's first turn, then every earlier turn (the real-engine
    suite compares these with what the engines report)."""
    with (
        running_pool(tmp_path, 2, prefill_args=CACHE) as pool,
        pool_front(tmp_path, pool) as envoy,
        httpx.Client(timeout=30) as client,
    ):
        conversation_turns(client, envoy.url, "conv0", 3)
        lines = prefilled_lines(tmp_path / "pdproc0.log", 3)
    predicted = [(line["prefix_matched_bytes"], line["prefix_prompt_bytes"]) for line in lines]
    assert predicted[0][0] == 0, predicted
    for (_, before), (matched, size) in itertools.pairwise(predicted):
        # The earlier turn's prompt (all but its last, partial block) is known to be there.
        assert before - 256 < matched < size, predicted


def prefilled_lines(log: Path, count: int) -> list[dict[str, Any]]:
    """The first `count` "pd request prefilled" lines of a pdproc log (they are written
    when each prefill's status line comes, before its answer reaches the client)."""
    lines = [
        orjson.loads(line)
        for line in log.read_text().splitlines()
        if line.startswith("{") and '"pd request prefilled"' in line
    ]
    assert len(lines) == count, lines
    return lines


def test_least_loaded_restores_the_old_choice(tmp_path: Path) -> None:
    """--pool-policy least-loaded: one request at a time finds every member idle, and equal
    members take turns, whatever each holds: a conversation's turns land on other pods."""
    with (
        running_pool(tmp_path, 3, prefill_args=CACHE) as pool,
        pool_front(tmp_path, pool, args=["--pool-policy", "least-loaded"]) as envoy,
        httpx.Client(timeout=30) as client,
    ):
        for i in range(4):
            conversation_turns(client, envoy.url, f"conv{i}", 2)
        where = served_by(pool)
        assert any(len(pods) > 1 for pods in where.values()), where
        assert set().union(*where.values()) == {0, 1, 2}


def test_nixl_pool_reads_the_cached_tokens_each_prefill_reports(tmp_path: Path) -> None:
    """NIXL v2: pdproc reads each prefill's answer, so the pods' own count of cached tokens
    reaches the policy; conversations still stick, and the pods found their turns cached."""
    nixl = ("--kv-connector", "nixlv2")
    with (
        running_pool(tmp_path, 3, prefill_args=(*CACHE, *nixl), decode_args=nixl) as pool,
        pool_front(tmp_path, pool, args=nixl) as envoy,
        httpx.Client(timeout=30) as client,
    ):
        for i in range(6):
            conversation_turns(client, envoy.url, f"conv{i}", 3, f"{i} {SYSTEM}")
        where = served_by(pool)
        assert all(len(pods) == 1 for pods in where.values()), where
        assert cache_hits(pool) >= 6 * 2 * len(SYSTEM) // 4 * 0.9


@pytest.mark.parametrize("connector", ["mooncake", "nixlv2"])
def test_pods_that_evict_sooner_shrink_what_pdproc_remembers(
    tmp_path: Path, connector: str
) -> None:
    """Pods whose prefix cache holds almost nothing answer with few cached tokens: for
    every connector (Mooncake's answer is read after its status line, NIXL's whole), that
    reaches the policy, whose per-pod sets shrink to what such pods keep instead of
    remembering every block routed to them. Pods with room keep what was routed."""
    args = ("--kv-connector", connector)

    def remembered(cache_blocks: str) -> float:
        metrics: list[HostPort] = []
        prefill_args = ("--prefix-cache-blocks", cache_blocks, *args)
        workdir = tmp_path / cache_blocks
        workdir.mkdir()
        with (
            running_pool(workdir, 2, prefill_args=prefill_args, decode_args=args) as pool,
            pool_front(workdir, pool, args=args, metrics=metrics) as envoy,
            httpx.Client(timeout=30) as client,
        ):
            for i in range(6):
                conversation_turns(client, envoy.url, f"conv{i}", 4, f"{i} {SYSTEM * 3}")
            return scrape_metric(metrics[0], "pdproc_prefix_index_blocks")

    roomy = remembered("4096")
    tiny = remembered("4")  # 64 tokens: the pods keep next to nothing
    assert roomy > 2 * MIN_BLOCKS_PER_POD
    assert tiny <= 2 * MIN_BLOCKS_PER_POD, (roomy, tiny)
