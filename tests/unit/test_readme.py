"""README stays true: the two set-up commands exist; the settings table (docs) is current."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from pdproc.config import settings_table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SETTINGS = (ROOT / "docs" / "settings.md").read_text()


def test_settings_table_matches_the_cli() -> None:
    start = SETTINGS.index("<!-- settings-table")
    end = SETTINGS.index("<!-- end settings-table -->")
    table = SETTINGS[SETTINGS.index("\n", start) + 1 : end].strip()
    stale = "docs/settings.md's settings table is stale: paste pdproc.config.settings_table()"
    assert table == settings_table(), stale


def _dry_run(target: str) -> list[str]:
    """The commands `make <target>` would run here (`make -n`: printed, none executed)."""
    # Not the flags or variables of a make this test may itself run under.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [line.strip() for line in done.stdout.splitlines()]


def test_two_commands_and_ci_use_them() -> None:
    """The README's two-command block is exactly `make demo` and `make test`; CI's first
    suite is `make test`, which runs the linters and the whole suite; `make demo` runs
    `pdproc demo`."""
    block = README[README.index("```sh\nmake demo") + len("```sh\n") :]
    block = block[: block.index("```")]
    assert [line.split("#")[0].strip() for line in block.splitlines()] == [
        "make demo",
        "make test",
    ]
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.findall(r"^step (\S+)$", ci, re.MULTILINE)[0] == "test"
    assert 'make --no-print-directory "$1"' in ci
    test = _dry_run("test")
    assert ".venv/bin/ruff check pdproc tests scripts deploy bench sim" in test
    assert ".venv/bin/mypy" in test
    assert any(
        re.fullmatch(
            r"\S+/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile tests", c
        )
        for c in test
    )
    assert re.fullmatch(r"\.venv-demo/bin/pdproc demo --port 10000", _dry_run("demo")[-1])


def test_grafana_dashboard_only_queries_metrics_pdproc_exports() -> None:
    import json
    import re

    from pdproc.metrics import Metrics

    root = Path(__file__).resolve().parents[2]
    dashboard = json.loads((root / "deploy" / "grafana" / "pdproc-dashboard.json").read_text())
    exported = {
        sample_name
        for family in Metrics().registry.collect()
        for sample_name in (
            family.name,
            family.name + "_total",
            family.name + "_bucket",
            family.name + "_info",
        )
    }
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bpdproc_[a-z_]+", target["expr"])
    }
    assert queried
    assert queried <= exported, queried - exported


def test_readme_is_a_front_door() -> None:
    """The README is the first screen, not the manual: what goes past 16 KiB belongs in
    docs/ (a page the README links)."""
    size = len(README.encode())
    assert size <= 16 * 1024, f"README.md is {size} bytes: move detail into docs/"
