"""`pdproc envoy-config`: a complete Envoy bootstrap with pdproc in the filter chain.

The template (`envoy/bootstrap.yaml.tmpl`) carries the reasoning for every non-default
setting as comments; this module only fills in addresses and sizes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from string import Template

from pdproc.config import DEFAULT_PD_PATHS, MiB
from pdproc.envoy_messages import REQUEST_ATTRIBUTES
from pdproc.targets import HostPort, parse_host_port

_ACCESS_LOG = """\
          access_log:
          - name: envoy.access_loggers.stdout
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.access_loggers.stream.v3.StdoutAccessLog
              log_format:
                json_format:
                  start: "%START_TIME%"
                  method: "%REQ(:METHOD)%"
                  path: "%REQ(:PATH)%"
                  status: "%RESPONSE_CODE%"
                  details: "%RESPONSE_CODE_DETAILS%"
                  flags: "%RESPONSE_FLAGS%"
                  duration_ms: "%DURATION%"
                  upstream: "%UPSTREAM_HOST%"
                  request_id: "%REQ(X-REQUEST-ID)%"
                  pdproc_error: "%RESP(X-PDPROC-ERROR)%"
"""


# Single-message mode: the request-headers round trip is skipped. The endpoint picker's
# prefill header is moved into dynamic metadata before the router (which would otherwise
# strip it before pdproc sees the body), and what pdproc needs of the other headers comes as
# request_attributes with the body message.
_HEADER_TO_METADATA = (
    "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config"
)
_PREFILL_HEADER_FILTER = (
    """\
          # Single-message mode: keep the endpoint picker's prefill header for pdproc as
          # metadata (the router forwards the request headers before the body is processed).
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": """
    + _HEADER_TO_METADATA
    + """
              request_rules:
              - header: x-prefiller-host-port
                on_header_present: {metadata_namespace: pdproc, key: prefiller, type: STRING}
                remove: true"""
)

_SINGLE_MESSAGE_OPTIONS = """\
              # Single-message mode: what pdproc reads of the request headers, sent with the
              # body message (request_header_mode is SKIP).
              request_attributes: [{attributes}]
              metadata_options:
                forwarding_namespaces: {{untyped: [pdproc]}}"""


@dataclass(frozen=True)
class EnvoyOptions:
    listen: HostPort
    processor: Sequence[HostPort]
    decode: Sequence[HostPort]
    admin: HostPort
    pd_paths: Sequence[str] = DEFAULT_PD_PATHS
    max_body_bytes: int = 16 * MiB
    max_message_timeout_s: float = 300.0
    message_timeout_s: float = 10.0
    with_processor: bool = True  # False: Envoy alone (the benchmark's baseline)
    access_log: bool = False
    failure_mode_allow: bool = True
    # False: response_header_mode SKIP, so no hold and no clean abort once the decode has
    # answered (only for measuring what the hold costs).
    hold_response: bool = True
    # One ext_proc message on the request path instead of two (request headers SKIP).
    single_message: bool = False


def _cluster_type(targets: Sequence[HostPort]) -> str:
    """STATIC for IP literals; names (a headless Service, pod DNS) are re-resolved."""
    return "STATIC" if all(t.ip is not None for t in targets) else "STRICT_DNS"


def _endpoints(targets: Sequence[HostPort]) -> str:
    return "\n".join(
        f'        - endpoint: {{address: {{socket_address: {{address: "{t.host}", '
        f"port_value: {t.port}}}}}}}"
        for t in targets
    )


def _pd_routes(paths: Sequence[str]) -> str:
    routes = [
        f'              - match: {{path: "{path}"}}\n'
        "                route: {cluster: decode, timeout: 0s}"
        for path in paths
    ]
    header = "              # P/D paths (processed by pdproc); no route timeout: answers stream."
    return "\n".join([header, *routes])


def render(options: EnvoyOptions) -> str:
    template = Template(
        resources.files("pdproc").joinpath("envoy/bootstrap.yaml.tmpl").read_text("utf-8")
    )
    text = template.substitute(
        admin_host=options.admin.host,
        admin_port=options.admin.port,
        listen_host=options.listen.host,
        listen_port=options.listen.port,
        access_log=_ACCESS_LOG.rstrip("\n") if options.access_log else "",
        max_body_bytes=options.max_body_bytes,
        pd_routes=_pd_routes(options.pd_paths),
        failure_mode_allow="true" if options.failure_mode_allow else "false",
        response_header_mode="SEND" if options.hold_response else "SKIP",
        request_header_mode="SKIP" if options.single_message else "SEND",
        prefill_header_filter=_PREFILL_HEADER_FILTER if options.single_message else "",
        single_message_options=(
            _SINGLE_MESSAGE_OPTIONS.format(
                attributes=", ".join(f'"{a}"' for a in REQUEST_ATTRIBUTES)
            )
            if options.single_message
            else ""
        ),
        message_timeout_s=_seconds(options.message_timeout_s),
        max_message_timeout_s=_seconds(options.max_message_timeout_s),
        decode_type=_cluster_type(options.decode),
        processor_type=_cluster_type(options.processor),
        decode_endpoints=_endpoints(options.decode),
        processor_endpoints=_endpoints(options.processor),
    )
    return "\n".join(_keep(text.splitlines(), options.with_processor)) + "\n"


def _keep(lines: list[str], with_processor: bool) -> Iterator[str]:
    """Drop template marker lines, lines left empty by unused blocks, and the blocks the
    markers fence when Envoy runs alone."""
    inside = False
    for line in lines:
        marker = line.strip()
        if marker in ("#@extproc-begin", "#@extproc-end"):
            inside = marker == "#@extproc-begin"
        elif (with_processor or not inside) and marker:
            yield line


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def parse_targets(values: Sequence[str]) -> list[HostPort]:
    return [parse_host_port(v) for v in values]
