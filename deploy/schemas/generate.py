"""Regenerate the vendored CRD schemas in deploy/schemas/ from the upstream CRDs.

    python deploy/schemas/generate.py --mirror DIR

DIR holds git clones (bare or not) of the upstream repositories below, each as
DIR/<owner>+<name> or DIR/<owner>+<name>/repo (e.g. `git clone --bare
<github url of envoyproxy/gateway> DIR/envoyproxy+gateway`). Each CRD is read with
`git show <tag>:<path>` at the exact tag listed in SOURCES, so the output depends on nothing
but those tags. The validator (deploy/tools/validate.py) never runs this: CI has no network
and uses the JSON written here.

Conversion of each CRD version's openAPIV3Schema into a JSON Schema (draft 2020-12):
  - strict: every structural object node that lists `properties` (or lists none and does not
    preserve unknown fields) gets `additionalProperties: false`, as the API server's strict
    field validation rejects unknown fields; `x-kubernetes-preserve-unknown-fields` keeps a
    node open. Nodes inside allOf/anyOf/oneOf/not are value validations only and stay open.
  - `metadata` becomes a strict ObjectMeta subset (name, namespace, labels, annotations...);
  - `x-kubernetes-int-or-string` becomes integer-or-string, `nullable` admits null,
    OpenAPI 3.0 boolean `exclusiveMinimum`/`exclusiveMaximum` become draft 2020-12 numbers;
  - descriptions are dropped (size); `default`, `x-kubernetes-validations` (CEL rules, which
    the validator evaluates), `x-kubernetes-list-type` and `x-kubernetes-list-map-keys` are
    kept; a `pattern` Python's `re` cannot compile is dropped and counted in sources.json.

Output: deploy/schemas/<set>/<group>/<kind lowercase>_<version>.json (minified, sorted keys)
and deploy/schemas/sources.json (sets, tags, commits, file hashes, kinds).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Source:
    set_name: str  # directory under deploy/schemas/
    repo: str  # owner/name on GitHub
    tag: str
    paths: tuple[str, ...]  # CRD files at that tag
    kinds: tuple[str, ...]  # "group/version/Kind" to vendor


EG_FILES = (
    "charts/gateway-helm/crds/generated/gateway.envoyproxy.io_envoyextensionpolicies.yaml",
    "charts/gateway-helm/crds/generated/gateway.envoyproxy.io_clienttrafficpolicies.yaml",
    "charts/gateway-helm/crds/generated/gateway.envoyproxy.io_backendtrafficpolicies.yaml",
    "charts/gateway-helm/crds/generated/gateway.envoyproxy.io_envoyproxies.yaml",
)
EG_KINDS = (
    "gateway.envoyproxy.io/v1alpha1/EnvoyExtensionPolicy",
    "gateway.envoyproxy.io/v1alpha1/ClientTrafficPolicy",
    "gateway.envoyproxy.io/v1alpha1/BackendTrafficPolicy",
    "gateway.envoyproxy.io/v1alpha1/EnvoyProxy",
)
GWAPI_FILES = tuple(
    f"config/crd/standard/gateway.networking.k8s.io_{name}.yaml"
    for name in ("gateways", "httproutes", "backendtlspolicies", "referencegrants")
)
GWAPI_KINDS = (
    "gateway.networking.k8s.io/v1/Gateway",
    "gateway.networking.k8s.io/v1/HTTPRoute",
    "gateway.networking.k8s.io/v1/BackendTLSPolicy",
    "gateway.networking.k8s.io/v1beta1/ReferenceGrant",
)
PROM_FILES = tuple(
    f"example/prometheus-operator-crd/monitoring.coreos.com_{name}.yaml"
    for name in ("podmonitors", "servicemonitors", "prometheusrules")
)

SOURCES = (
    Source("envoy-gateway-v1.6.0", "envoyproxy/gateway", "v1.6.0", EG_FILES, EG_KINDS),
    Source("envoy-gateway-v1.7.0", "envoyproxy/gateway", "v1.7.0", EG_FILES, EG_KINDS),
    # v1.4.0: what Envoy Gateway v1.6 and Istio 1.28 are built against; v1.4.1: EG v1.7.
    Source("gateway-api-v1.4.0", "kubernetes-sigs/gateway-api", "v1.4.0", GWAPI_FILES, GWAPI_KINDS),
    Source("gateway-api-v1.4.1", "kubernetes-sigs/gateway-api", "v1.4.1", GWAPI_FILES, GWAPI_KINDS),
    Source(
        "istio-1.28.0",
        "istio/istio",
        "1.28.0",
        ("manifests/charts/base/files/crd-all.gen.yaml",),
        (
            "networking.istio.io/v1alpha3/EnvoyFilter",
            "networking.istio.io/v1/DestinationRule",
            "security.istio.io/v1/PeerAuthentication",
            "telemetry.istio.io/v1/Telemetry",
        ),
    ),
    Source(
        "gateway-api-inference-extension-v1.0.0",
        "kubernetes-sigs/gateway-api-inference-extension",
        "v1.0.0",
        ("config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",),
        ("inference.networking.k8s.io/v1/InferencePool",),
    ),
    Source(
        "prometheus-operator-v0.87.1",
        "prometheus-operator/prometheus-operator",
        "v0.87.1",
        PROM_FILES,
        (
            "monitoring.coreos.com/v1/PodMonitor",
            "monitoring.coreos.com/v1/ServiceMonitor",
            "monitoring.coreos.com/v1/PrometheusRule",
        ),
    ),
    Source(
        "cert-manager-v1.19.0",
        "cert-manager/cert-manager",
        "v1.19.0",
        (
            "deploy/crds/cert-manager.io_certificates.yaml",
            "deploy/crds/cert-manager.io_issuers.yaml",
        ),
        ("cert-manager.io/v1/Certificate", "cert-manager.io/v1/Issuer"),
    ),
)

# The ObjectMeta fields a manifest may carry (metav1.ObjectMeta); CRD schemas say only
# `type: object` for metadata, and the API server checks it as ObjectMeta.
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 253},
        "generateName": {"type": "string"},
        "namespace": {"type": "string", "maxLength": 63},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
        "finalizers": {"type": "array", "items": {"type": "string"}},
        "ownerReferences": {"type": "array", "items": {"type": "object"}},
        "uid": {"type": "string"},
        "resourceVersion": {"type": "string"},
        "generation": {"type": "integer"},
        "creationTimestamp": {"type": ["string", "null"]},
        "deletionTimestamp": {"type": ["string", "null"]},
        "deletionGracePeriodSeconds": {"type": "integer"},
        "managedFields": {"type": "array", "items": {"type": "object"}},
    },
}
KEEP = {
    "type",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "enum",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "uniqueItems",
    "default",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "x-kubernetes-validations",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
    "x-kubernetes-embedded-resource",
}


class Stats:
    def __init__(self) -> None:
        self.dropped_patterns: list[str] = []
        self.rules = 0


def convert(node: dict[str, Any], stats: Stats, *, structural: bool, where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in KEEP:
            converted = _convert_key(key, value, stats, structural=structural, where=where)
            if converted is not _DROPPED:
                out[key] = converted
    _kubernetes_extensions(node, out)
    if (
        structural
        and node.get("type") == "object"
        and not node.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in node
    ):
        out["additionalProperties"] = False
    return out


_DROPPED = object()  # a keyword left out of the converted schema


def _convert_key(key: str, value: Any, stats: Stats, *, structural: bool, where: str) -> Any:
    if key == "properties":
        return {
            name: convert(sub, stats, structural=structural, where=f"{where}.{name}")
            for name, sub in value.items()
        }
    if key in ("items", "additionalProperties", "not") and isinstance(value, dict):
        return convert(value, stats, structural=structural and key != "not", where=where)
    if key in ("allOf", "anyOf", "oneOf"):
        return [convert(v, stats, structural=False, where=where) for v in value]
    if key == "pattern":
        # Go's RE2 takes a flag group anywhere; Python only at the start.
        value = re.sub(r"^\^\(\?([a-z]+)\)", r"(?\1)^", value)
        try:
            re.compile(value)
        except re.error:
            stats.dropped_patterns.append(f"{where}: {value}")
            return _DROPPED
    if key == "x-kubernetes-validations":
        stats.rules += len(value)
    return value


def _kubernetes_extensions(node: dict[str, Any], out: dict[str, Any]) -> None:
    """OpenAPI v3 / Kubernetes spellings rewritten as JSON Schema 2020-12 says them."""
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [])
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}, *out["anyOf"]]
    if node.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(key), bool):
            if out[key] and bound in out:
                out[key] = out.pop(bound)
            else:
                del out[key]


def crd_schema(version: dict[str, Any], kind: str, group: str, stats: Stats) -> dict[str, Any]:
    raw = version["schema"]["openAPIV3Schema"]
    schema = convert(raw, stats, structural=True, where=kind)
    props = schema.setdefault("properties", {})
    props["apiVersion"] = {"const": f"{group}/{version['name']}"}
    props["kind"] = {"const": kind}
    props["metadata"] = OBJECT_META
    schema["required"] = sorted({*schema.get("required", []), "apiVersion", "kind"})
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


# The endpoint picker release the llm-d manifests pin, and the GIE release it is built on
# (its go.mod): the picker's flags are GIE's cmd/epp/runner flags plus controller-runtime's
# (zap.Options.BindFlags, and the kubeconfig flag its config package registers).
EPP = {
    "image": "ghcr.io/llm-d/llm-d-inference-scheduler",
    "repo": "llm-d/llm-d-inference-scheduler",
    "tag": "v0.3.2",
    "gie_repo": "kubernetes-sigs/gateway-api-inference-extension",
    "gie_tag": "v1.0.0",
}
CONTROLLER_RUNTIME_FLAGS = (
    "kubeconfig",
    "zap-devel",
    "zap-encoder",
    "zap-log-level",
    "zap-stacktrace-level",
    "zap-time-encoding",
)


def epp_flags(mirror: Path) -> dict[str, Any]:
    llmd = git_dir(mirror, EPP["repo"])
    gomod = git(llmd, "show", f"{EPP['tag']}:go.mod")
    pinned = re.search(r"sigs.k8s.io/gateway-api-inference-extension (v\S+)", gomod)
    if not pinned or pinned.group(1) != EPP["gie_tag"]:
        raise SystemExit(f"{EPP['repo']} {EPP['tag']} is not built on GIE {EPP['gie_tag']}")
    gie = git_dir(mirror, EPP["gie_repo"])
    runner = git(gie, "show", f"{EPP['gie_tag']}:cmd/epp/runner/runner.go")
    flags = set(re.findall(r'flag\.[A-Za-z0-9]+\(\s*"([a-z0-9-]+)"', runner))
    return {
        **EPP,
        "commit": git(llmd, "rev-parse", f"{EPP['tag']}^{{commit}}").strip(),
        "gie_commit": git(gie, "rev-parse", f"{EPP['gie_tag']}^{{commit}}").strip(),
        "flags": sorted(flags | set(CONTROLLER_RUNTIME_FLAGS)),
    }


def git_dir(mirror: Path, repo: str) -> Path:
    base = mirror / repo.replace("/", "+")
    for candidate in (base / "repo", base):
        if (candidate / "HEAD").is_file() or (candidate / ".git").exists():
            return candidate
    raise SystemExit(f"no clone of {repo} under {mirror} (expected {base})")


def git(gdir: Path, *args: str) -> str:
    return subprocess.run(
        [
            "git",
            f"--git-dir={gdir}" if (gdir / "HEAD").is_file() else f"--git-dir={gdir}/.git",
            *args,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args(argv)
    lock: list[dict[str, Any]] = []
    for source in SOURCES:
        gdir = git_dir(args.mirror, source.repo)
        commit = git(gdir, "rev-parse", f"{source.tag}^{{commit}}").strip()
        stats = Stats()
        files = []
        wanted = set(source.kinds)
        written: list[str] = []
        set_dir = args.out / source.set_name
        for path in source.paths:
            text = git(gdir, "show", f"{source.tag}:{path}")
            files.append({"path": path, "sha256": hashlib.sha256(text.encode()).hexdigest()})
            for crd in yaml.safe_load_all(text):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
                for version in crd["spec"]["versions"]:
                    key = f"{group}/{version['name']}/{kind}"
                    if key not in wanted:
                        continue
                    schema = crd_schema(version, kind, group, stats)
                    target = set_dir / group / f"{kind.lower()}_{version['name']}.json"
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_text(
                        json.dumps(schema, sort_keys=True, separators=(",", ":")) + "\n", "utf-8"
                    )
                    written.append(key)
        missing = wanted - set(written)
        if missing:
            raise SystemExit(f"{source.set_name}: not found in the CRDs: {sorted(missing)}")
        lock.append(
            {
                "set": source.set_name,
                "repo": source.repo,
                "tag": source.tag,
                "commit": commit,
                "files": files,
                "kinds": sorted(written),
                "cel_rules": stats.rules,
                "dropped_patterns": stats.dropped_patterns,
            }
        )
        print(f"{source.set_name}: {len(written)} kinds, {stats.rules} CEL rules", file=sys.stderr)
    (args.out / "sources.json").write_text(json.dumps(lock, indent=2) + "\n", "utf-8")
    (args.out / "epp.json").write_text(json.dumps(epp_flags(args.mirror), indent=2) + "\n", "utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
