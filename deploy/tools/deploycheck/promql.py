"""PromQL in the PrometheusRule and the Grafana dashboard: parsed by a real PromQL parser
(promql-parser, the Rust parser of the same grammar Prometheus uses), and every metric name
checked against what pdproc, Envoy and Prometheus really expose."""

from __future__ import annotations

import re
from typing import Any

import promql_parser

# Grafana's template variables, replaced by values of the right type before parsing.
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "${__rate_interval}": "5m",
}


def parse(expr: str) -> Any:
    return promql_parser.parse(expr)


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (vector and matrix selectors)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        name = getattr(node, "name", None)
        if isinstance(node, promql_parser.VectorSelector) and name:
            names.add(name)
        for attr in ("expr", "lhs", "rhs", "vector_selector", "param"):
            child = getattr(node, attr, None)
            if isinstance(child, promql_parser.Expr):
                visit(child)
        for arg in getattr(node, "args", None) or []:
            if isinstance(arg, promql_parser.Expr):
                visit(arg)

    visit(parse(expr))
    return names


def grafana_expr(expr: str, variables: dict[str, str]) -> str:
    text = expr
    for var, value in GRAFANA_VARS.items():
        text = text.replace(var, value)
    for name, value in variables.items():
        text = re.sub(
            r"\$\{" + re.escape(name) + r"(?::[a-z]+)?\}|\$" + re.escape(name) + r"\b", value, text
        )
    return text
