"""Each scenario of tests/cluster/scenarios.py as a test: the bound it states must hold.

A scenario whose bound needs the picker to route around failing pods is an xfail (not
strict) until that work is in; the table at the end of the run shows every scenario's
numbers either way."""

from __future__ import annotations

import pytest

from tests.cluster import scenarios
from tests.cluster.bed import Bed
from tests.cluster.conftest import ROWS


def _param(scenario: scenarios.Scenario) -> object:
    marks = []
    if scenario.needs_picker:
        marks.append(pytest.mark.xfail(strict=False, reason=scenario.needs_picker))
    return pytest.param(scenario, id=scenario.key, marks=marks)


@pytest.mark.parametrize("scenario", [_param(s) for s in scenarios.SCENARIOS])
def test_scenario_holds_its_bound(bed: Bed, scenario: scenarios.Scenario) -> None:
    result = scenarios.run(bed, scenario)
    ROWS.append(result.row)
    assert result.outcome.requests, "the load sent nothing"
    assert not result.violations, f"{scenario.name}: {scenario.bound}: {result.violations}"
