"""README stays true: the two set-up commands exist and the settings table is current."""

from __future__ import annotations

from pathlib import Path

from pdproc.config import settings_table

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_settings_table_matches_the_cli() -> None:
    start = README.index("<!-- settings-table")
    end = README.index("<!-- end settings-table -->")
    table = README[README.index("\n", start) + 1 : end].strip()
    stale = "README settings table is stale: paste pdproc.config.settings_table()"
    assert table == settings_table(), stale


def test_two_commands_and_ci_use_them() -> None:
    assert "make demo" in README
    assert "make test" in README
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "make test" in ci


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
