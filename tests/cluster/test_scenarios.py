"""Each scenario of tests/cluster/scenarios.py as a test: the bound it states must hold.

The table at the end of the run shows every scenario's numbers, passed or failed. A scenario
compared with another (latency with healthy) uses that one's outcome from earlier in the
session, or runs it first."""

from __future__ import annotations

import pytest

from tests.cluster import scenarios
from tests.cluster.bed import Bed
from tests.cluster.conftest import OUTCOMES, ROWS


@pytest.mark.parametrize("scenario", scenarios.SCENARIOS, ids=lambda s: s.key)
def test_scenario_holds_its_bound(bed: Bed, scenario: scenarios.Scenario) -> None:
    result = scenarios.run(bed, scenario, done=OUTCOMES)
    ROWS.append(result.row)
    assert result.outcome.requests, "the load sent nothing"
    assert not result.violations, f"{scenario.name}: {scenario.bound}: {result.violations}"
