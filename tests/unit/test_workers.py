"""How many processes `pdproc serve` runs (`--workers`; 0 means one per CPU of a container's
limit, else one per two CPUs)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from pdproc.config import Settings
from pdproc.multiprocess.budgets import worker_settings
from pdproc.multiprocess.supervisor import cpus_from_cpu_max, default_workers, worker_count
from pdproc.targets import HostPort


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000\n", None),
        ("200000 100000\n", 2),
        ("150000 100000", 2),  # 1.5 CPUs: a second process still has work
        ("50000 100000", 1),
        ("-1 100000", None),  # cgroup v1: no quota
        ("0 100000", None),
        ("garbage", None),
        ("1 2 3", None),
        ("x 100000", None),
    ],
)
def test_cpu_max(text: str, cpus: int | None) -> None:
    assert cpus_from_cpu_max(text) == cpus


def test_default_workers_follows_a_cgroup_v2_limit(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert default_workers(str(tmp_path)) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert default_workers(str(tmp_path)) == max(1, affinity // 2)
    (tmp_path / "cpu.max").write_text(f"{(affinity + 4) * 100000} 100000\n")
    assert default_workers(str(tmp_path)) == affinity  # never more than it may run on


def test_default_workers_follows_a_cgroup_v1_limit(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert default_workers(str(tmp_path)) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert default_workers(str(tmp_path)) == max(1, len(os.sched_getaffinity(0)) // 2)


def test_without_a_cgroup_limit_it_is_half_the_affinity(tmp_path: Path) -> None:
    # The CPUs are shared (with Envoy first of all): one process per two of them.
    half = max(1, len(os.sched_getaffinity(0)) // 2)
    assert default_workers(str(tmp_path / "none")) == half


def test_worker_count() -> None:
    fixed = replace(Settings(), listen=HostPort("127.0.0.1", 9002))
    assert worker_count(replace(fixed, workers=3)) == 3
    assert worker_count(replace(fixed, workers=0)) == default_workers()
    # Port 0: each process would pick its own port; one process.
    assert worker_count(replace(fixed, workers=0, listen=HostPort("127.0.0.1", 0))) == 1
    assert Settings().workers == 0


def test_each_worker_gets_its_share_of_the_totals() -> None:
    settings = replace(Settings(), max_inflight_bytes=1000, max_prefill_connections=1024)
    each = worker_settings(settings, 3)
    assert (each.workers, each.max_inflight_bytes, each.max_prefill_connections) == (1, 333, 341)
    assert worker_settings(settings, 1).max_inflight_bytes == 1000
    tiny = worker_settings(replace(settings, max_inflight_bytes=1, max_prefill_connections=1), 4)
    assert (tiny.max_inflight_bytes, tiny.max_prefill_connections) == (1, 1)
