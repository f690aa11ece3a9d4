"""Fixtures for the package checks: the wheels `make test` built (PDPROC_DIST) and throwaway
installations made from them."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALLED = os.environ.get("PDPROC_TEST_INSTALLED") == "1"
PIP_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def dist() -> Path:
    value = os.environ.get("PDPROC_DIST")
    if not value:
        if INSTALLED:
            pytest.fail("PDPROC_TEST_INSTALLED=1 needs PDPROC_DIST (the dist/ of the wheels)")
        pytest.skip("needs the built wheels: `make test` sets PDPROC_DIST")
    return Path(value)


def one(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {dist}, found {found}"
    return found[0]


@pytest.fixture(scope="session")
def pdproc_wheel(dist: Path) -> Path:
    return one(dist, "pdproc-*.whl")


@pytest.fixture(scope="session")
def sim_wheel(dist: Path) -> Path:
    if not (REPO / "sim" / "pyproject.toml").exists():
        pytest.skip("no sim/ distribution in this checkout")
    return one(dist, "pdproc_sim-*.whl")


def installed_distribution(name: str) -> importlib.metadata.Distribution | None:
    """The distribution in this interpreter's site-packages (never an egg-info an editable
    install left in the checkout)."""
    site = sysconfig.get_paths()["purelib"]
    return next(iter(importlib.metadata.distributions(name=name, path=[site])), None)


def pip_install(python: Path, *args: str) -> None:
    """`pip install` into another interpreter's environment with this one's pip (the
    throwaway venvs are made without pip of their own, which is faster)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", *args],
        capture_output=True,
        text=True,
        timeout=PIP_TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"pip install {args} failed:\n{done.stdout}\n{done.stderr}"


def make_venv(path: Path) -> Path:
    """A fresh, empty virtualenv; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "bin" / "python"
