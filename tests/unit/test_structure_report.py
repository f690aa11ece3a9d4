"""scripts/structure_report.py: import cycles (with and without TYPE_CHECKING imports) and
complexity as ruff's C901 counts it and as radon (the library) does, on a small package written
for the test."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "structure_report.py"


@pytest.fixture(scope="module")
def report_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("structure_report", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_cycles_at_run_time_and_through_type_checking(
    report_module: ModuleType, tmp_path: Path
) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "from pkg.c import thing\n",
            "pkg/c.py": """
                from typing import TYPE_CHECKING
                if TYPE_CHECKING:
                    from pkg.a import x
                thing = 1
            """,
            "pkg/d.py": "from . import e\n",
            "pkg/e.py": """
                def later():
                    from pkg import d
            """,
        },
    )
    data = report_module.report(tmp_path, "pkg", ["pkg"], over=10)
    # d <-> e is a cycle at run time (a deferred import still runs); a -> b -> c -> a
    # only through TYPE_CHECKING.
    assert data["cycles_runtime"] == [["pkg.d", "pkg.e"]]
    assert data["cycles_with_type_checking"] == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]
    assert data["type_checking_imports"] == ["pkg.c -> pkg.a"]


def test_complexity_counts_like_ruff_and_as_radon_does(
    report_module: ModuleType, tmp_path: Path
) -> None:
    write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/f.py": """
                def f(x, items):
                    assert items             # radon: +1
                    if x and items:          # +1 (radon: +1 for `and`)
                        pass
                    elif x:                  # +1
                        pass
                    for i in items:          # +1
                        while i:             # +1
                            i -= 1
                    else:                    # radon: +1
                        pass
                    try:
                        pass
                    except ValueError:       # +1
                        pass
                    else:                    # +1
                        pass
                    y = [i for i in items if i]  # radon: +2

                    def g():                 # C901: +1 and its own (+1); radon: a block of its own
                        if x:
                            return 1

                    return y if x else None  # radon: +1
            """,
        },
    )
    data = report_module.report(tmp_path, "pkg", ["pkg"], over=5)
    (row,) = data["functions_over"]
    assert (row["function"], row["complexity"], row["radon"]) == ("f", 9, 13)
    assert data["max_per_package"]["pkg"]["complexity"] == 9
    rows = report_module.complexity(tmp_path, [tmp_path / "pkg" / "f.py"])
    assert [(r.name, r.complexity, r.radon) for r in rows] == [("f", 9, 13), ("f.g", 2, 2)]


GATED = {
    "pkg/__init__.py": "",
    "pkg/g.py": """
        def branchy(x):                  # C901 4, radon 4
            if x == 1:
                return 1
            if x == 2:
                return 2
            if x == 3:
                return 3
            return 0

        def wordy(a, b, c, d):           # C901 1, radon 4: boolean operators only
            return a and b and c and d

        def plain(x):                    # C901 2, radon 2
            if x:
                return 1
            return 0

        def checked(a, b, c):            # C901 1, radon 4: asserts only
            assert a
            assert b
            assert c
    """,
}


def run_gate(tmp_path: Path, limit: int) -> subprocess.CompletedProcess[str]:
    """The script as `make complexity` runs it, on the package written for the test."""
    argv = [sys.executable, str(SCRIPT), "--root", str(tmp_path), "--dirs", "pkg"]
    return subprocess.run(
        [*argv, "--max-complexity", str(limit)], capture_output=True, text=True, check=False
    )


def test_the_gate_lists_every_function_over_the_limit_by_either_count(tmp_path: Path) -> None:
    write(tmp_path, GATED)
    proc = run_gate(tmp_path, 3)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    listed = [line.split() for line in proc.stdout.splitlines()[2:]]
    # C901, radon, where, name: the C901 offender first, then the radon-only ones.
    assert listed == [
        ["4", "4", "pkg/g.py:2", "branchy"],
        ["1", "4", "pkg/g.py:11", "wordy"],
        ["1", "4", "pkg/g.py:19", "checked"],
    ]
    assert "3 of 4 functions over 3" in proc.stdout


def test_the_gate_passes_when_nothing_is_over(tmp_path: Path) -> None:
    write(tmp_path, GATED)
    proc = run_gate(tmp_path, 4)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "none of 4 functions is over 4" in proc.stdout
