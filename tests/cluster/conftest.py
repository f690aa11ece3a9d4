"""The cluster suite (`make test-cluster`, docs/cluster-tests.md): one bed of network
namespaces for the session, a fresh stack on it per scenario. Needs root, `ip`, `nft` and
`dnsmasq` (the make target installs them); the tests on the bed are skipped unless
PDPROC_TEST_CLUSTER=1, so `make test` runs only the pure ones (test_report.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.cluster import bed as cluster_bed
from tests.cluster import report

ROWS: list[report.Row] = []
OUTCOMES: dict[str, report.Outcome] = {}  # by scenario key, for the ones compared with them
REPORT = Path(os.environ.get("PDPROC_CLUSTER_REPORT", "build/cluster-report.md"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PDPROC_TEST_CLUSTER") == "1":
        return
    skip = pytest.mark.skip(
        reason="cluster suite (root, namespaces): run it with `make test-cluster`"
    )
    for item in items:
        if "bed" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[cluster_bed.Bed]:
    """The namespaces, bridge and dnsmasq; torn down (and checked empty) at the end, also on
    Ctrl-C or SIGTERM."""
    if os.geteuid() != 0:
        pytest.skip("the cluster bed needs root (network namespaces)")
    with cluster_bed.built(tmp_path_factory.mktemp("cluster")) as built:
        yield built


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not ROWS:
        return
    text = report.table(ROWS)
    terminalreporter.section("cluster scenarios (docs/cluster-tests.md)")
    for line in text.splitlines():
        terminalreporter.write_line(line)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(text + "\n")
    terminalreporter.write_line(f"(also in {REPORT})")
