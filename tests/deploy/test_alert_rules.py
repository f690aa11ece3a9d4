"""The alerts of deploy/monitoring/prometheusrule.yaml, evaluated by Prometheus' own rule engine:
`promtool test rules` (Debian's `prometheus` package; `make test` installs it when missing)
runs each scenario below on synthetic series shaped like the real ones (pdproc's /metrics,
Envoy's /stats/prometheus with the gateways' ext_proc stat prefixes, Istio's and the endpoint
picker's metrics) and checks which alerts fire, with which labels. The PrometheusRule is the
one kustomize renders, so the tests read what `kubectl apply -k deploy/monitoring` applies.

Every alert has a case that fires and one that must stay quiet; the issue's cases are here by
name: the Istio + llm-d gateway with two ext_proc filters (the picker's series must not hide
pdproc's), the gateway that stops calling pdproc, and a client spoofing prefill targets,
which must not page."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_monitoring import render_monitoring

REPO = Path(__file__).resolve().parents[2]
NS = "inference"
GW_NS = "envoy-gateway-system"
DAY_MIN = 24 * 60
EPP = f'job="vllm-pd-epp", namespace="{NS}"'


def counter(labels: str, per_minute: float, minutes: int, start: float = 0) -> dict[str, str]:
    """A counter rising `per_minute` every minute for `minutes` minutes (promtool notation)."""
    return {"series": labels, "values": f"{start:g}+{per_minute:g}x{minutes}"}


def gauge(labels: str, value: float, minutes: int) -> dict[str, str]:
    return {"series": labels, "values": f"{value:g}x{minutes}"}


def requests(
    outcome: str, per_minute: float, minutes: int, path: str = "/v1/completions"
) -> dict[str, str]:
    labels = (
        f'pdproc_requests_total{{job="pdproc", namespace="{NS}", pod="pdproc-0", '
        f'path="{path}", outcome="{outcome}", connector="mooncake"}}'
    )
    return counter(labels, per_minute, minutes)


def prefills(outcome: str, per_minute: float, minutes: int) -> dict[str, str]:
    labels = (
        f'pdproc_prefills_total{{job="pdproc", namespace="{NS}", pod="pdproc-0", '
        f'outcome="{outcome}"}}'
    )
    return counter(labels, per_minute, minutes)


def envoy(
    stat: str, per_minute: float, minutes: int, prefix: str = "", pod: str = "gw-0"
) -> dict[str, str]:
    """An ext_proc counter of a gateway pod; prefix "pdproc" is Istio's EnvoyFilter."""
    name = f"envoy_http_ext_proc_{prefix + '_' if prefix else ''}{stat}"
    labels = (
        f'{name}{{namespace="{GW_NS}", pod="{pod}", envoy_http_conn_manager_prefix="http-10080"}}'
    )
    return counter(labels, per_minute, minutes)


@dataclass(frozen=True)
class Case:
    id: str
    alert: str
    series: list[dict[str, str]]
    eval_minutes: int
    fires: list[dict[str, str]] = field(default_factory=list)  # expected labels, [] = quiet


