"""`python -m bench.run --smoke` works end to end: it starts the stack, measures every
configuration it can run, and writes its results. No performance thresholds: the box that
runs CI is shared and small, so only the harness itself is under test here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
from pdproc_sim.devstack import envoy_binary

from bench.run import CONFIGS

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
# The smoke run takes < 60 s on 2 shared cores; the margin is for a slow CI box.
SMOKE_TIMEOUT_S = 180
CELL_NUMBERS = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "rps")


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


def test_writes_results_with_expected_keys(smoke: tuple[Path, str]) -> None:
    out, stdout = smoke
    results = _results(out)
    assert {"meta", "configs", "runs", "summary"} <= results.keys()
    assert {"cells", "derived", "targets"} <= results["summary"].keys()
    assert results["meta"]["smoke"] is True
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
            assert info["reason"], f"{name} skipped without a reason"
            continue
        mine = [c for c in cells if c["config"] == name]
        assert {c["concurrency"] for c in mine} == {1, 4}, name
        for cell in mine:
            for metric in CELL_NUMBERS:
                assert cell[metric]["median"] is not None, (name, cell["concurrency"], metric)


def test_every_pdproc_request_succeeded(smoke: tuple[Path, str]) -> None:
    results = _results(smoke[0])
    assert results["configs"]["pdproc"]["status"] == "ok", results["configs"]["pdproc"]
    runs = [r for r in results["runs"] if r["config"] == "pdproc"]
    assert runs
    for run in runs:
        assert run["failed"] == 0, run["errors"]
        assert run["warmup_failed"] == 0, run["warmup_errors"]
        assert run["ok"] == run["requests"] == 20
    assert results["summary"]["cells"], "no cells summarised"
