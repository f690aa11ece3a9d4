"""scripts/validate-deploy.sh: the manifests under deploy/ pass, and the validator it runs
catches the mistakes it exists for: each mutation below breaks a copy of the repository's
deploy files in one place, and the validator must fail with the right message (and, where
given, without a misleading one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "validate-deploy.sh"
VALIDATOR = REPO / "deploy" / "tools" / "validate.py"
# What the validator reads besides deploy/ (docs/: pdproc's settings table and metrics table).
COPIED = ("Dockerfile", "docker-compose.yaml", "docs/settings.md", "docs/observability.md")


def venv() -> Path:
    """Where the script keeps the validator's virtualenv (same rule as the script)."""
    if os.environ.get("PDPROC_VALIDATE_VENV"):
        return Path(os.environ["PDPROC_VALIDATE_VENV"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "pdproc" / "validate-deploy-venv"


def pdproc_cli() -> str | None:
    sibling = Path(sys.executable).with_name("pdproc")
    return str(sibling) if sibling.is_file() else shutil.which("pdproc")


@dataclass(frozen=True)
class Mutation:
    id: str
    path: str
    old: str
    new: str
    expected: str
    forbidden: str | None = None  # a message that must NOT appear (a misleading one)


MUTATIONS = [
    # --- the connection to pdproc queues at most 64 KiB (one client's tiny HTTP/2 frames)
    Mutation(
        "istio-pdproc-cluster-buffer-missing",
        "deploy/istio/envoyfilter.yaml",
        "  - applyTo: CLUSTER\n    match:\n      context: GATEWAY\n      cluster:\n"
        '        name: "outbound|9002||pdproc.inference.svc.cluster.local"\n    patch:\n'
        "      operation: MERGE\n      value:\n        per_connection_buffer_limit_bytes: 65536\n",
        "",
        "no CLUSTER MERGE of per_connection_buffer_limit_bytes",
    ),
    Mutation(
        "istio-pdproc-cluster-buffer-too-big",
        "deploy/istio/envoyfilter.yaml",
        "per_connection_buffer_limit_bytes: 65536",
        "per_connection_buffer_limit_bytes: 1048576",
        "per_connection_buffer_limit_bytes 1048576 is above 65536",
    ),
    Mutation(
        "istio-cluster-patch-names-no-cluster",
        "deploy/llm-d/istio/envoyfilter.yaml",
        '        name: "outbound|9002||pdproc.inference.svc.cluster.local"\n    patch:\n'
        "      operation: MERGE\n      value:\n        per_connection_buffer_limit_bytes: 65536",
        '        name: "outbound|9002||pdproc.other.svc.cluster.local"\n    patch:\n'
        "      operation: MERGE\n      value:\n        per_connection_buffer_limit_bytes: 65536",
        "no cluster 'outbound|9002||pdproc.other.svc.cluster.local' on the gateway",
    ),
    Mutation(
        "envoy-gateway-pdproc-buffer-missing",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "      connection:\n        bufferLimit: 64Ki\n",
        "",
        "backendSettings.connection.bufferLimit is 1 MiB (default)",
    ),
    # --- schemas: core kinds, vendored upstream CRDs, CEL rules
    Mutation(
        "core-unknown-field",
        "deploy/kubernetes/base/deployment.yaml",
        "readinessProbe:",
        "readinesProbe:",
        "'readinesProbe' was unexpected",
    ),
    Mutation(
        "crd-enum",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "body: Buffered",
        "body: Bufferd",
        "'Bufferd' is not one of",
    ),
    Mutation(
        "crd-unknown-field",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "    failOpen: true\n",
        "    failOpen: true\n    maxMessageTimeout: 300s\n",
        "'maxMessageTimeout' was unexpected",
    ),
    # No Envoy Gateway release has extProc[].stage (the old hand-pruned schema accepted it).
    Mutation(
        "crd-no-such-field-in-any-release",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "    failOpen: true\n",
        "    failOpen: true\n    stage: Route\n",
        "[envoy-gateway-v1.7.0] spec.extProc.0: Additional properties are not allowed ('stage'",
    ),
    Mutation(
        "crd-cel-rule",
        "deploy/llm-d/envoy-gateway/envoyextensionpolicy.yaml",
        "failOpen: false",
        "failOpen: true",
        "If FullDuplexStreamed body processing mode is used, FailOpen must be false",
    ),
    # A typo next to a CEL rule: the real error, not the rule's message.
    Mutation(
        "cel-message-does-not-hide-the-error",
        "deploy/envoy-gateway/httproute.yaml",
        "    - name: vllm-decode\n      port: 8000\n    # No route timeout",
        "    - name: vllm-decode\n      port: 8000\n      wieght: 1\n    # No route timeout",
        "('wieght' was unexpected)",
        forbidden="Must have port",
    ),
    # --- EnvoyFilter patches, applied to a model of an Istio 1.28 gateway
    Mutation(
        "envoyfilter-unknown-subfilter",
        "deploy/istio/envoyfilter.yaml",
        "name: envoy.filters.http.router",
        "name: envoy.filters.http.routr",
        "subFilter envoy.filters.http.routr is not a filter of an Istio 1.28 gateway",
    ),
    Mutation(
        "envoyfilter-proto",
        "deploy/istio/envoyfilter.yaml",
        "max_message_timeout: 300s",
        "max_message_timout: 300s",
        "envoy --mode validate",
    ),
    Mutation(
        "istio-cluster-port",
        "deploy/istio/envoyfilter.yaml",
        'cluster_name: "outbound|9002||',
        'cluster_name: "outbound|9003||',
        "Service pdproc has no port 9003",
    ),
    # Istio's Telemetry (1.28.0's CRD): targetRefs, which Istio's docs suggest for Gateway API
    # gateways, added next to the selector is refused by the CRD's CEL rule.
    Mutation(
        "istio-telemetry-selector-and-targetrefs",
        "deploy/istio/tracing/telemetry.yaml",
        "  tracing:\n",
        "  targetRefs:\n"
        "  - {kind: Gateway, group: gateway.networking.k8s.io, name: inference-gateway}\n"
        "  tracing:\n",
        "only one of targetRefs or selector can be set",
    ),
    Mutation(
        "istio-telemetry-selects-no-gateway",
        "deploy/istio/tracing/telemetry.yaml",
        "gateway-name: inference-gateway",
        "gateway-name: inference-gw",
        "selects Gateway 'inference-gw', which is not in this set",
    ),
    # --- pdproc's settings: names (docs/settings.md's settings table), values, budgets
    Mutation(
        "env-name-in-a-patch",
        "deploy/llm-d/common/kustomization.yaml",
        "- name: PDPROC_PREFILL_ALLOW",
        "- name: PDPROC_PREFIL_ALLOW",
        "env PDPROC_PREFIL_ALLOW is not a pdproc setting (did you mean PDPROC_PREFILL_ALLOW?)",
    ),
    Mutation(
        "drain-below-prefill-timeout",
        "deploy/kubernetes/base/deployment.yaml",
        'name: PDPROC_DRAIN_TIMEOUT\n          value: "61"',
        'name: PDPROC_DRAIN_TIMEOUT\n          value: "30"',
        "PDPROC_DRAIN_TIMEOUT 30 s must be >= PDPROC_PREFILL_TIMEOUT + 1 s (61 s)",
    ),
    Mutation(
        "grace-below-drain-budget",
        "deploy/kubernetes/base/deployment.yaml",
        "terminationGracePeriodSeconds: 75",
        "terminationGracePeriodSeconds: 45",
        "terminationGracePeriodSeconds 45 must be >= PDPROC_SHUTDOWN_DELAY + "
        "PDPROC_DRAIN_TIMEOUT + trace flush + 1 s (5 + 61 + 5 + 1 = 72)",
    ),
    Mutation(
        "eg-message-timeout",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "messageTimeout: 65s",
        "messageTimeout: 10s",
        "must be >= PDPROC_PREFILL_TIMEOUT",
    ),
    Mutation(
        "cpu-limit",
        "deploy/kubernetes/base/deployment.yaml",
        "          limits:\n            memory: 2Gi",
        '          limits:\n            cpu: "2"\n            memory: 2Gi',
        "pdproc has a CPU limit (2) above its request",
    ),
    Mutation(
        "inflight-bytes-past-the-memory-limit",
        "deploy/kubernetes/base/deployment.yaml",
        'value: "469762048"',
        'value: "536870912"',
        "PDPROC_MAX_INFLIGHT_BYTES 536870912 exceeds (memory limit 2Gi - 256Mi) / 4",
    ),
    Mutation(
        "pdb-min-available",
        "deploy/kubernetes/base/pdb.yaml",
        "maxUnavailable: 1",
        "minAvailable: 1",
        "use maxUnavailable: 1",
    ),
    Mutation(
        "no-zone-spread",
        "deploy/kubernetes/base/deployment.yaml",
        "topologyKey: topology.kubernetes.io/zone",
        "topologyKey: topology.kubernetes.io/region",
        "no topologySpreadConstraint over topology.kubernetes.io/zone",
    ),
    Mutation(
        "metrics-on-every-address",
        "deploy/kubernetes/base/deployment.yaml",
        'value: "$(POD_IP):9090"',
        'value: "0.0.0.0:9090"',
        "PDPROC_METRICS_LISTEN 0.0.0.0:9090 binds every address",
    ),
    # --- the endpoint picker: pinned release, its flags, HA, Pod Security
    Mutation(
        "epp-unknown-flag",
        "deploy/llm-d/common/epp.yaml",
        "        - --secure-serving=false\n",
        "        - --secure-serving=false\n        - --metrics-endpoint-auth=false\n",
        "has no flag --metrics-endpoint-auth",
    ),
    Mutation(
        "epp-other-release",
        "deploy/llm-d/common/epp.yaml",
        "llm-d-inference-scheduler:v0.3.2",
        "llm-d-inference-scheduler:v0.3.0",
        "pin that tag",
    ),
    Mutation(
        "epp-probe-without-leader-service",
        "deploy/llm-d/common/epp.yaml",
        "            service: readiness",
        "            service: inference-extension",
        "the readinessProbe must ask gRPC service 'readiness'",
    ),
    Mutation(
        "epp-replicas-without-leader-election",
        "deploy/llm-d/common/epp.yaml",
        "        - --ha-enable-leader-election\n",
        "",
        "several EPP replicas need --ha-enable-leader-election",
    ),
    # GIE v1.0.0 answers health checks on the ext_proc port only with --health-checking,
    # and Envoy Gateway's active check probes that port.
    Mutation(
        "epp-health-check-without-health-service",
        "deploy/llm-d/common/epp.yaml",
        "        - --health-checking\n",
        "",
        "answers health checks only with --health-checking",
    ),
    Mutation(
        "epp-pod-security",
        "deploy/llm-d/common/epp.yaml",
        "allowPrivilegeEscalation: false",
        "allowPrivilegeEscalation: true",
        "Pod Security 'restricted' rejects it: container epp: allowPrivilegeEscalation",
    ),
    Mutation(
        "eg-epp-default-stream-limit",
        "deploy/llm-d/envoy-gateway/envoyextensionpolicy.yaml",
        "maxParallelRequests: 100000",
        "maxParallelRequests: 1024",
        "extProc[0] (vllm-pd-epp) backendSettings.circuitBreaker.maxParallelRequests is 1024",
    ),
    # --- paths, the kv guard, NetworkPolicy: the edge's security
    Mutation(
        "eg-escaped-slashes-kept",
        "deploy/envoy-gateway/gateway.yaml",
        "escapedSlashesAction: UnescapeAndForward",
        "escapedSlashesAction: KeepUnchanged",
        "path: set escapedSlashesAction",
    ),
    Mutation(
        "istio-slashes-not-merged",
        "deploy/istio/envoyfilter.yaml",
        "merge_slashes: true",
        "merge_slashes: false",
        "path normalisation: merge_slashes is not true",
    ),
    Mutation(
        "eg-metadata-namespace",
        "deploy/envoy-gateway/envoyextensionpolicy.yaml",
        "      writableNamespaces:\n      - pdproc",
        "      writableNamespaces:\n      - pdproc-x",
        "metadata.writableNamespaces must include pdproc",
    ),
    Mutation(
        "eg-lua-before-ext-proc",
        "deploy/envoy-gateway/gateway.yaml",
        "    after: envoy.filters.http.ext_proc",
        "    before: envoy.filters.http.ext_proc",
        "the kv guard (Lua) would run before ext_proc",
    ),
    Mutation(
        "istio-ext-proc-stats-not-exposed",
        "deploy/istio/gateway.yaml",
        '.ext_proc\\\\..*"',
        '.rbac\\\\..*"',
        "Istio keeps the ext_proc counters out of /stats/prometheus",
    ),
    Mutation(
        "lua-guard-edited-by-hand",
        "deploy/istio/envoyfilter.yaml",
        "kv_transfer_params = true,",
        "kv_transfer_param = true,",
        "embedded Lua differs from pdproc/envoy_config/*.lua",
    ),
    Mutation(
        "networkpolicy-open-grpc",
        "deploy/istio/networkpolicy.yaml",
        "  - from:\n    - podSelector:\n        matchLabels:\n"
        "          gateway.networking.k8s.io/gateway-name: inference-gateway\n",
        "  - from: []\n",
        "port grpc is open to every source",
    ),
    # --- TLS between the gateway and pdproc, autoscaling (deploy/examples)
    Mutation(
        "eg-tls-without-backendtlspolicy",
        "deploy/examples/envoy-gateway-production/kustomization.yaml",
        "- ../../envoy-gateway/tls\n",
        "",
        "pdproc serves TLS but no BackendTLSPolicy targets Service pdproc",
    ),
    Mutation(
        "istio-tls-without-client-certificate",
        "deploy/istio/tls/kustomization.yaml",
        "mode: MUTUAL",
        "mode: SIMPLE",
        "tls mode must be MUTUAL",
    ),
    Mutation(
        "tls-name-not-on-the-certificate",
        "deploy/envoy-gateway/tls/backendtlspolicy.yaml",
        "hostname: pdproc.inference.svc.cluster.local",
        "hostname: pdproc.other.svc.cluster.local",
        "verifies the name pdproc.other.svc.cluster.local, which Certificate pdproc-server",
    ),
    Mutation(
        "hpa-and-fixed-replicas",
        "deploy/kubernetes/components/hpa/kustomization.yaml",
        "    - op: remove\n      path: /spec/replicas",
        "    - op: add\n      path: /spec/minReadySeconds\n      value: 0",
        "an HPA scales it: drop spec.replicas",
    ),
    # --- monitoring
    Mutation(
        "promql-syntax",
        "deploy/monitoring/prometheusrule.yaml",
        "        > 0.05",
        "        > > 0.05",
        "PromQL does not parse",
    ),
    Mutation(
        "promql-unknown-metric",
        "deploy/monitoring/prometheusrule.yaml",
        'pdproc_prefill_breaker_open{job="pdproc"}',
        'pdproc_prefill_breakers_open{job="pdproc"}',
        "unknown metric pdproc_prefill_breakers_open",
    ),
    Mutation(
        "dashboard-without-namespace-variable",
        "deploy/grafana/pdproc-dashboard.json",
        '"name": "namespace"',
        '"name": "ns"',
        "no $namespace template variable",
    ),
    Mutation(
        "compose-envoy-image",
        "docker-compose.yaml",
        "envoyproxy/envoy:v1.40-latest",
        "envoyproxy/envoy:v1.30-latest",
        "envoyproxy/envoy:v1.40",
    ),
    # The simulator once built pdproc's default stage under pdproc's image.
    Mutation(
        "compose-sim-default-stage",
        "docker-compose.yaml",
        "      target: sim\n",
        "",
        "sim must build the Dockerfile's sim stage",
    ),
    Mutation(
        "compose-sim-shares-pdproc-image",
        "docker-compose.yaml",
        "${PDPROC_SIM_IMAGE:-pdproc-sim:dev}",
        "${PDPROC_SIM_IMAGE:-pdproc:dev}",
        "sim and pdproc share the image pdproc:dev",
    ),
    Mutation(
        "compose-top-level-name",
        "docker-compose.yaml",
        "\nservices:\n",
        "\nname: pdproc\nservices:\n",
        "top-level 'name': Compose v1",
    ),
]


def copy_repo(dest: Path) -> None:
    shutil.copytree(REPO / "deploy", dest / "deploy")
    (dest / "docs").mkdir()
    for name in COPIED:
        shutil.copy2(REPO / name, dest / name)
    lua = REPO / "pdproc" / "envoy_config"
    if any(lua.glob("*.lua")):
        (dest / "pdproc" / "envoy_config").mkdir(parents=True)
        for path in lua.glob("*.lua"):
            shutil.copy2(path, dest / "pdproc" / "envoy_config" / path.name)


def run_validator(repo: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    python = venv() / "bin" / "python"
    argv = [str(python), str(VALIDATOR), "--repo", str(repo)]
    argv += ["--kubectl", str(venv() / "bin" / "kubectl"), "--envoy", str(venv() / "bin" / "envoy")]
    if pdproc_cli():
        argv += ["--pdproc", str(pdproc_cli())]
    return subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture(scope="module")
def script_run() -> subprocess.CompletedProcess[str]:
    if shutil.which("bash") is None:
        pytest.skip("bash is needed to run scripts/validate-deploy.sh")
    env = {**os.environ, "PYTHON": sys.executable}
    if pdproc_cli():
        env["PDPROC"] = str(pdproc_cli())
    return subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env, check=False
    )


@pytest.fixture(scope="module")
def mutation_runs(
    request: pytest.FixtureRequest,
    script_run: subprocess.CompletedProcess[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every selected mutation, two validator runs at a time (each run is a few seconds)."""
    if script_run.returncode != 0 or not (venv() / "bin" / "python").is_file():
        pytest.fail("validate-deploy.sh did not pass:\n" + script_run.stdout + script_run.stderr)

    # Only the mutations whose test cases were selected (`-k`): each run costs seconds.
    wanted = {
        item.callspec.params["mutation"].id
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.function is test_validator_catches
    }
    selected = [m for m in MUTATIONS if m.id in wanted]
    # Folders made here, not in the threads: pytest's temp factory is not thread-safe (two
    # threads setting up its base folder at once made one of them fail).
    roots = {m.id: tmp_path_factory.mktemp(m.id) for m in selected}

    def run(m: Mutation) -> subprocess.CompletedProcess[str]:
        root = roots[m.id]
        copy_repo(root)
        target = root / m.path
        text = target.read_text("utf-8")
        assert m.old in text, f"mutation {m.id} no longer applies to {m.path}"
        target.write_text(text.replace(m.old, m.new, 1), "utf-8")
        return run_validator(root)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip([m.id for m in selected], pool.map(run, selected), strict=True))


def test_deploy_manifests_pass(script_run: subprocess.CompletedProcess[str]) -> None:
    out = script_run.stdout
    assert script_run.returncode == 0, out + script_run.stderr
    assert "PASSED: 0 error(s)" in out
    for check in (
        "schema: core objects",
        "schema: custom resources",
        "schema: CEL rules evaluated",
        "render: kustomizations rendered",
        "envoy: configs validated",
        "envoy: EnvoyFilters applied to an Istio 1.28 gateway model",
        "promql: rules parsed",
        "promql: dashboard queries parsed",
    ):
        assert check in out, f"{check!r} did not run:\n{out}"


# The first of these tests sets up mutation_runs: every mutation's validator run (two at a
# time, a few seconds each on an idle machine). pytest-timeout's 300 s covers that set-up too,
# which a machine shared by several test runs exceeded; this is a bound, not a measurement.
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.id for m in MUTATIONS])
def test_validator_catches(
    mutation_runs: dict[str, subprocess.CompletedProcess[str]], mutation: Mutation
) -> None:
    proc = mutation_runs[mutation.id]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failures = [line for line in proc.stdout.splitlines() if "FAIL " in line]
    assert any(mutation.expected in line for line in failures), proc.stdout
    if mutation.forbidden:
        assert not any(mutation.forbidden in line for line in failures), proc.stdout


@pytest.mark.parametrize("tool", ["kubectl", "envoy"])
def test_missing_tool_fails(
    script_run: subprocess.CompletedProcess[str], tmp_path: Path, tool: str
) -> None:
    """Without kubectl (patches unapplied) or Envoy (typed_config unchecked) it fails."""
    copy_repo(tmp_path)
    proc = run_validator(tmp_path, f"--{tool}", str(tmp_path / "nowhere" / tool))
    assert proc.returncode == 1, proc.stdout
    assert f"FAIL  {tool}: not found" in proc.stdout, proc.stdout
    assert "PASSED" not in proc.stdout


def test_overlay_refuses_the_placeholder_allow_list(
    script_run: subprocess.CompletedProcess[str], tmp_path: Path
) -> None:
    """--overlay (your own kustomization): the shipped placeholder for the prefill pods' CIDR
    fails loudly until it is set, and images must be pinned by digest."""
    copy_repo(tmp_path)
    overlay = tmp_path / "site"
    overlay.mkdir()
    base = (
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources:\n- ../deploy/llm-d/istio\n"
    )
    (overlay / "kustomization.yaml").write_text(base, "utf-8")
    proc = run_validator(tmp_path, "--overlay", str(overlay))
    assert proc.returncode == 1
    assert "is still the placeholder 'UNSET/set-the-prefill-pods-CIDR'" in proc.stdout, proc.stdout
    assert "is not pinned by digest" in proc.stdout

    digest = "sha256:" + "0" * 64
    (overlay / "kustomization.yaml").write_text(
        base
        + "images:\n"
        + f"- name: ghcr.io/pdproc/pdproc\n  digest: {digest}\n"
        + f"- name: ghcr.io/llm-d/llm-d-inference-scheduler\n  digest: {digest}\n"
        + "patches:\n- patch: |-\n    apiVersion: apps/v1\n    kind: Deployment\n"
        + "    metadata: {name: pdproc}\n    spec:\n      template:\n        spec:\n"
        + "          containers:\n          - name: pdproc\n            env:\n"
        + '            - {name: PDPROC_PREFILL_ALLOW, value: "10.0.0.0/16"}\n',
        "utf-8",
    )
    proc = run_validator(tmp_path, "--overlay", str(overlay))
    assert "still the placeholder" not in proc.stdout, proc.stdout
    assert "pinned by digest" not in proc.stdout, proc.stdout
    assert proc.returncode == 0, proc.stdout