CASES = [
    # ---------------------------------------------------------------- pdproc itself
    Case(
        "pdproc-down-fires",
        "PdprocDown",
        [gauge(f'up{{job="pdproc", namespace="{NS}", pod="pdproc-0"}}', 0, 20)],
        10,
        [{"severity": "warning", "job": "pdproc", "namespace": NS, "pod": "pdproc-0"}],
    ),
    Case(
        "pdproc-up-quiet",
        "PdprocDown",
        [gauge(f'up{{job="pdproc", namespace="{NS}", pod="pdproc-0"}}', 1, 20)],
        10,
    ),
    Case(
        "metrics-absent-fires",
        "PdprocMetricsAbsent",
        [gauge('up{job="prometheus"}', 1, 30)],
        20,
        [{"severity": "warning", "job": "pdproc"}],
    ),
    Case(
        "metrics-present-quiet",
        "PdprocMetricsAbsent",
        [gauge(f'up{{job="pdproc", namespace="{NS}", pod="pdproc-0"}}', 1, 30)],
        20,
    ),
    # Yesterday every request was disaggregated; from today 00:00 half go passthrough.
    Case(
        "pd-share-dropped-fires",
        "PdprocPDShareDropped",
        [
            {
                "series": requests("pd", 0, 0)["series"],
                "values": f"0+60x{DAY_MIN} {DAY_MIN * 60 + 30:g}+30x80",
            },
            {"series": requests("passthrough", 0, 0)["series"], "values": f"0x{DAY_MIN} 30+30x80"},
        ],
        DAY_MIN + 60,
        [{"severity": "warning", "namespace": NS}],
    ),
    # The same day-over-day, but what is new today is a client's malformed requests: they are
    # not requests pdproc could have disaggregated, so the share is unchanged.
    Case(
        "pd-share-client-errors-quiet",
        "PdprocPDShareDropped",
        [
            requests("pd", 60, DAY_MIN + 80),
            {
                "series": requests("bad_request", 0, 0)["series"],
                "values": f"0x{DAY_MIN} 120+120x80",
            },
        ],
        DAY_MIN + 60,
    ),
    # --decode-choice prefix: a day later most turns find their decode holding the prompt and
    # skip the prefill (decode_cached): that is P/D working, not a drop.
    Case(
        "pd-share-decode-cached-quiet",
        "PdprocPDShareDropped",
        [
            {
                "series": requests("pd", 0, 0)["series"],
                "values": f"0+60x{DAY_MIN} {DAY_MIN * 60 + 15:g}+15x80",
            },
            {
                "series": requests("decode_cached", 0, 0)["series"],
                "values": f"0x{DAY_MIN} 45+45x80",
            },
        ],
        DAY_MIN + 60,
    ),
    Case(
        "no-disaggregation-fires",
        "PdprocNoDisaggregation",
        [requests("passthrough", 60, 60)],
        45,
        [{"severity": "critical", "namespace": NS}],
    ),
    # Nobody but one client sending garbage at night: nothing to disaggregate, nothing broken.
    Case(
        "no-disaggregation-client-garbage-quiet",
        "PdprocNoDisaggregation",
        [requests("bad_request", 60, 60), requests("too_large", 60, 60)],
        45,
    ),
    # Every request found its decode holding the prompt: nothing needed a prefill.
    Case(
        "no-disaggregation-all-decode-cached-quiet",
        "PdprocNoDisaggregation",
        [requests("decode_cached", 60, 60)],
        45,
    ),
    Case(
        "no-disaggregation-some-pd-quiet",
        "PdprocNoDisaggregation",
        [requests("passthrough", 60, 60), requests("pd", 1, 60)],
        45,
    ),
    # A wrong allow list: every target the picker names is refused.
    Case(
        "forbidden-misconfigured-allow-list-pages",
        "PdprocPrefillTargetsForbidden",
        [requests("forbidden", 60, 60)],
        30,
        [{"severity": "critical", "namespace": NS}],
    ),
    # A client spoofing x-prefiller-host-port once every 4 minutes, with and without real traffic.
    Case(
        "forbidden-client-spoofing-with-traffic-quiet",
        "PdprocPrefillTargetsForbidden",
        [requests("pd", 60, 120), requests("forbidden", 0.25, 120)],
        110,
    ),
    Case(
        "forbidden-client-spoofing-alone-quiet",
        "PdprocPrefillTargetsForbidden",
        [requests("forbidden", 0.25, 120)],
        110,
    ),
    Case(
        "prefill-5xx-fires",
        "PdprocPrefillFailures",
        [prefills("2xx", 54, 40), prefills("5xx", 6, 40)],
        30,
        [{"severity": "warning", "namespace": NS}],
    ),
    # Prompts too long for the model: the prefill pod answers 400 and so does the client.
    Case(
        "prefill-4xx-client-caused-quiet",
        "PdprocPrefillFailures",
        [prefills("2xx", 30, 40), prefills("4xx", 30, 40)],
        30,
    ),
    # Clients that leave mid-prefill (a chat UI's stop button): pdproc cancels their prefills;
    # no pod failed.
    Case(
        "prefill-cancelled-by-clients-quiet",
        "PdprocPrefillFailures",
        [prefills("2xx", 30, 40), prefills("cancelled", 30, 40)],
        30,
    ),
    # pdproc out of its own connection slots fails the requests too: it fires.
    Case(
        "prefill-exhausted-fires",
        "PdprocPrefillFailures",
        [prefills("2xx", 30, 40), prefills("exhausted", 30, 40)],
        30,
        [{"severity": "warning", "namespace": NS}],
    ),
    Case(
        "breaker-open-fires",
        "PdprocPrefillBreakerOpen",
        [
            gauge(
                f'pdproc_prefill_breaker_open{{job="pdproc", namespace="{NS}", pod="pdproc-0", '
                'target="10.0.0.7:8000"}',
                1,
                20,
            )
        ],
        10,
        [{"severity": "warning", "namespace": NS, "target": "10.0.0.7:8000"}],
    ),
    # The served certificate's not-after is 2000 s after the epoch promtool starts at.
    Case(
        "certificate-expires-soon-fires",
        "PdprocCertificateExpiresSoon",
        [
            gauge(
                f'pdproc_tls_certificate_expiry_timestamp_seconds{{job="pdproc", '
                f'namespace="{NS}", pod="pdproc-0", certificate="served"}}',
                2000,
                30,
            )
        ],
        20,
        [{"severity": "warning", "namespace": NS, "pod": "pdproc-0", "certificate": "served"}],
    ),
    # Renewed: 90 days left.
    Case(
        "certificate-renewed-quiet",
        "PdprocCertificateExpiresSoon",
        [
            gauge(
                f'pdproc_tls_certificate_expiry_timestamp_seconds{{job="pdproc", '
                f'namespace="{NS}", pod="pdproc-0", certificate="served"}}',
                90 * 86400,
                30,
            )
        ],
        20,
    ),
    # A breaker that opened and closed again within the 5 minutes.
    Case(
        "breaker-flapping-quiet",
        "PdprocPrefillBreakerOpen",
        [
            {
                "series": f'pdproc_prefill_breaker_open{{job="pdproc", namespace="{NS}", '
                'pod="pdproc-0", target="10.0.0.7:8000"}',
                "values": "0 1 1 0 0 1 1 0 0 1 1 0 0 1 1 0 0 1 1 0 0",
            }
        ],
        15,
    ),
    # ---------------------------------------------------------------- the gateway
    # Istio + llm-d: Istio's own ext_proc filter for the InferencePool (the picker, no stat
    # prefix, fail-closed: its failure_mode_allowed stays 0) next to pdproc's (stat_prefix
    # pdproc), which fails open at 0.5/s. A bare `or` of the two rates kept only the picker's.
    Case(
        "fail-open-istio-llm-d-two-ext-procs-fires",
        "GatewayExtProcFailOpen",
        [
            envoy("failure_mode_allowed", 0, 30),
            envoy("streams_started", 60, 30),
            envoy("failure_mode_allowed", 30, 30, prefix="pdproc"),
            envoy("streams_started", 60, 30, prefix="pdproc"),
        ],
        20,
        [{"severity": "critical", "namespace": GW_NS, "pod": "gw-0"}],
    ),
    Case(
        "fail-open-envoy-gateway-fires",
        "GatewayExtProcFailOpen",
        [envoy("failure_mode_allowed", 30, 30)],
        20,
        [{"severity": "critical", "namespace": GW_NS, "pod": "gw-0"}],
    ),
    Case(
        "fail-open-none-quiet",
        "GatewayExtProcFailOpen",
        [
            envoy("failure_mode_allowed", 0, 30),
            envoy("failure_mode_allowed", 0, 30, prefix="pdproc"),
        ],
        20,
    ),
    Case(
        "streams-failing-istio-llm-d-pdproc-fires",
        "GatewayExtProcStreamsFailing",
        [
            envoy("streams_started", 600, 40),
            envoy("streams_failed", 0, 40),
            envoy("streams_started", 60, 40, prefix="pdproc"),
            envoy("streams_failed", 30, 40, prefix="pdproc"),
        ],
        30,
        [
            {
                "severity": "warning",
                "namespace": GW_NS,
                "pod": "gw-0",
                "ext_proc_stat_prefix": "pdproc",
            }
        ],
    ),
    Case(
        "streams-healthy-quiet",
        "GatewayExtProcStreamsFailing",
        [envoy("streams_started", 600, 40), envoy("streams_failed", 0, 40)],
        30,
    ),
    Case(
        "message-timeouts-fires",
        "GatewayExtProcMessageTimeouts",
        [envoy("message_timeouts", 1, 40, prefix="pdproc"), envoy("message_timeouts", 0, 40)],
        30,
        [
            {
                "severity": "warning",
                "namespace": GW_NS,
                "pod": "gw-0",
                "ext_proc_stat_prefix": "pdproc",
            }
        ],
    ),
    Case(
        "message-timeouts-none-quiet",
        "GatewayExtProcMessageTimeouts",
        [envoy("message_timeouts", 0, 40, prefix="pdproc"), envoy("message_timeouts", 0, 40)],
        30,
    ),
    # The gateway routes 1 req/s on the P/D route, pdproc sees nothing (an EnvoyExtensionPolicy
    # that attaches to nothing): no ext_proc counter exists, only the comparison can see it.
    Case(
        "bypassed-envoy-gateway-policy-not-attached-fires",
        "PdprocBypassedByGateway",
        [
            counter(
                f'envoy_cluster_upstream_rq_total{{namespace="{GW_NS}", pod="gw-0", '
                f'envoy_cluster_name="httproute/{NS}/vllm-pd/rule/0"}}',
                60,
                40,
            ),
            gauge(f'up{{job="pdproc", namespace="{NS}", pod="pdproc-0"}}', 1, 40),
        ],
        30,
        [{"severity": "critical"}],
    ),
    # Istio: an EnvoyFilter that matches no listener; pdproc sees only a trickle.
    Case(
        "bypassed-istio-envoyfilter-matches-nothing-fires",
        "PdprocBypassedByGateway",
        [
            counter(
                f'istio_requests_total{{namespace="{NS}", pod="inference-gateway-istio-0", '
                'reporter="source", source_workload="inference-gateway-istio", '
                'response_code="200"}',
                60,
                40,
            ),
            requests("pd", 1, 40),
        ],
        30,
        [{"severity": "critical"}],
    ),
    Case(
        "gateway-calls-pdproc-quiet",
        "PdprocBypassedByGateway",
        [
            counter(
                f'envoy_cluster_upstream_rq_total{{namespace="{GW_NS}", pod="gw-0", '
                f'envoy_cluster_name="httproute/{NS}/vllm-pd/rule/0"}}',
                60,
                40,
            ),
            # The passthrough route's traffic (/v1/models) is not the P/D route's.
            counter(
                f'envoy_cluster_upstream_rq_total{{namespace="{GW_NS}", pod="gw-0", '
                f'envoy_cluster_name="httproute/{NS}/vllm-passthrough/rule/0"}}',
                600,
                40,
            ),
            requests("pd", 60, 40),
        ],
        30,
    ),
    # ---------------------------------------------------------------- the endpoint picker
    Case(
        "epp-down-fires",
        "EndpointPickerDown",
        [
            gauge(f'up{{{EPP}, pod="epp-0"}}', 0, 20),
            gauge(f'up{{{EPP}, pod="epp-1"}}', 0, 20),
        ],
        10,
        [{"severity": "critical", "namespace": NS}],
    ),
    Case(
        "epp-one-replica-up-quiet",
        "EndpointPickerDown",
        [
            gauge(f'up{{{EPP}, pod="epp-0"}}', 0, 20),
            gauge(f'up{{{EPP}, pod="epp-1"}}', 1, 20),
        ],
        10,
    ),
    Case(
        "epp-no-ready-pods-fires",
        "EndpointPickerNoReadyPods",
        [
            gauge(
                f'inference_pool_ready_pods{{{EPP}, pod="epp-0", name="vllm-pd"}}',
                0,
                20,
            )
        ],
        10,
        [{"severity": "critical", "namespace": NS, "name": "vllm-pd"}],
    ),
    Case(
        "epp-ready-pods-quiet",
        "EndpointPickerNoReadyPods",
        [
            gauge(
                f'inference_pool_ready_pods{{{EPP}, pod="epp-0", name="vllm-pd"}}',
                4,
                20,
            )
        ],
        10,
    ),
    Case(
        "epp-errors-fires",
        "EndpointPickerErrors",
        [
            counter(
                f'inference_model_request_total{{{EPP}, model_name="m"}}',
                60,
                40,
            ),
            counter(
                f'inference_model_request_error_total{{{EPP}, model_name="m", '
                'error_code="ServiceUnavailable"}',
                12,
                40,
            ),
        ],
        30,
        [{"severity": "warning", "namespace": NS}],
    ),
    Case(
        "epp-few-errors-quiet",
        "EndpointPickerErrors",
        [
            counter(
                f'inference_model_request_total{{{EPP}, model_name="m"}}',
                600,
                40,
            ),
            counter(
                f'inference_model_request_error_total{{{EPP}, model_name="m", '
                'error_code="BadRequest"}',
                1,
                40,
            ),
        ],
        30,
    ),
]


