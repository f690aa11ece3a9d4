"""`pdproc envoy-config` output is a valid Envoy bootstrap (checked by Envoy itself)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from pdproc_sim.devstack import envoy_binary

from pdproc.cli import main

REPO = Path(__file__).resolve().parents[2]


def render(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["envoy-config", *args]) == 0
    return capsys.readouterr().out


def validate(path: Path) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]


def test_reference_config_is_current_and_valid(capsys: pytest.CaptureFixture[str]) -> None:
    text = render(
        capsys,
        "--listen", "0.0.0.0:10000", "--processor", "127.0.0.1:9002",
        "--decode", "127.0.0.1:8200", "--admin", "127.0.0.1:9901",
    )  # fmt: skip
    reference = REPO / "envoy" / "pdproc.yaml"
    assert reference.read_text() == text, "envoy/pdproc.yaml is stale: run `make envoy-config`"
    validate(reference)


def test_generated_configs_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    variants = {
        "multi": ["--decode", "10.0.0.1:8200", "--decode", "[fd00::2]:8200",
                  "--processor", "pdproc-0.pdproc:9002", "--processor", "pdproc-1.pdproc:9002"],
        "alone": ["--decode", "127.0.0.1:8200", "--no-processor"],
        "closed": ["--decode", "127.0.0.1:8200", "--fail-closed", "--access-log",
                   "--pd-path", "/v1/chat/completions"],
    }  # fmt: skip
    for name, args in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(render(capsys, *args))
        validate(path)


def test_processing_modes_are_the_ones_the_design_needs(capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters = hcm["typed_config"]["http_filters"]
    ext_proc = filters[0]["typed_config"]
    assert filters[-1]["name"] == "envoy.filters.http.router"
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SKIP",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["allow_mode_override"] is True
    vhost = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
    assert vhost["request_body_buffer_limit"] >= 4 * 1024 * 1024
    assert vhost["request_headers_to_remove"] == ["x-prefiller-host-port"]
    paths = [r["match"].get("path") for r in vhost["routes"]]
    assert "/v1/chat/completions" in paths
    catch_all = vhost["routes"][-1]
    assert catch_all["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["disabled"] is True


def test_envoy_alone_has_no_ext_proc(capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200", "--no-processor"))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert [f["name"] for f in hcm["typed_config"]["http_filters"]] == ["envoy.filters.http.router"]
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["decode"]
    routes = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert all("typed_per_filter_config" not in r for r in routes)
