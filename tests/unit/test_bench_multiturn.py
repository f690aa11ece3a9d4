"""bench/multiturn.py's pure parts: the workload every configuration gets, and the table."""

from __future__ import annotations

from collections import Counter

from bench.multiturn import WORKLOADS, Run, conversations, table


def test_every_configuration_gets_the_same_conversations() -> None:
    work = WORKLOADS["shared"]
    assert conversations(work, 7) == conversations(work, 7)
    assert conversations(work, 7) != conversations(work, 8)


def test_shared_system_prompts_follow_their_popularity() -> None:
    work = WORKLOADS["shared"]
    counts = Counter(system for system, _ in conversations(work, 7))
    assert len(counts) <= work.systems
    assert counts.most_common(1)[0][1] > work.conversations / work.systems
    for system, questions in conversations(work, 7):
        assert work.system_chars - 16 <= len(system) <= work.system_chars
        assert len(questions) == work.turns


def test_the_no_reuse_workload_shares_no_system_prompt() -> None:
    work = WORKLOADS["no-reuse"]
    systems = [system for system, _ in conversations(work, 7)]
    assert len(set(systems)) == len(systems) == work.conversations


def test_the_table_gives_ratios_against_least_loaded_of_the_same_round() -> None:
    runs = []
    for round_, (base, mine) in enumerate([(100.0, 40.0), (200.0, 60.0)]):
        for config, computed in (("least-loaded", base), ("prefix", mine)):
            run = Run(config, "shared", round_, requests=10, computed=computed, cached=10.0)
            run.ttft_s = [0.1, 0.2]
            run.prefills_per_pod = [5.0, 5.0]
            runs.append(run.summary())
    text = table(runs, ["least-loaded", "prefix"])
    prefix_row = next(line for line in text.splitlines() if "| prefix |" in line)
    assert "0.35 (0.30-0.40)" in prefix_row
