"""Suite-wide guard: under `make test` (PDPROC_TEST_INSTALLED=1) the code under test is the
installed wheels in the test virtualenv, never the checkout. A run that would import the
checkout's `pdproc` (or an editable install) stops before the first test.

Helpers every suite shares live beside this file: `tests/waiting.py` (`eventually`),
`tests/stacks.py` (a running stack: `reset`, `records`, `served`), `tests/envoy_side.py`
(Envoy's side of an ext_proc stream over real gRPC), `tests/metric_samples.py` and
`tests/hypothesis_budget.py` (`examples(n)`, a property test's count per profile); the
`fresh` fixture below resets whichever `stack` fixture the suite defines."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

# Registers the Hypothesis profiles: `pdproc` (loaded: no deadline) and `unit` (`make unit`
# passes --hypothesis-profile unit).
import tests.hypothesis_budget  # noqa: F401

if TYPE_CHECKING:
    from pdproc_sim.devstack import Stack


INSTALLED = os.environ.get("PDPROC_TEST_INSTALLED") == "1"
# Import package -> distribution that must provide it from site-packages.
ARTEFACTS = {"pdproc": "pdproc", "pdproc_sim": "pdproc-sim"}


def installed_distribution(name: str) -> importlib.metadata.Distribution | None:
    """The distribution installed in this interpreter's site-packages (not an egg-info an
    editable install left in the checkout)."""
    site = sysconfig.get_paths()["purelib"]
    return next(iter(importlib.metadata.distributions(name=name, path=[site])), None)


def installed_problems() -> list[str]:
    """Why the imported pdproc / pdproc_sim are not the installed wheels (empty: they are)."""
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    problems = []
    for module_name, dist_name in ARTEFACTS.items():
        problems += _artefact_problems(module_name, dist_name, site)
    return problems + _process_problems()


def _artefact_problems(module_name: str, dist_name: str, site: Path) -> list[str]:
    """Why one package is not imported from its installed wheel."""
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return [f"{module_name} is not importable: {exc}"]
    problems = []
    where = Path(module.__file__ or "").resolve()
    if site not in where.parents:
        problems.append(f"{module_name} comes from {where}, not from {site}")
    dist = installed_distribution(dist_name)
    if dist is None:
        return [*problems, f"distribution {dist_name} is not installed in {site}"]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable") or not direct.get("url", "").endswith(".whl"):
        problems.append(f"{dist_name} is not installed from a wheel: {direct or 'no URL'}")
    return problems


def _process_problems() -> list[str]:
    """Why processes the tests start would not run the installed wheels either."""
    problems = []
    # Subprocesses get the same guarantee from the import hook `make test-venv` installs
    # (tests/package/installed_first.py): without it, a process whose working directory is
    # the checkout would import the checkout's pdproc/.
    if not any(getattr(f, "__module__", "") == "_pdproc_installed_first" for f in sys.meta_path):
        problems.append("the installed-first import hook is not active (make test-venv)")
    script = Path(sys.executable).with_name("pdproc")
    if not script.exists():
        problems.append(f"no pdproc console script next to {sys.executable}")
    return problems


def pytest_sessionstart(session: pytest.Session) -> None:
    if not INSTALLED:
        return
    problems = installed_problems()
    if problems:
        pytest.exit(
            "PDPROC_TEST_INSTALLED=1 but the tests would not test the installed wheels:\n  "
            + "\n  ".join(problems),
            returncode=3,
        )


def pytest_report_header() -> list[str]:
    import pdproc

    mode = "installed wheels" if INSTALLED else "development install"
    return [f"pdproc {pdproc.__version__} from {Path(pdproc.__file__ or '').parent} ({mode})"]


@pytest.fixture
def fresh(stack: Stack) -> Stack:
    """The suite's shared `stack` with the simulated pods reset: no faults, no records."""
    from tests.stacks import reset

    return reset(stack)
