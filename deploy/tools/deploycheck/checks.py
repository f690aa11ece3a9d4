"""Cross-checks on one rendered kustomization: the things no schema can see, and the ones
that matter most for pdproc (timeouts that must agree across pdproc and the gateway, the
drain budget, the endpoint picker's flags, who may reach which port)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .report import Doc, Report

DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|m|s|ms))+$")
QUANTITY_RE = re.compile(r"^(\d+(?:\.\d+)?)([EPTGMK]i|[EPTGMkm])?$")
QUANTITY_UNITS: dict[str | None, float] = {
    None: 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "E": 1e18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
PDPROC = "pdproc"  # the container (and Deployment) name
# The OTLP exporter's timeout when OTEL_EXPORTER_OTLP_TIMEOUT is unset (seconds).
OTLP_TIMEOUT_DEFAULT = 10.0
# Placeholder values the manifests ship for site-specific settings: pdproc refuses them at
# startup (a `/` makes them an invalid CIDR), and --overlay mode refuses to pass them.
PLACEHOLDER = "UNSET/"
# Memory per in-flight request-body byte inside pdproc (the received body and the legs built
# from it: 1.1-1.7x for bodies held, measured by scripts/measure_memory.py at 1-16 MiB and
# c=16/64; up to 2.9x the budget in a burst refused at it, tests/e2e/test_memory_budget.py;
# planned with headroom) and the process baseline; used to keep PDPROC_MAX_INFLIGHT_BYTES
# inside the container's memory limit.
INFLIGHT_MEMORY_FACTOR = 4
PROCESS_BASELINE_BYTES = 256 * 2**20
RAISED_LIMIT = 100000  # circuit-breaker limits in the manifests (Envoy's default: 1024)


def seconds(value: str) -> float:
    """A Go/Gateway API duration such as 65s, 1m30s or 300ms, in seconds."""
    if not DURATION_RE.match(value):
        raise ValueError(f"not a duration: {value!r}")
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", value):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def quantity(value: Any) -> float:
    if isinstance(value, int | float):
        return float(value)
    match = QUANTITY_RE.match(str(value))
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    return float(match.group(1)) * QUANTITY_UNITS[match.group(2)]


@dataclass(frozen=True)
class Context:
    """What the checks know beyond the rendered objects."""

    env_names: frozenset[str]  # pdproc's environment variables (docs/settings.md)
    metric_names: frozenset[str]  # pdproc's metrics (docs/observability.md)
    epp: dict[str, Any]  # deploy/schemas/epp.json
    site: bool  # --overlay mode: placeholders and unpinned images are errors


def of_kind(docs: list[Doc], *kinds: str) -> list[Doc]:
    return [d for d in docs if d.kind in kinds]


def pod_spec(w: Doc) -> dict[str, Any]:
    return dict(w.spec.get("template", {}).get("spec") or {})


def pod_labels(w: Doc) -> dict[str, str]:
    return dict(w.spec.get("template", {}).get("metadata", {}).get("labels") or {})


def containers(w: Doc) -> list[dict[str, Any]]:
    spec = pod_spec(w)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def container_ports(w: Doc) -> dict[str, int]:
    return {
        p["name"]: p["containerPort"]
        for c in pod_spec(w).get("containers", [])
        for p in c.get("ports", [])
        if "name" in p
    }


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container.get("env", []) if "name" in e}


def pdproc_container(docs: list[Doc]) -> tuple[Doc, dict[str, Any]] | None:
    for doc in docs:
        if doc.kind == "Deployment" and doc.name == PDPROC:
            for c in pod_spec(doc).get("containers", []):
                if c.get("name") == PDPROC:
                    return doc, c
    return None


def selector_matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def label_selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A metav1.LabelSelector (matchLabels and matchExpressions) against labels."""
    match_labels = selector.get("matchLabels") or {}
    if any(labels.get(key) != value for key, value in match_labels.items()):
        return False
    expressions = selector.get("matchExpressions") or []
    return all(_expression_matches(expr, labels) for expr in expressions)


def _label_in(key: str, values: list[Any], labels: dict[str, str]) -> bool:
    return labels.get(key) in values


def _label_not_in(key: str, values: list[Any], labels: dict[str, str]) -> bool:
    return labels.get(key) not in values


def _label_exists(key: str, values: list[Any], labels: dict[str, str]) -> bool:
    return key in labels


def _label_does_not_exist(key: str, values: list[Any], labels: dict[str, str]) -> bool:
    return key not in labels


# matchExpressions operators; an operator not listed here constrains nothing.
_SELECTOR_OPERATORS: dict[str, Callable[[str, list[Any], dict[str, str]], bool]] = {
    "In": _label_in,
    "NotIn": _label_not_in,
    "Exists": _label_exists,
    "DoesNotExist": _label_does_not_exist,
}


