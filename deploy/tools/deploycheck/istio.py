"""EnvoyFilter patches applied to a model of an Istio 1.28 gateway's listener, so that Envoy
itself can validate the result (`envoy --mode validate`) and the validator can see what the
gateway would really run.

The model follows Istio 1.28's listener builder (pilot/pkg/networking/core/
listener_builder.go, buildHTTPConnectionManager): the HTTP filters a Gateway API gateway gets,
in order, and the connection manager settings Istio sets (path normalisation BASE:
normalize_path on, merge_slashes off, escaped slashes kept; stream_idle_timeout 0). A patch
whose match names a filter the gateway does not have is an error: Istio would silently skip
it, and pdproc would simply be missing from the chain."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

HCM = "envoy.filters.network.http_connection_manager"
HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
    "HttpConnectionManager"
)
EXT_PROC_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# A filter type upstream Envoy has, standing in for Istio's own filters (istio.stats ...)
# that only istio-proxy builds know.
STAND_IN_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation"
)

# (name, typed_config, condition): the HTTP filters of an Istio 1.28 Gateway API gateway.
# condition None: always there; else a key the caller provides (see gateway_filters()).
GATEWAY_FILTERS: tuple[tuple[str, dict[str, Any], str | None], ...] = (
    ("istio.metadata_exchange", {"@type": STAND_IN_TYPE}, None),
    (
        "envoy.filters.http.ext_proc",
        {"@type": EXT_PROC_TYPE, "grpc_service": {"envoy_grpc": {"cluster_name": "stand-in"}}},
        "inference_pool",
    ),
    (
        "envoy.filters.http.grpc_stats",
        {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.grpc_stats.v3.FilterConfig",
            "emit_filter_state": True,
        },
        None,
    ),
    ("istio.alpn", {"@type": STAND_IN_TYPE}, None),
    (
        "envoy.filters.http.fault",
        {"@type": "type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault"},
        None,
    ),
    (
        "envoy.filters.http.cors",
        {"@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"},
        None,
    ),
    ("istio.stats", {"@type": STAND_IN_TYPE}, None),
    (
        "envoy.filters.http.router",
        {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"},
        None,
    ),
)
# Filters Istio adds only for policies none of these manifests carry.
POLICY_FILTERS = {
    "envoy.filters.http.ext_authz": "an AuthorizationPolicy with action CUSTOM",
    "envoy.filters.http.jwt_authn": "a RequestAuthentication",
    "istio_authn": "a RequestAuthentication",
    "envoy.filters.http.rbac": "an AuthorizationPolicy",
}


class PatchError(ValueError):
    pass


@dataclass
class GatewayModel:
    filters: list[dict[str, Any]]
    hcm: dict[str, Any]
    listener: dict[str, Any]
    clusters: dict[str, dict[str, Any]]


def stub_cluster(name: str) -> dict[str, Any]:
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


def gateway_model(inference_pool: bool) -> GatewayModel:
    filters = [
        {"name": name, "typed_config": copy.deepcopy(typed)}
        for name, typed, condition in GATEWAY_FILTERS
        if condition is None or (condition == "inference_pool" and inference_pool)
    ]
    hcm = {
        "@type": HCM_TYPE,
        "stat_prefix": "outbound_0.0.0.0_80",
        # Istio 1.28 defaults for a gateway (mesh pathNormalization BASE).
        "normalize_path": True,
        "path_with_escaped_slashes_action": "KEEP_UNCHANGED",
        "stream_idle_timeout": "0s",
        "use_remote_address": False,
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {"match": {"prefix": "/"}, "route": {"cluster": "decode", "timeout": "0s"}}
                    ],
                }
            ]
        },
    }
    listener = {
        "name": "0.0.0.0_80",
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
    }
    clusters = {"decode": stub_cluster("decode")}
    if inference_pool:
        clusters["stand-in"] = stub_cluster("stand-in")
    return GatewayModel(filters, hcm, listener, clusters)


def proto_merge(base: dict[str, Any], patch: dict[str, Any]) -> None:
    """proto.Merge as Istio's MERGE does it: messages merge, repeated fields append,
    scalars replace."""
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            proto_merge(base[key], value)
        elif isinstance(value, list) and isinstance(base.get(key), list):
            base[key].extend(copy.deepcopy(value))
        else:
            base[key] = copy.deepcopy(value)


def apply_patches(doc: dict[str, Any], inference_pool: bool) -> GatewayModel:
    model = gateway_model(inference_pool)
    patches = list(enumerate(doc["spec"].get("configPatches", [])))
    # Istio patches the clusters it built from Services whatever the patch order; in the
    # model a cluster exists once a filter patch names it, so cluster patches go last.
    for i, patch in patches:
        if patch.get("applyTo") != "CLUSTER":
            _apply_patch(model, patch, f"configPatches[{i}]", inference_pool)
    for i, patch in patches:
        if patch.get("applyTo") == "CLUSTER":
            _apply_cluster_patch(model, patch, f"configPatches[{i}]")
    return model


def _apply_cluster_patch(model: GatewayModel, patch: dict[str, Any], where: str) -> None:
    """A CLUSTER MERGE into a cluster matched by its exact name. A name no cluster has is an
    error: Istio would skip the patch without a word."""
    match = patch.get("match") or {}
    if match.get("context", "ANY") not in ("GATEWAY", "ANY"):
        raise PatchError(f"{where}: context {match.get('context')} never applies to a gateway")
    name = (match.get("cluster") or {}).get("name")
    if patch["patch"]["operation"] != "MERGE" or not name:
        raise PatchError(f"{where}: the validator models only MERGE into a cluster matched by name")
    if name not in model.clusters:
        raise PatchError(f"{where}: no cluster {name!r} on the gateway (no filter calls it)")
    proto_merge(model.clusters[name], patch["patch"].get("value") or {})


def _apply_patch(
    model: GatewayModel, patch: dict[str, Any], where: str, inference_pool: bool
) -> None:
    match = patch.get("match") or {}
    if match.get("context", "ANY") not in ("GATEWAY", "ANY"):
        raise PatchError(f"{where}: context {match.get('context')} never applies to a gateway")
    op = patch["patch"]["operation"]
    value = copy.deepcopy(patch["patch"].get("value") or {})
    chain_filter = _matched_chain_filter(match)
    apply_to = patch["applyTo"]
    if apply_to == "HTTP_FILTER":
        _apply_http_filter_patch(model, op, chain_filter, value, where, inference_pool)
    elif apply_to == "NETWORK_FILTER":
        _apply_connection_manager_patch(model, op, chain_filter, value, where)
    elif apply_to == "LISTENER" and op == "MERGE":
        proto_merge(model.listener, value)
    else:
        raise PatchError(f"{where}: the validator cannot model {apply_to}/{op} patches")


def _matched_chain_filter(match: dict[str, Any]) -> dict[str, Any]:
    """match.listener.filterChain.filter ({} where any level is absent)."""
    listener = match.get("listener") or {}
    return dict((listener.get("filterChain") or {}).get("filter") or {})


def _apply_http_filter_patch(
    model: GatewayModel,
    op: str,
    chain_filter: dict[str, Any],
    value: dict[str, Any],
    where: str,
    inference_pool: bool,
) -> None:
    """An HTTP_FILTER patch; an ext_proc it adds gets a stub of the cluster it calls."""
    if chain_filter.get("name", HCM) != HCM:
        raise PatchError(f"{where}: HTTP filters live in {HCM}, not {chain_filter['name']}")
    sub = (chain_filter.get("subFilter") or {}).get("name")
    _patch_http_filter(model, op, sub, value, where, inference_pool)
    typed = value.get("typed_config") or {}
    cluster = ((typed.get("grpc_service") or {}).get("envoy_grpc") or {}).get("cluster_name")
    if cluster:
        model.clusters[cluster] = stub_cluster(cluster)


def _apply_connection_manager_patch(
    model: GatewayModel, op: str, chain_filter: dict[str, Any], value: dict[str, Any], where: str
) -> None:
    """A NETWORK_FILTER patch: only a MERGE into the HttpConnectionManager is modelled."""
    if chain_filter.get("name") != HCM or op != "MERGE":
        raise PatchError(f"{where}: the validator models only MERGE into {HCM}")
    typed = value.get("typed_config") or {}
    if typed.get("@type") not in (None, HCM_TYPE):
        raise PatchError(f"{where}: typed_config is not an HttpConnectionManager")
    proto_merge(model.hcm, {k: v for k, v in typed.items() if k != "@type"})


def _insert_before(filters: list[dict[str, Any]], at: int, value: dict[str, Any]) -> None:
    filters.insert(at, value)


def _insert_after(filters: list[dict[str, Any]], at: int, value: dict[str, Any]) -> None:
    filters.insert(at + 1, value)


def _replace(filters: list[dict[str, Any]], at: int, value: dict[str, Any]) -> None:
    filters[at] = value


def _remove(filters: list[dict[str, Any]], at: int, value: dict[str, Any]) -> None:
    del filters[at]


def _merge(filters: list[dict[str, Any]], at: int, value: dict[str, Any]) -> None:
    proto_merge(filters[at], value)


# What each operation relative to a subFilter does to the HTTP filter list.
RELATIVE_OPERATIONS: dict[str, Callable[[list[dict[str, Any]], int, dict[str, Any]], None]] = {
    "INSERT_BEFORE": _insert_before,
    "INSERT_AFTER": _insert_after,
    "REPLACE": _replace,
    "REMOVE": _remove,
    "MERGE": _merge,
}


def _patch_http_filter(
    model: GatewayModel,
    op: str,
    sub: str | None,
    value: dict[str, Any],
    where: str,
    inference_pool: bool,
) -> None:
    names = [f["name"] for f in model.filters]
    if op == "INSERT_FIRST":
        model.filters.insert(0, value)
        return
    if op == "ADD":
        raise PatchError(f"{where}: ADD appends after the router, where a filter never runs")
    if sub is None:
        raise PatchError(f"{where}: {op} needs match.listener.filterChain.filter.subFilter.name")
    if sub not in names:
        raise PatchError(
            f"{where}: subFilter {sub} {_why_absent(sub, inference_pool)} (the gateway has: "
            f"{', '.join(names)}); Istio would skip this patch silently"
        )
    operation = RELATIVE_OPERATIONS.get(op)
    if operation is None:
        raise PatchError(f"{where}: unknown operation {op}")
    operation(model.filters, names.index(sub), value)


def _why_absent(sub: str, inference_pool: bool) -> str:
    """Why the gateway model has no filter named `sub`."""
    if sub in POLICY_FILTERS:
        return f"exists only with {POLICY_FILTERS[sub]}, which this set does not have"
    if sub == "envoy.filters.http.ext_proc" and not inference_pool:
        return "exists only on a gateway with an HTTPRoute to an InferencePool"
    return "is not a filter of an Istio 1.28 gateway"


def bootstrap(model: GatewayModel) -> dict[str, Any]:
    hcm = copy.deepcopy(model.hcm)
    hcm["http_filters"] = model.filters
    listener = copy.deepcopy(model.listener)
    listener["filter_chains"] = [{"filters": [{"name": HCM, "typed_config": hcm}]}]
    return {
        "static_resources": {"listeners": [listener], "clusters": list(model.clusters.values())}
    }
