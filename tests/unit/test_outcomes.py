"""metrics.py declares every outcome the code records (issue 19, item 12).

The code names outcomes as string literals or module constants handed to a few calls; this
test reads pdproc's source and checks each one is in REQUEST_OUTCOMES / PREFILL_OUTCOMES, so
a new outcome cannot be recorded without being declared (and so documented on /metrics).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pdproc
from pdproc import prefill, processors
from pdproc.errors import ErrorKind
from pdproc.metrics import PREFILL_OUTCOMES, REQUEST_OUTCOMES

SOURCE = Path(pdproc.__file__).parent
# Calls whose string argument at this position is a request outcome.
REQUEST_CALLS = {"finish": 0, "count": 1, "DecodeOnly": 1, "_alone": 1}
PREFILL_CALLS = {"settle": 0}


def _constants(module: object) -> dict[str, str]:
    return {name: value for name, value in vars(module).items() if isinstance(value, str)}


def _recorded(calls: dict[str, int]) -> set[str]:
    names = {**_constants(processors), **_constants(prefill)}
    found: set[str] = set()
    for path in SOURCE.rglob("*.py"):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            position = calls.get(name)
            if position is None or len(node.args) <= position:
                continue
            argument = node.args[position]
            if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                found.add(argument.value)
            elif isinstance(argument, ast.Name) and argument.id in names:
                found.add(names[argument.id])
    return found


def test_every_request_outcome_the_code_records_is_declared() -> None:
    recorded = _recorded(REQUEST_CALLS)
    assert {"pd", "passthrough", "short_prompt", "abandoned", "cancelled"} <= recorded
    assert recorded - set(REQUEST_OUTCOMES) == set()
    assert {kind.value for kind in ErrorKind} <= set(REQUEST_OUTCOMES)


def test_every_prefill_outcome_the_code_records_is_declared() -> None:
    recorded = _recorded(PREFILL_CALLS)
    assert {"2xx", "timeout", "connect_error", "cancelled", "internal"} <= recorded
    assert recorded - set(PREFILL_OUTCOMES) == set()


def test_outcomes_are_listed_once() -> None:
    assert len(set(REQUEST_OUTCOMES)) == len(REQUEST_OUTCOMES)
    assert len(set(PREFILL_OUTCOMES)) == len(PREFILL_OUTCOMES)