def _expression_matches(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    key, op, values = expr["key"], expr["operator"], expr.get("values", [])
    requirement = _SELECTOR_OPERATORS.get(op)
    return requirement is None or requirement(key, values, labels)


def check_set(name: str, docs: list[Doc], ctx: Context, report: Report) -> None:
    index = {(d.kind, d.name): d for d in docs}
    workloads = [d for d in docs if d.kind in WORKLOADS]
    checks: list[Callable[[list[Doc], dict[tuple[str, str], Doc], Context, Report], None]] = [
        _selectors_and_probes,
        _env_references,
        _pod_security,
        _pdproc_env_names,
        _pdproc_shutdown_budget,
        _pdproc_resources,
        _pdproc_placement,
        _service_target_ports,
        _disruption_budgets,
        _replicas_and_budgets,
        _gateway_policies,
        _envoy_gateways,
        _routes_and_pools,
        _istio_gateways,
        _envoy_filters,
        _destination_rule_hosts,
        _telemetry_gateways,
        _epp,
        _network_policies,
        _tls_files,
        _tls_envoy_gateway,
        _tls_istio,
        _monitoring,
        _placeholders,
    ]
    for check in checks:
        check(docs, index, ctx, report)
    report.ok("refs: kustomizations cross-checked")
    report.ok("refs: workloads cross-checked", len(workloads))


# ------------------------------------------------------------------------------ workloads


def _selectors_and_probes(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    for w in (d for d in docs if d.kind in WORKLOADS):
        selector = w.spec.get("selector", {}).get("matchLabels", {})
        if not selector_matches(selector, pod_labels(w)):
            report.error(w.where, "spec.selector does not match the pod template labels")
        ports = container_ports(w)
        for c in containers(w):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    port = ((c.get(probe) or {}).get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        report.error(w.where, f"{probe} uses port {port!r}, not a container port")


_VARIABLE_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def _env_references(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """$(VAR) in env values and args expands only variables defined EARLIER in env."""
    for w in (d for d in docs if d.kind in WORKLOADS):
        for c in containers(w):
            defined: set[str] = set()
            for e in c.get("env", []):
                for ref in _VARIABLE_REF.findall(str(e.get("value", ""))):
                    if ref not in defined:
                        report.error(
                            w.where,
                            f"container {c['name']}: env {e['name']} uses $({ref}), which is "
                            "not defined before it (Kubernetes leaves it unexpanded)",
                        )
                defined.add(e["name"])
            for arg in [*c.get("args", []), *c.get("command", [])]:
                for ref in _VARIABLE_REF.findall(str(arg)):
                    if ref not in defined:
                        report.error(w.where, f"container {c['name']}: $({ref}) is not in env")


# Volume types the "restricted" Pod Security Standard allows.
_RESTRICTED_VOLUMES = frozenset(
    {
        "name",
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)


def _pod_security(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """The Pod Security Standard "restricted" (v1.30+), as the admission plugin applies it."""
    for w in (d for d in docs if d.kind in WORKLOADS):
        spec = pod_spec(w)
        pod_sc = spec.get("securityContext") or {}
        problems = _pod_level_problems(spec)
        for c in containers(w):
            problems += _container_security_problems(c, pod_sc)
        for problem in problems:
            report.error(w.where, f"Pod Security 'restricted' rejects it: {problem}")


def _pod_level_problems(spec: dict[str, Any]) -> list[str]:
    problems = [f"{key} is set" for key in ("hostNetwork", "hostPID", "hostIPC") if spec.get(key)]
    for v in spec.get("volumes", []):
        if set(v) - _RESTRICTED_VOLUMES:
            problems.append(f"volume {v.get('name')} has a type restricted forbids")
    return problems


def _container_security_problems(c: dict[str, Any], pod_sc: dict[str, Any]) -> list[str]:
    sc = c.get("securityContext") or {}
    label = f"container {c.get('name')}"
    problems = [*_privilege_problems(sc), *_identity_problems(sc, pod_sc)]
    return [f"{label}: {problem}" for problem in problems]


def _privilege_problems(sc: dict[str, Any]) -> list[str]:
    """Escalation and Linux capabilities of one container's securityContext."""
    capabilities = sc.get("capabilities") or {}
    problems = []
    if sc.get("allowPrivilegeEscalation") is not False:
        problems.append("allowPrivilegeEscalation must be false")
    if "ALL" not in (capabilities.get("drop") or []):
        problems.append("capabilities.drop must include ALL")
    added = set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}
    if added:
        problems.append(f"adds capabilities {sorted(added)}")
    return problems


def _identity_problems(sc: dict[str, Any], pod_sc: dict[str, Any]) -> list[str]:
    """User, seccomp profile and privileged mode (the container's, else the pod's)."""
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    problems = []
    if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
        problems.append("runAsNonRoot must be true (pod or container)")
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        problems.append("runAsUser 0")
    seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
    if seccomp not in ("RuntimeDefault", "Localhost"):
        problems.append("seccompProfile must be RuntimeDefault or Localhost")
    if sc.get("privileged"):
        problems.append("privileged")
    return problems


# ------------------------------------------------------------------------------ pdproc


def _pdproc_env_names(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    found = pdproc_container(docs)
    if found is None:
        return
    w, c = found
    env = env_of(c)
    helpers = {ref for value in env.values() for ref in _VARIABLE_REF.findall(str(value or ""))}
    for name in env:
        if name in ctx.env_names or name.startswith("OTEL_") or name in helpers:
            continue
        close = [n for n in ctx.env_names if _distance(n, name) <= 2]
        hint = f" (did you mean {close[0]}?)" if close else ""
        report.error(
            w.where,
            f"env {name} is not a pdproc setting{hint}: pdproc ignores it "
            "(the settings table in docs/settings.md lists them)",
        )


def _env_number(w: Doc, env: dict[str, Any], key: str, default: float, report: Report) -> float:
    try:
        return float(env.get(key) or default)
    except ValueError:
        report.error(w.where, f"env {key}={env.get(key)!r} is not a number")
        return default


def _pdproc_shutdown_budget(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    found = pdproc_container(docs)
    if found is None:
        return
    w, c = found
    env = env_of(c)
    prefill = _env_number(w, env, "PDPROC_PREFILL_TIMEOUT", 60, report)
    drain = _env_number(w, env, "PDPROC_DRAIN_TIMEOUT", 30, report)
    delay = _env_number(w, env, "PDPROC_SHUTDOWN_DELAY", 2, report)
    # The tracer provider's shutdown flushes the queued spans; each export waits at most the
    # OTLP exporter's timeout (OTEL_EXPORTER_OTLP_TIMEOUT, which the Python exporter reads in
    # seconds; 10 by default).
    flush = _env_number(w, env, "OTEL_EXPORTER_OTLP_TIMEOUT", OTLP_TIMEOUT_DEFAULT, report)
    grace = pod_spec(w).get("terminationGracePeriodSeconds", 30)
    if drain < prefill + 1:
        report.error(
            w.where,
            f"PDPROC_DRAIN_TIMEOUT {drain:g} s must be >= PDPROC_PREFILL_TIMEOUT + 1 s "
            f"({prefill + 1:g} s): a prefill started just before SIGTERM (and the decode held "
            "for it) must be able to finish",
        )
    if grace < delay + drain + flush + 1:
        report.error(
            w.where,
            f"terminationGracePeriodSeconds {grace} must be >= PDPROC_SHUTDOWN_DELAY + "
            f"PDPROC_DRAIN_TIMEOUT + trace flush + 1 s ({delay:g} + {drain:g} + {flush:g} + 1 "
            f"= {delay + drain + flush + 1:g}): the kubelet kills what is still running then",
        )


def _pdproc_resources(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    found = pdproc_container(docs)
    if found is None:
        return
    w, c = found
    resources = c.get("resources") or {}
    _pdproc_cpu_limit(w, resources, report)
    _pdproc_inflight_budget(w, env_of(c), resources.get("limits") or {}, ctx, report)


def _pdproc_cpu_limit(w: Doc, resources: dict[str, Any], report: Report) -> None:
    cpu_limit = (resources.get("limits") or {}).get("cpu")
    cpu_request = (resources.get("requests") or {}).get("cpu")
    if cpu_limit is not None and quantity(cpu_limit) != quantity(cpu_request or 0):
        report.error(
            w.where,
            f"pdproc has a CPU limit ({cpu_limit}) above its request: CFS throttling stalls "
            "the event loop (and every held decode) in bursts; drop the limit or set it equal",
        )


def _pdproc_inflight_budget(
    w: Doc, env: dict[str, Any], limits: dict[str, Any], ctx: Context, report: Report
) -> None:
    """PDPROC_MAX_INFLIGHT_BYTES set, and inside the container's memory limit."""
    memory = limits.get("memory")
    inflight = env.get("PDPROC_MAX_INFLIGHT_BYTES")
    if "PDPROC_MAX_INFLIGHT_BYTES" not in ctx.env_names or memory is None:
        return
    if inflight is None:
        report.error(w.where, "PDPROC_MAX_INFLIGHT_BYTES is unset: in-flight bodies are unbounded")
        return
    budget = (quantity(memory) - PROCESS_BASELINE_BYTES) / INFLIGHT_MEMORY_FACTOR
    if quantity(inflight) > budget:
        report.error(
            w.where,
            f"PDPROC_MAX_INFLIGHT_BYTES {inflight} exceeds (memory limit {memory} - "
            f"256Mi) / {INFLIGHT_MEMORY_FACTOR} = {int(budget)}",
        )


def _pdproc_placement(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    found = pdproc_container(docs)
    if found is None:
        return
    w, c = found
    metrics = str(env_of(c).get("PDPROC_METRICS_LISTEN") or "")
    if metrics.startswith(("0.0.0.0:", "[::]:", ":")):
        report.error(
            w.where,
            f"PDPROC_METRICS_LISTEN {metrics} binds every address: bind the pod IP "
            "($(POD_IP) from status.podIP), which kubelet probes and scrapes use",
        )
    zones = [
        t
        for t in pod_spec(w).get("topologySpreadConstraints", [])
        if t.get("topologyKey") == "topology.kubernetes.io/zone"
    ]
    if not zones:
        report.error(w.where, "no topologySpreadConstraint over topology.kubernetes.io/zone")


def _distance(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


# ------------------------------------------------------------------------------ services


def _service_target_ports(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """A Service's named targetPort is a port of every workload it selects."""
    workloads = of_kind(docs, *WORKLOADS)
    for svc in of_kind(docs, "Service"):
        selector = svc.spec.get("selector", {})
        for w in workloads:
            if selector_matches(selector, pod_labels(w)):
                _target_ports_of(svc, w, report)


def _target_ports_of(svc: Doc, w: Doc, report: Report) -> None:
    ports = container_ports(w)
    for p in svc.spec.get("ports", []):
        target = p.get("targetPort", p.get("port"))
        if isinstance(target, str) and target not in ports:
            report.error(svc.where, f"targetPort {target!r} is not a port of {w.name}")


def _selected_by(pdb: Doc, w: Doc) -> bool:
    return label_selector_matches(pdb.spec.get("selector", {}), pod_labels(w))


def _disruption_budgets(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    workloads = of_kind(docs, *WORKLOADS)
    for pdb in of_kind(docs, "PodDisruptionBudget"):
        matched = [w for w in workloads if _selected_by(pdb, w)]
        if not matched:
            report.error(pdb.where, "selector matches no workload in this set")
        if "minAvailable" in pdb.spec:
            report.error(
                pdb.where,
                "use maxUnavailable: 1 (minAvailable blocks node drains whenever the "
                "Deployment is scaled down to it, e.g. by an HPA)",
            )


def _scaled_by_hpa(docs: list[Doc], w: Doc) -> bool:
    return any(
        d.spec.get("scaleTargetRef", {}).get("name") == w.name
        for d in of_kind(docs, "HorizontalPodAutoscaler")
    )


def _replicas_and_budgets(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """Several replicas (or an HPA) need a PodDisruptionBudget; an HPA, no spec.replicas."""
    budgets = of_kind(docs, "PodDisruptionBudget")
    for w in of_kind(docs, *WORKLOADS):
        has_hpa = _scaled_by_hpa(docs, w)
        several = w.spec.get("replicas", 1) > 1 or has_hpa
        if several and not any(_selected_by(pdb, w) for pdb in budgets):
            report.error(w.where, "several replicas but no PodDisruptionBudget")
        if has_hpa and "replicas" in w.spec:
            report.error(w.where, "an HPA scales it: drop spec.replicas (each apply resets it)")


def _service_port(
    index: dict[tuple[str, str], Doc],
    report: Report,
    where: str,
    svc_name: str,
    port: Any,
    namespace: str | None = None,
) -> Doc | None:
    svc = index.get(("Service", svc_name))
    if svc is None:
        report.error(where, f"Service {svc_name} is not in this set")
        return None
    if namespace and svc.namespace and namespace != svc.namespace:
        report.error(where, f"Service {svc_name} is in namespace {svc.namespace}, not {namespace}")
    if port not in [p.get("port") for p in svc.spec.get("ports", [])]:
        report.error(where, f"Service {svc_name} has no port {port}")
    return svc


# ------------------------------------------------------------------------------ gateways


def _pdproc_settings(docs: list[Doc]) -> dict[str, float]:
    found = pdproc_container(docs)
    env = env_of(found[1]) if found else {}
    return {
        "max_body": float(env.get("PDPROC_MAX_BODY_BYTES") or 16 * 2**20),
        "prefill_timeout": float(env.get("PDPROC_PREFILL_TIMEOUT") or 60),
        "max_message": float(env.get("PDPROC_ENVOY_MAX_MESSAGE_TIMEOUT") or 300),
    }


def _gateway_policies(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    settings = _pdproc_settings(docs)
    for pol in (
        d for d in docs if str(d.obj.get("apiVersion", "")).startswith("gateway.envoyproxy.io/")
    ):
        for ref in pol.spec.get("targetRefs", []):
            if (ref["kind"], ref["name"]) not in index:
                report.error(pol.where, f"targetRef {ref['kind']}/{ref['name']} is not in this set")
        ext_procs = pol.spec.get("extProc", [])
        for i, ext in enumerate(ext_procs):
            _ext_proc_backends(pol, i, ext, index, report)
            names = [ref["name"] for ref in ext.get("backendRefs", [])]
            if PDPROC in names:
                _pdproc_ext_proc(
                    pol, i, ext, last=i + 1 == len(ext_procs), settings=settings, report=report
                )
        if pol.kind == "ClientTrafficPolicy":
            _client_traffic_policy(pol, settings, report)


def _ext_proc_backends(
    pol: Doc, i: int, ext: dict[str, Any], index: dict[tuple[str, str], Doc], report: Report
) -> None:
    names = [ref["name"] for ref in ext.get("backendRefs", [])]
    for ref in ext.get("backendRefs", []):
        if ref.get("kind", "Service") == "Service":
            _service_port(
                index,
                report,
                f"{pol.where} extProc[{i}]",
                ref["name"],
                ref.get("port"),
                ref.get("namespace"),
            )
    breaker = (ext.get("backendSettings") or {}).get("circuitBreaker") or {}
    for key in ("maxConnections", "maxPendingRequests", "maxParallelRequests"):
        if breaker.get(key, 1024) < RAISED_LIMIT:
            report.error(
                pol.where,
                f"extProc[{i}] ({', '.join(names)}) backendSettings.circuitBreaker."
                f"{key} is {breaker.get(key, '1024 (default)')}: every in-flight "
                f"request holds one gRPC stream; raise it to {RAISED_LIMIT}",
            )


def _pdproc_ext_proc(
    pol: Doc,
    i: int,
    ext: dict[str, Any],
    *,
    last: bool,
    settings: dict[str, float],
    report: Report,
) -> None:
    timeout = seconds(ext.get("messageTimeout", "200ms"))
    if timeout < settings["prefill_timeout"] + 1:
        report.error(
            pol.where,
            f"extProc[{i}] messageTimeout {timeout:g}s must be >= "
            f"PDPROC_PREFILL_TIMEOUT + 1 s ({settings['prefill_timeout'] + 1:g}s): "
            "Envoy Gateway sets no max_message_timeout",
        )
    mode = ext.get("processingMode", {})
    if mode.get("request", {}).get("body") != "Buffered" or "response" not in mode:
        report.error(
            pol.where,
            f"extProc[{i}] pdproc needs request body Buffered and response headers",
        )
    if "pdproc" not in ((ext.get("metadata") or {}).get("writableNamespaces") or []):
        report.error(
            pol.where,
            f"extProc[{i}] metadata.writableNamespaces must include pdproc: the "
            "guard after ext_proc reads pdproc.body_checked from it",
        )
    if not last:
        report.error(
            pol.where,
            f"extProc[{i}] pdproc must be the last processor (after the endpoint "
            "picker, whose headers it reads)",
        )
    _pdproc_backend_buffer(pol, i, ext, report)


def _pdproc_backend_buffer(pol: Doc, i: int, ext: dict[str, Any], report: Report) -> None:
    limit = ((ext.get("backendSettings") or {}).get("connection") or {}).get("bufferLimit")
    if limit is None or quantity(limit) > PDPROC_CLUSTER_BUFFER_LIMIT:
        report.error(
            pol.where,
            f"extProc[{i}] backendSettings.connection.bufferLimit is "
            f"{limit or '1 MiB (default)'}: above 64Ki one client's tiny HTTP/2 frames can "
            "flood the connection to pdproc and reset every other stream on it",
        )


def _client_traffic_policy(pol: Doc, settings: dict[str, float], report: Report) -> None:
    limit = (pol.spec.get("connection") or {}).get("bufferLimit")
    if limit is not None and quantity(limit) < settings["max_body"]:
        report.error(
            pol.where,
            f"connection.bufferLimit {limit} is below PDPROC_MAX_BODY_BYTES "
            f"({settings['max_body']:g})",
        )
    path = pol.spec.get("path") or {}
    if path.get("disableMergeSlashes") or path.get("escapedSlashesAction") not in (
        "UnescapeAndForward",
        "UnescapeAndRedirect",
        "RejectRequest",
    ):
        report.error(
            pol.where,
            "path: set escapedSlashesAction UnescapeAndForward (or UnescapeAndRedirect, "
            "RejectRequest) and keep slashes merged, so /v1%2Fchat%2Fcompletions or "
            "//v1/... cannot reach the decode without pdproc",
        )


def _envoy_gateways(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    lua = any(d.spec.get("lua") for d in of_kind(docs, "EnvoyExtensionPolicy"))
    for gw in gateways_of_class(docs, "eg"):
        if lua and not _lua_after_ext_proc(gw, index):
            report.error(
                gw.where,
                "the kv guard (Lua) would run before ext_proc (Envoy Gateway's default "
                "order): reference an EnvoyProxy with filterOrder lua after ext_proc",
            )
        ctps = [p for p in of_kind(docs, "ClientTrafficPolicy") if _targets(p, "Gateway", gw.name)]
        if not ctps:
            report.error(
                gw.where,
                "no ClientTrafficPolicy (buffer limit, path normalisation) targets this Gateway",
            )


def gateways_of_class(docs: list[Doc], gateway_class: str) -> list[Doc]:
    return [d for d in of_kind(docs, "Gateway") if d.spec.get("gatewayClassName") == gateway_class]


def _targets(policy: Doc, kind: str, name: str) -> bool:
    """Whether a policy's spec.targetRefs names the object kind/name."""
    return any(
        r.get("kind") == kind and r.get("name") == name for r in policy.spec.get("targetRefs", [])
    )


def _lua_after_ext_proc(gw: Doc, index: dict[tuple[str, str], Doc]) -> bool:
    ref = (gw.spec.get("infrastructure") or {}).get("parametersRef") or {}
    proxy = (
        index.get(("EnvoyProxy", str(ref.get("name")))) if ref.get("kind") == "EnvoyProxy" else None
    )
    order = (proxy.spec.get("filterOrder") if proxy else None) or []
    return any(
        o.get("name") == "envoy.filters.http.lua"
        and o.get("after") == "envoy.filters.http.ext_proc"
        for o in order
    )


def _routes_and_pools(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    for route in of_kind(docs, "HTTPRoute"):
        _route_references(route, index, report)
    for pool in of_kind(docs, "InferencePool"):
        epp = pool.spec["endpointPickerRef"]
        _service_port(index, report, pool.where, epp["name"], epp.get("port", {}).get("number"))


def _route_references(route: Doc, index: dict[tuple[str, str], Doc], report: Report) -> None:
    """An HTTPRoute's parent Gateways and InferencePool backends are in the set."""
    for parent in route.spec.get("parentRefs", []):
        if ("Gateway", parent["name"]) not in index:
            report.error(route.where, f"parent Gateway {parent['name']} is not in this set")
    for rule in route.spec.get("rules", []):
        for ref in rule.get("backendRefs", []):
            kind = ref.get("kind", "Service")
            if kind == "InferencePool" and ("InferencePool", ref["name"]) not in index:
                report.error(route.where, f"InferencePool {ref['name']} is not in this set")


# The label Istio puts on the pods it deploys for a Gateway API Gateway.
GATEWAY_NAME_LABEL = "gateway.networking.k8s.io/gateway-name"


def _istio_gateways(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    for gw in (
        d for d in docs if d.kind == "Gateway" and d.spec.get("gatewayClassName") == "istio"
    ):
        annotations = (gw.spec.get("infrastructure") or {}).get("annotations") or {}
        if "ext_proc" not in str(annotations.get("proxy.istio.io/config", "")):
            report.error(
                gw.where,
                "Istio keeps the ext_proc counters out of /stats/prometheus: add a "
                "proxyStatsMatcher for them (infrastructure.annotations proxy.istio.io/config), "
                "or the fail-open alerts see nothing",
            )


def _envoy_filters(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    settings = _pdproc_settings(docs)
    for ef in (d for d in docs if d.kind == "EnvoyFilter"):
        cluster_limits: dict[str, int] = {}
        pdproc_clusters: list[str] = []
        for patch in ef.spec.get("configPatches", []):
            value = patch.get("patch", {}).get("value", {})
            typed = value.get("typed_config", {})
            if typed.get("@type", "").endswith("ext_proc.v3.ExternalProcessor"):
                _istio_ext_proc(ef, typed, settings, index, report)
                pdproc_clusters.append(_grpc_cluster(typed))
            limit = value.get("per_connection_buffer_limit_bytes")
            if limit is None:
                continue
            if patch.get("applyTo") == "CLUSTER":
                name = ((patch.get("match") or {}).get("cluster") or {}).get("name", "")
                cluster_limits[name] = int(limit)
            elif int(limit) < settings["max_body"]:
                report.error(
                    ef.where,
                    f"per_connection_buffer_limit_bytes {limit} is below PDPROC_MAX_BODY_BYTES "
                    f"({settings['max_body']:g})",
                )
        for cluster in pdproc_clusters:
            _pdproc_cluster_buffer(ef, cluster, cluster_limits.get(cluster), report)


# Past this much queued for pdproc on its one HTTP/2 connection, Envoy stops reading from the
# clients feeding it: a client's tiny DATA frames then reach pdproc coalesced instead of
# tripping Envoy's outbound flood guard, which would reset every other stream on it.
PDPROC_CLUSTER_BUFFER_LIMIT = 65536


def _grpc_cluster(typed: dict[str, Any]) -> str:
    return str(typed.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name", ""))


def _pdproc_cluster_buffer(ef: Doc, cluster: str, limit: int | None, report: Report) -> None:
    if limit is None:
        report.error(
            ef.where,
            f"no CLUSTER MERGE of per_connection_buffer_limit_bytes for {cluster!r}: Envoy's "
            "1 MiB default lets one client's tiny HTTP/2 frames flood the connection to pdproc "
            "and reset every other stream on it",
        )
    elif limit > PDPROC_CLUSTER_BUFFER_LIMIT:
        report.error(
            ef.where,
            f"{cluster!r} per_connection_buffer_limit_bytes {limit} is above "
            f"{PDPROC_CLUSTER_BUFFER_LIMIT}: tiny HTTP/2 frames can flood the connection to pdproc",
        )
    else:
        report.ok("istio: pdproc's cluster queues at most 64 KiB per connection")


def _istio_ext_proc(
    ef: Doc,
    typed: dict[str, Any],
    settings: dict[str, float],
    index: dict[tuple[str, str], Doc],
    report: Report,
) -> None:
    cluster = typed.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name", "")
    match = re.fullmatch(r"outbound\|(\d+)\|\|([^.]+)\.([^.]+)\.svc\.cluster\.local", cluster)
    if not match:
        report.error(ef.where, f"cluster_name {cluster!r} is not an Istio outbound cluster")
    else:
        _service_port(index, report, ef.where, match.group(2), int(match.group(1)), match.group(3))
    if "max_message_timeout" in typed:
        mmt = seconds(typed["max_message_timeout"])
        if mmt != settings["max_message"]:
            report.error(
                ef.where,
                f"max_message_timeout {mmt:g}s differs from "
                f"PDPROC_ENVOY_MAX_MESSAGE_TIMEOUT ({settings['max_message']:g}s)",
            )
        if mmt < settings["prefill_timeout"] + 1:
            report.error(ef.where, "max_message_timeout is below the prefill timeout + 1 s")
    receiving = ((typed.get("metadata_options") or {}).get("receiving_namespaces") or {}).get(
        "untyped"
    ) or []
    if "pdproc" not in receiving:
        report.error(
            ef.where,
            "metadata_options.receiving_namespaces.untyped must include pdproc "
            "(pdproc.body_checked)",
        )


def _destination_rule_hosts(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    for dr in of_kind(docs, "DestinationRule"):
        match = re.fullmatch(r"([^.]+)\.([^.]+)\.svc\.cluster\.local", dr.spec["host"])
        if match and ("Service", match.group(1)) not in index:
            report.error(dr.where, f"host {dr.spec['host']} names no Service in this set")


def _telemetry_gateways(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """A Telemetry that selects no gateway pods is accepted by Istio and traces nothing."""
    gateways = {(d.name, d.namespace) for d in of_kind(docs, "Gateway")}
    for tel in of_kind(docs, "Telemetry"):
        for gateway in _gateways_named_by(tel):
            if (str(gateway), tel.namespace) not in gateways:
                report.error(
                    tel.where,
                    f"selects Gateway {gateway!r}, which is not in this set in namespace "
                    f"{tel.namespace or '(none)'}: it would trace nothing",
                )


def _gateways_named_by(tel: Doc) -> list[Any]:
    """The Gateways a Telemetry selects: by the gateway-name pod label, then by targetRefs."""
    labels = (tel.spec.get("selector") or {}).get("matchLabels") or {}
    named = [labels[GATEWAY_NAME_LABEL]] if GATEWAY_NAME_LABEL in labels else []
    named += [
        ref.get("name") for ref in tel.spec.get("targetRefs") or [] if ref.get("kind") == "Gateway"
    ]
    return named


# ------------------------------------------------------------------------------ EPP


def _epp(docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report) -> None:
    image = ctx.epp["image"]
    for w in (d for d in docs if d.kind in WORKLOADS):
        for c in pod_spec(w).get("containers", []):
            ref = str(c.get("image", ""))
            if not ref.startswith(image + ":") and not ref.startswith(image + "@"):
                continue
            args = [str(a) for a in c.get("args", [])]
            _epp_image_and_flags(w, ref, args, ctx, report)
            _epp_leader_election(docs, w, c, args, report)
            if w.spec.get("strategy", {}).get("type") == "Recreate":
                report.error(
                    w.where,
                    "strategy Recreate takes every picker down on a rollout "
                    "(FailClose: every request fails)",
                )
            _epp_health_checked(docs, w, args, report)


def _epp_image_and_flags(w: Doc, ref: str, args: list[str], ctx: Context, report: Report) -> None:
    name = ref.split("@")[0]
    tag = name.rpartition(":")[2] if name.count(":") else ""
    # A digest without a tag (kustomize images: digest:) is a stronger pin.
    if tag != ctx.epp["tag"] and not (tag == "" and "@sha256:" in ref):
        report.error(
            w.where,
            f"EPP image {ref}: the flags and RBAC here are those of {ctx.epp['repo']} "
            f"{ctx.epp['tag']} (GIE {ctx.epp['gie_tag']}); pin that tag",
        )
    flags = set(ctx.epp["flags"])
    for arg in args:
        if arg.startswith("-"):
            flag = arg.lstrip("-").split("=", 1)[0]
            if flag not in flags:
                report.error(
                    w.where,
                    f"EPP arg {arg}: {ctx.epp['repo']} {ctx.epp['tag']} (GIE "
                    f"{ctx.epp['gie_tag']}) has no flag --{flag}; the EPP exits at "
                    "startup",
                )


def _epp_leader_election(
    docs: list[Doc], w: Doc, c: dict[str, Any], args: list[str], report: Report
) -> None:
    leader = flag_enabled(args, "ha-enable-leader-election")
    replicas = w.spec.get("replicas", 1)
    if replicas > 1 and not leader:
        report.error(
            w.where,
            "several EPP replicas need --ha-enable-leader-election (one active picker)",
        )
    if not leader:
        return
    for probe, service in (("livenessProbe", "liveness"), ("readinessProbe", "readiness")):
        got = ((c.get(probe) or {}).get("grpc") or {}).get("service")
        if got != service:
            report.error(
                w.where,
                f"with leader election the {probe} must ask gRPC service {service!r} (got {got!r})",
            )
    sa = pod_spec(w).get("serviceAccountName", "default")
    if not _grants(docs, sa, "coordination.k8s.io", "leases", {"get", "create", "update"}):
        report.error(
            w.where,
            f"leader election: ServiceAccount {sa} may not get/create/update leases",
        )


def _epp_health_checked(docs: list[Doc], w: Doc, args: list[str], report: Report) -> None:
    """Envoy Gateway's active gRPC health check probes the ext_proc port itself; GIE v1.0.0
    registers a health service there only with --health-checking. Without it every picker
    replica is unhealthy and traffic flows only through Envoy's panic threshold."""
    if flag_enabled(args, "health-checking"):
        return
    services = _services_selecting(docs, pod_labels(w))
    for policy in of_kind(docs, "EnvoyExtensionPolicy"):
        for ext in policy.spec.get("extProc", []):
            refs = {r.get("name") for r in ext.get("backendRefs", [])}
            if _grpc_health_checked(ext) and refs & services:
                report.error(
                    policy.where,
                    f"the gRPC health check of {sorted(refs & services)} probes the ext_proc "
                    f"port, which answers health checks only with --health-checking on "
                    f"{w.where}",
                )


def flag_enabled(args: list[str], flag: str) -> bool:
    """A boolean command-line flag given (--flag, -flag or --flag=...) and not =false."""
    return any(a.lstrip("-").startswith(flag) and not a.endswith("=false") for a in args)


def _services_selecting(docs: list[Doc], labels: dict[str, str]) -> set[str]:
    """Names of the Services whose (non-empty) selector picks pods with these labels."""
    return {
        d.name
        for d in of_kind(docs, "Service")
        if (d.spec.get("selector") or {})
        and (d.spec.get("selector") or {}).items() <= labels.items()
    }


def _grpc_health_checked(ext: dict[str, Any]) -> bool:
    """An extProc entry with an active gRPC health check on its backends."""
    active = ((ext.get("backendSettings") or {}).get("healthCheck") or {}).get("active")
    if not active:
        return False
    return bool(active.get("type") == "GRPC")


def _grants(docs: list[Doc], sa: str, group: str, resource: str, verbs: set[str]) -> bool:
    for binding in of_kind(docs, "RoleBinding", "ClusterRoleBinding"):
        if not _binds_service_account(binding, sa):
            continue
        role = _bound_role(docs, binding)
        rules = role.obj.get("rules", []) if role else []
        if any(_rule_grants(rule, group, resource, verbs) for rule in rules):
            return True
    return False


def _binds_service_account(binding: Doc, sa: str) -> bool:
    return any(
        s.get("kind") == "ServiceAccount" and s.get("name") == sa
        for s in binding.obj.get("subjects", [])
    )


def _bound_role(docs: list[Doc], binding: Doc) -> Doc | None:
    role_ref = binding.obj.get("roleRef", {})
    return next(
        (d for d in docs if d.kind == role_ref.get("kind") and d.name == role_ref.get("name")),
        None,
    )


def _rule_grants(rule: dict[str, Any], group: str, resource: str, verbs: set[str]) -> bool:
    return (
        group in rule.get("apiGroups", [])
        and resource in rule.get("resources", [])
        and verbs <= set(rule.get("verbs", []))
    )


# ------------------------------------------------------------------------------ network


def _network_policies(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    found = pdproc_container(docs)
    if found is None or not of_kind(docs, "Gateway"):
        return  # the gateway overlays own the NetworkPolicy (they know the gateway's pods)
    w, _ = found
    labels = pod_labels(w)
    ports = container_ports(w)
    policies = [
        d
        for d in of_kind(docs, "NetworkPolicy")
        if label_selector_matches(d.spec.get("podSelector", {}), labels)
    ]
    if not policies:
        report.error(
            w.where,
            "no NetworkPolicy selects the pdproc pods (only the gateway may reach gRPC, "
            "only monitoring the metrics)",
        )
        return
    allowed: dict[str, list[list[dict[str, Any]]]] = {}
    for pol in policies:
        if "Ingress" in pol.spec.get("policyTypes", ["Ingress"]):
            _ingress_rules(pol, ports, allowed, report)
    _open_to_every_source(policies[0], allowed, report)
    for needed in ("grpc", "metrics"):
        if needed in ports and needed not in allowed:
            report.error(policies[0].where, f"no ingress rule for pdproc's {needed} port")


def _open_to_every_source(
    first: Doc, allowed: dict[str, list[list[dict[str, Any]]]], report: Report
) -> None:
    """An ingress rule with no `from`, or with an empty peer, admits everyone to its ports."""
    for name, sources in allowed.items():
        for peers in sources:
            if not peers or any(not peer for peer in peers):
                report.error(first.where, f"port {name} is open to every source")


def _ingress_rules(
    pol: Doc,
    ports: dict[str, int],
    allowed: dict[str, list[list[dict[str, Any]]]],
    report: Report,
) -> None:
    """Adds to `allowed` the sources each pdproc port (by name) is open to."""
    for rule in pol.spec.get("ingress", []):
        if not rule.get("ports"):
            report.error(pol.where, "an ingress rule without ports opens every port")
        for p in rule.get("ports", []):
            port = p.get("port")
            name = (
                port
                if isinstance(port, str)
                else next((n for n, v in ports.items() if v == port), str(port))
            )
            if isinstance(port, str) and port not in ports:
                report.error(pol.where, f"port {port!r} is not a pdproc container port")
            allowed.setdefault(name, []).append(rule.get("from", []))


# ------------------------------------------------------------------------------ TLS


def _tls_files(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """The certificate files pdproc reads must come from a mounted volume."""
    found = pdproc_container(docs)
    if found is None:
        return
    w, c = found
    env = env_of(c)
    mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
    for key in ("PDPROC_TLS_CERT", "PDPROC_TLS_KEY", "PDPROC_TLS_CLIENT_CA"):
        path = str(env.get(key) or "")
        if path and not any(path.startswith(m) for m in mounts):
            report.error(w.where, f"{key}={path} is on no mounted volume")


def _tls_envoy_gateway(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """pdproc serving TLS (PDPROC_TLS_CERT) and the gateway speaking it must go together, as
    must a required client certificate (PDPROC_TLS_CLIENT_CA) and the gateway presenting one."""
    found = pdproc_container(docs)
    if found is None or not gateways_of_class(docs, "eg"):
        return
    w, c = found
    tls, mtls = _pdproc_tls(c)
    policies = [d for d in of_kind(docs, "BackendTLSPolicy") if _targets(d, "Service", PDPROC)]
    _backend_tls_agrees(w, policies, tls, report)
    if mtls and not _proxy_presents_client_certificate(docs):
        report.error(
            w.where,
            "pdproc requires a client certificate but the EnvoyProxy sets no "
            "backendTLS.clientCertificateRef",
        )
    for pol in policies:
        _check_server_name(
            docs, pol, str(pol.spec.get("validation", {}).get("hostname", "")), report
        )


def _pdproc_tls(c: dict[str, Any]) -> tuple[bool, bool]:
    """Whether pdproc serves TLS, and whether it requires a client certificate."""
    env = env_of(c)
    return bool(env.get("PDPROC_TLS_CERT")), bool(env.get("PDPROC_TLS_CLIENT_CA"))


def _proxy_presents_client_certificate(docs: list[Doc]) -> bool:
    return any(
        ((d.spec.get("backendTLS") or {}).get("clientCertificateRef") or {}).get("name")
        for d in of_kind(docs, "EnvoyProxy")
    )


def _backend_tls_agrees(w: Doc, policies: list[Doc], tls: bool, report: Report) -> None:
    if tls and not policies:
        report.error(
            w.where,
            "pdproc serves TLS but no BackendTLSPolicy targets Service pdproc: the "
            "gateway would speak cleartext to it",
        )
    if policies and not tls:
        report.error(
            policies[0].where,
            "BackendTLSPolicy for pdproc, but pdproc serves cleartext (no PDPROC_TLS_CERT)",
        )


def _tls_istio(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    """The same agreement through Istio's DestinationRule for pdproc."""
    found = pdproc_container(docs)
    if found is None or not gateways_of_class(docs, "istio"):
        return
    tls, mtls = _pdproc_tls(found[1])
    for dr in of_kind(docs, "DestinationRule"):
        if dr.spec.get("host", "").startswith("pdproc."):
            settings = (dr.spec.get("trafficPolicy") or {}).get("tls") or {}
            _destination_rule_tls_agrees(dr, settings.get("mode", "DISABLE"), tls, mtls, report)
            if settings.get("sni"):
                _check_server_name(docs, dr, str(settings["sni"]), report)


def _destination_rule_tls_agrees(dr: Doc, mode: str, tls: bool, mtls: bool, report: Report) -> None:
    if tls and mode not in ("SIMPLE", "MUTUAL"):
        report.error(dr.where, f"pdproc serves TLS but the DestinationRule's tls mode is {mode}")
    if mtls and mode != "MUTUAL":
        report.error(
            dr.where,
            "pdproc requires a client certificate: tls mode must be MUTUAL (with credentialName)",
        )
    if not tls and mode in ("SIMPLE", "MUTUAL"):
        report.error(dr.where, f"tls mode {mode}, but pdproc serves cleartext (no PDPROC_TLS_CERT)")


def _check_server_name(docs: list[Doc], where: Doc, name: str, report: Report) -> None:
    """The name the gateway verifies must be on pdproc's server certificate (if the set
    issues it with cert-manager)."""
    volumes = []
    found = pdproc_container(docs)
    if found is not None:
        volumes = [
            v.get("secret", {}).get("secretName") for v in pod_spec(found[0]).get("volumes", [])
        ]
    for cert in (
        d for d in docs if d.kind == "Certificate" and d.spec.get("secretName") in volumes
    ):
        if name not in cert.spec.get("dnsNames", []):
            report.error(
                where.where,
                f"verifies the name {name}, which Certificate {cert.name} does not carry",
            )


# ------------------------------------------------------------------------------ monitoring


def _monitoring(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    workloads = [d for d in docs if d.kind in WORKLOADS]
    for pm in (d for d in docs if d.kind == "PodMonitor"):
        selected = [
            w
            for w in workloads
            if label_selector_matches(pm.spec.get("selector", {}), pod_labels(w))
        ]
        for w in selected:
            ports = container_ports(w)
            for ep in pm.spec.get("podMetricsEndpoints", []):
                if ep.get("port") and ep["port"] not in ports:
                    report.error(pm.where, f"port {ep['port']!r} is not a port of {w.name}")


# ------------------------------------------------------------------------------ placeholders


def _placeholders(
    docs: list[Doc], index: dict[tuple[str, str], Doc], ctx: Context, report: Report
) -> None:
    for doc in docs:
        for path, value in _strings(doc.obj, ""):
            if PLACEHOLDER in value:
                if ctx.site:
                    report.error(
                        doc.where,
                        f"{path} is still the placeholder {value!r}: set it for your cluster",
                    )
                else:
                    report.ok("placeholders: example values pdproc refuses until set")
        if ctx.site and doc.kind in WORKLOADS:
            for c in containers(doc):
                if "@sha256:" not in str(c.get("image", "")):
                    report.error(
                        doc.where,
                        f"container {c.get('name')}: image {c.get('image')} is not pinned "
                        "by digest (kustomize images: digest:)",
                    )


def _strings(node: Any, path: str) -> list[tuple[str, str]]:
    if isinstance(node, str):
        return [(path or "(root)", node)]
    if isinstance(node, dict):
        return [
            item for k, v in node.items() for item in _strings(v, f"{path}.{k}" if path else str(k))
        ]
    if isinstance(node, list):
        return [item for i, v in enumerate(node) for item in _strings(v, f"{path}[{i}]")]
    return []
