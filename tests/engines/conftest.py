"""Fixtures of the real-engine suite (`make test-engines`): the engines' venv, the model, the
CPU shims. Each test module starts its own pair (module scope), so the NIXL pair is stopped
before the Mooncake pair starts and no two pairs ever run at once; the Makefile names the
modules in that order."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.engines import harness


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The suite needs minutes of setup and a real engine venv: only when asked for.
    if os.environ.get("PDPROC_TEST_ENGINES") == "1":
        return
    skip = pytest.mark.skip(reason="real-engine suite: run it with `make test-engines`")
    for item in items:
        if "tests/engines/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if harness.MEASURED:
        terminalreporter.section("measured on the real engines")
        for line in harness.MEASURED:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def engines_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def model(engines_workdir: Path) -> Path:
    harness.engines_venv()  # installs (or finds) the venv first
    return harness.make_model(engines_workdir / "model")


@pytest.fixture(scope="session")
def libcuda(engines_workdir: Path) -> Path:
    return harness.build_libcuda(engines_workdir / "libcuda")


@pytest.fixture(scope="session", autouse=True)
def _no_engine_left() -> Iterator[None]:
    yield
    harness.kill_leftovers()
