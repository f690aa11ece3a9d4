"""deploy/tools/deploycheck/checks.py, the validator's cross-checks, on objects written here:
label selectors (no shipped manifest uses matchExpressions, so the mutation cases of
tests/deploy never reach them) and the order of the Pod Security findings."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy" / "tools"))
# the validator's package (deploy/tools), not installed
from deploycheck import checks
from deploycheck.report import Doc, Report

LABELS = {"app": "pdproc", "tier": "gateway"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ({}, True),
        ({"matchLabels": {"app": "pdproc"}}, True),
        ({"matchLabels": {"app": "sim"}}, False),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["pdproc"]}]}, True),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["sim"]}]}, False),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["sim"]}]}, True),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["pdproc"]}]}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, True),
        ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, False),
        ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, False),
        # An operator Kubernetes does not have constrains nothing (the schema rejects it).
        ({"matchExpressions": [{"key": "zone", "operator": "Near", "values": ["x"]}]}, True),
        (
            {
                "matchLabels": {"app": "pdproc"},
                "matchExpressions": [
                    {"key": "tier", "operator": "Exists"},
                    {"key": "app", "operator": "NotIn", "values": ["pdproc"]},
                ],
            },
            False,
        ),
    ],
)
def test_label_selector_matches(selector: dict[str, Any], expected: bool) -> None:
    assert checks.label_selector_matches(selector, LABELS) is expected


def deployment(pod: dict[str, Any]) -> Doc:
    obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w"},
        "spec": {"template": {"spec": pod}},
    }
    return Doc(obj, "w.yaml#0 Deployment/w")


def test_pod_security_findings_in_order() -> None:
    """Every "restricted" finding of a container, pod-level ones first, in the order the
    validator has always printed them."""
    pod = {
        "hostNetwork": True,
        "securityContext": {"runAsUser": 0},
        "containers": [
            {
                "name": "c",
                "securityContext": {
                    "capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]},
                    "privileged": True,
                },
            },
            {
                "name": "ok",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                    "runAsNonRoot": True,
                    "runAsUser": 1000,
                    "seccompProfile": {"type": "RuntimeDefault"},
                },
            },
        ],
    }
    report = Report()
    docs = [deployment(pod)]
    checks._pod_security(docs, {}, None, report)  # type: ignore[arg-type]
    prefix = "w.yaml#0 Deployment/w: Pod Security 'restricted' rejects it: "
    assert report.errors == [
        prefix + "hostNetwork is set",
        prefix + "container c: allowPrivilegeEscalation must be false",
        prefix + "container c: capabilities.drop must include ALL",
        prefix + "container c: adds capabilities ['NET_ADMIN']",
        prefix + "container c: runAsNonRoot must be true (pod or container)",
        prefix + "container c: runAsUser 0",
        prefix + "container c: seccompProfile must be RuntimeDefault or Localhost",
        prefix + "container c: privileged",
    ]
