"""README stays true: the two set-up commands exist and the settings table is current."""

from __future__ import annotations

from pathlib import Path

from pdproc.cli import settings_table

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_settings_table_matches_the_cli() -> None:
    start = README.index("<!-- settings-table")
    end = README.index("<!-- end settings-table -->")
    table = README[README.index("\n", start) + 1 : end].strip()
    assert table == settings_table(), "README settings table is stale: paste settings_table()"


def test_two_commands_and_ci_use_them() -> None:
    assert "make demo" in README
    assert "make test" in README
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert "make test" in ci
