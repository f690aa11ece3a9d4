"""`python -m bench.run --smoke` works end to end: it starts every configuration it can, the
floor processor (bench/floor.py) included, measures each, and writes its results. No
performance thresholds: the box that runs CI is shared and small, so only the harness (and
the floor's correctness: its requests pair on the simulator) is under test here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import envoy_binary

from bench.stack import CONFIGS, PD_CONFIGS

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
# The smoke run takes ~35 s on 2 shared cores; the margin is for a slow CI box.
SMOKE_TIMEOUT_S = 180
SMOKE_REQUESTS = 10
CELL_NUMBERS = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "rps", "cpu_client_ms")
# Configurations the smoke run must measure wherever the e2e suite runs (the routers and the
# newer connectors may be skipped, with a reason).
REQUIRED = ("direct", "direct-pd", "envoy", "floor", "pdproc", "pdproc-1msg")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    try:
        envoy_binary()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", "--out", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=SMOKE_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return out, done.stdout.decode()


def _results(out: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((out / "results.json").read_bytes())
    return data


def _runs(results: dict[str, Any], config: str) -> list[dict[str, Any]]:
    return [r for r in results["runs"] if r["config"] == config and r["round"] > 0]


def test_writes_results_with_expected_keys(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    results = _results(out)
    assert {"meta", "configs", "runs", "summary"} <= results.keys()
    assert {"cells", "versus", "derived", "headline", "targets"} <= results["summary"].keys()
    assert results["meta"]["smoke"] is True
    assert results["meta"]["command"].startswith("python -m bench.run --smoke")
    assert set(results["configs"]) == set(CONFIGS)
    assert (out / "summary.md").read_text() in stdout  # the table printed is the one saved
    for derived in results["summary"]["derived"]:
        assert {"added_ttft_p50_ms", "added_ttft_p99_ms", "throughput_ratio_pdproc_envoy"} <= (
            derived.keys()
        )


def test_every_config_has_numbers_or_a_skip_reason(smoke: tuple[Path, str]) -> None:
    results = _results(smoke[0])
    cells = results["summary"]["cells"]
    for name, info in results["configs"].items():
        if info["status"] != "ok":
            assert name not in REQUIRED, (name, info["reason"])
            assert info["reason"], f"{name} skipped without a reason"
            continue
        mine = [c for c in cells if c["config"] == name]
        assert {c["concurrency"] for c in mine} == {1, 4}, name
        for cell in mine:
            for metric in CELL_NUMBERS:
                assert cell[metric]["median"] is not None, (name, cell["concurrency"], metric)


def test_every_process_has_its_cpu_per_request(smoke: tuple[Path, str]) -> None:
    results = _results(smoke[0])
    for name, info in results["configs"].items():
        if info["status"] != "ok":
            continue
        assert "sim" in info["roles"], name
        for run in _runs(results, name):
            for role in (*info["roles"], "client"):
                assert run["cpu_ms_per_req"][role] is not None, (name, role)
                assert run["cpu_ms_per_req"][role] >= 0, (name, role)
    roles = {name: set(info["roles"]) for name, info in results["configs"].items()}
    assert roles["floor"] == roles["pdproc"] == {"envoy", "processor", "sim"}
    assert roles["envoy"] == {"envoy", "sim"}


def test_every_request_succeeded_and_pd_requests_paired(smoke: tuple[Path, str]) -> None:
    """The floor and pdproc are correct P/D processors: every decode got its KV from the
    prefill the processor launched (the simulated decode counts it)."""
    results = _results(smoke[0])
    for name, info in results["configs"].items():
        if info["status"] != "ok":
            continue
        runs = _runs(results, name)
        assert runs, name
        for run in runs:
            assert run["failed"] == 0, (name, run["errors"])
            assert run["warmup_failed"] == 0, (name, run["warmup_errors"])
            assert run["ok"] == run["requests"] == SMOKE_REQUESTS, name
            assert run["kv_failures"] == 0, name
            expected = run["ok"] if name in PD_CONFIGS else 0
            assert run["paired"] == expected, (name, run["paired"])


def test_floor_is_compared_with_pdproc(smoke: tuple[Path, str]) -> None:
    results = _results(smoke[0])
    versus = [v for v in results["summary"]["versus"] if (v["a"], v["b"]) == ("pdproc", "floor")]
    assert {v["concurrency"] for v in versus} == {1, 4}
    for v in versus:
        assert v["ttft_p50_diff_ms"]["median"] is not None
        assert v["rps_ratio"]["median"] is not None
    headline = results["summary"]["headline"]["pdproc"]
    assert headline["rps_ratio_1k_saturation"]["median"] is not None
    assert "pdproc against the floor" in (smoke[0] / "summary.md").read_text()