def find_promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail(
            "promtool is not installed: `make promtool` installs Debian's prometheus package"
        )
    return path


@pytest.fixture(scope="module")
def promtool() -> str:
    return find_promtool()


def rendered_rules() -> list[dict[str, Any]]:
    return [d for d in render_monitoring() if d["kind"] == "PrometheusRule"]


@pytest.fixture(scope="module")
def rule_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The rendered rules as a Prometheus rule file, once whole and once without annotations
    (the cases check which alerts fire and their labels; the annotation templates are checked
    by `promtool check rules` on the whole file)."""
    (rule,) = rendered_rules()
    folder = tmp_path_factory.mktemp("rules")
    whole = folder / "whole.yaml"
    whole.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    bare_groups = [
        {**g, "rules": [{k: v for k, v in r.items() if k != "annotations"} for r in g["rules"]]}
        for g in rule["spec"]["groups"]
    ]
    bare = folder / "rules.yaml"
    bare.write_text(yaml.safe_dump({"groups": bare_groups}))
    return whole, bare


def test_rules_and_templates_check(promtool: str, rule_files: tuple[Path, Path]) -> None:
    whole, _ = rule_files
    proc = subprocess.run([promtool, "check", "rules", str(whole)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_alert_has_a_firing_and_a_quiet_case(rule_files: tuple[Path, Path]) -> None:
    whole, _ = rule_files
    alerts = {
        r["alert"]
        for g in yaml.safe_load(whole.read_text())["groups"]
        for r in g["rules"]
        if "alert" in r
    }
    firing = {c.alert for c in CASES if c.fires}
    quiet = {c.alert for c in CASES if not c.fires}
    assert alerts == firing, sorted(alerts ^ firing)
    assert alerts == quiet, sorted(alerts ^ quiet)


def run_case(promtool: str, rules: Path, case: Case) -> subprocess.CompletedProcess[str]:
    test = {
        "rule_files": [rules.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": case.id,
                "interval": "1m",
                "input_series": case.series,
                "alert_rule_test": [
                    {
                        "eval_time": f"{case.eval_minutes}m",
                        "alertname": case.alert,
                        "exp_alerts": [{"exp_labels": labels} for labels in case.fires],
                    }
                ],
            }
        ],
    }
    path = rules.parent / f"test-{case.id}.yaml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    return subprocess.run(
        [promtool, "test", "rules", path.name], cwd=rules.parent, capture_output=True, text=True
    )


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_alert(promtool: str, rule_files: tuple[Path, Path], case: Case) -> None:
    _, bare = rule_files
    proc = run_case(promtool, bare, case)
    assert proc.returncode == 0, proc.stdout + proc.stderr
