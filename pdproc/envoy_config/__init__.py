"""`pdproc envoy-config`: a complete Envoy bootstrap with pdproc in the filter chain.

The template beside this module (`bootstrap.yaml.tmpl`) carries the reasoning for every
non-default setting as comments, and `kv_guard.lua` is the Lua filter it embeds; this module
only fills in addresses, sizes, timeouts, the P/D paths and the TLS files.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from string import Template

from pdproc.config import (
    DEFAULT_OPEN_PATHS,
    DEFAULT_PD_PATHS,
    DecodeChoice,
    EnvoyConfigSettings,
    serve_default,
)
from pdproc.extproc_messages import REQUEST_ATTRIBUTES
from pdproc.gateway_fields import GATEWAY_HEADERS
from pdproc.pod_http import POD_KEEPALIVE_S
from pdproc.targets import PREFILL_HEADER, HostPort, parse_host_port

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
                  route: "%ROUTE_NAME%"
                  body_checked: "%DYNAMIC_METADATA(pdproc:body_checked)%"
                  kv_guard: "%DYNAMIC_METADATA(pdproc_kv_guard:verdict)%"
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
              # An empty value gets no metadata from the rule below: this one records that
              # the header was there (an empty header means "no disaggregation").
              - header: x-prefiller-host-port
                on_header_present:
                  {metadata_namespace: pdproc, key: prefiller_present, value: "1", type: STRING}
              - header: x-prefiller-host-port
                on_header_present: {metadata_namespace: pdproc, key: prefiller, type: STRING}
                remove: true"""
)

_SINGLE_MESSAGE_OPTIONS = """\
              # Single-message mode: what pdproc reads of the request headers, sent with the
              # body message (request_header_mode is SKIP).
              request_attributes: [{attributes}]"""

_FORWARDING_NAMESPACES = """\
                # Single-message mode: the prefill header, as metadata, goes to pdproc.
                forwarding_namespaces: {untyped: [pdproc]}"""

_TLS_SOCKET = """\
    # TLS to pdproc: its certificate is verified against --processor-tls-ca and must name
    # one of the subject alternative names below{mtls}.
    transport_socket:
      name: envoy.transport_sockets.tls
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext
{sni}        common_tls_context:
          alpn_protocols: [h2]
{certificates}          validation_context:
            trusted_ca: {{filename: {ca}}}
            match_typed_subject_alt_names:
{sans}"""


_LEAST_REQUEST = "    lb_policy: LEAST_REQUEST"

# --decode-choice prefix: the decode cluster takes the decode pdproc names in its body answer
# (dynamic metadata, which no client can set); without one (pdproc down, failed open, or a
# request it does not place) or when the named host is not in the cluster, least request.
_OVERRIDE_HOST = """\
    # --decode-choice prefix: the host pdproc named (pdproc.decode_endpoint, IP:PORT) when it
    # is one of this cluster's, else least request. Only the cluster's own hosts can be
    # picked: a value naming any other address routes nowhere new.
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.\
override_host.v3.OverrideHost
            override_host_sources:
            - metadata: {key: pdproc, path: [{key: decode_endpoint}]}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.least_request
                  typed_config:
                    "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.\
least_request.v3.LeastRequest"""

# The header gateways use to name an endpoint (the Gateway API inference extension's): never
# taken from a client. Removed before anything else runs, so that whatever reads it later
# (an override_host source, the decode) never sees a client's value, also when pdproc is
# down or skips the request.
DESTINATION_HEADER = "x-gateway-destination-endpoint"
_DESTINATION_STRIP = (
    """\
          # --decode-choice prefix: the decode is pdproc's choice; a client's endpoint header
          # is dropped first, whatever filter or pdproc does next.
          - name: envoy.filters.http.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.\
HeaderMutation
              mutations:
                request_mutations:
                - remove: """
    + DESTINATION_HEADER
)

# Envoy releases the generated config is tested with (`scripts/envoy-matrix.sh`).
SUPPORTED_ENVOY_VERSIONS = ((1, 36), (1, 37), (1, 38), (1, 39), (1, 40))
NEWEST_ENVOY_VERSION = SUPPORTED_ENVOY_VERSIONS[-1]
# Default of --envoy-version / EnvoyOptions.envoy_version when set (e.g. by the test matrix).
ENVOY_VERSION_ENV = "PDPROC_ENVOY_VERSION"
_VERSION = re.compile(r"(?:^|[/\s])(\d+)\.(\d+)(?:\.\d+)?(?:$|[/\s])")


def parse_envoy_version(text: str) -> tuple[int, int]:
    """`1.36`, `1.36.4` or a line of `envoy --version` output -> (1, 36), if supported."""
    found = _VERSION.search(text.strip())
    if found is None:
        raise ValueError(f"not an Envoy version: {text.strip()[:80]!r}")
    version = (int(found.group(1)), int(found.group(2)))
    if version not in SUPPORTED_ENVOY_VERSIONS:
        first, last = SUPPORTED_ENVOY_VERSIONS[0], SUPPORTED_ENVOY_VERSIONS[-1]
        raise ValueError(
            f"Envoy {version[0]}.{version[1]} is not supported "
            f"(supported: {first[0]}.{first[1]} to {last[0]}.{last[1]})"
        )
    return version


def default_envoy_version() -> tuple[int, int]:
    """$PDPROC_ENVOY_VERSION if set, else the newest supported release."""
    chosen = os.environ.get(ENVOY_VERSION_ENV)
    return parse_envoy_version(chosen) if chosen else NEWEST_ENVOY_VERSION


_LISTENER_BUFFER_LIMIT = """\
    # Envoy 1.36: the virtual host's request_body_buffer_limit does not raise what a filter
    # may buffer; the per-connection limit (1 MiB by default) does, so it is raised to the
    # body limit. It also lets each connection buffer that much before Envoy stops reading
    # from it (1.37+ need neither).
    per_connection_buffer_limit_bytes: {limit}"""


@dataclass(frozen=True)
class EnvoyOptions:
    listen: HostPort
    processor: Sequence[HostPort]
    decode: Sequence[HostPort]
    admin: HostPort
    pd_paths: Sequence[str] = DEFAULT_PD_PATHS
    # Non-P/D paths that reach the decode (kv guard, no pdproc); all others get a 404.
    open_paths: Sequence[str] = DEFAULT_OPEN_PATHS
    # Kept equal to pdproc's own settings: the same declarations (pdproc.config).
    max_body_bytes: int = serve_default("max_body_bytes")
    max_message_timeout_s: float = serve_default("envoy_max_message_timeout")
    message_timeout_s: float = serve_default("envoy_message_timeout")
    with_processor: bool = True  # False: Envoy alone (the benchmark's baseline)
    access_log: bool = False
    failure_mode_allow: bool = True
    # False: response_header_mode SKIP, so no hold and no clean abort once the decode has
    # answered (only for measuring what the hold costs).
    hold_response: bool = True
    # One ext_proc message on the request path instead of two (request headers SKIP).
    single_message: bool = False
    # Single-message mode: more request headers the prefill leg should carry (API keys ...),
    # beyond what REQUEST_ATTRIBUTES lists.
    prefill_headers: tuple[str, ...] = ()
    # Upload bounds (HCM request_headers_timeout / request_timeout).
    request_headers_timeout_s: float = 10.0
    request_timeout_s: float = 60.0
    # The kv guard Lua filter after ext_proc (False only to measure what it costs).
    kv_guard: bool = True
    # The Envoy release the config is for, (major, minor): the few settings that differ.
    envoy_version: tuple[int, int] = field(default_factory=default_envoy_version)
    # TLS to pdproc: CA that signed pdproc's certificate; client certificate and key (mTLS);
    # the name to send as SNI and to expect in pdproc's certificate.
    processor_tls_ca: str | None = None
    processor_tls_cert: str | None = None
    processor_tls_key: str | None = None
    processor_sni: str | None = None
    # The decode cluster routes on the decode pdproc names (pdproc serve --decode-choice).
    decode_choice: bool = False

    def __post_init__(self) -> None:
        for path in (*self.pd_paths, *self.open_paths):
            if not _PATH.fullmatch(path):
                raise ValueError(f"not a plain request path: {path!r}")
        both = sorted(set(self.pd_paths) & set(self.open_paths))
        if both:
            raise ValueError(f"{both[0]} is both a P/D path and an open path")
        if self.envoy_version not in SUPPORTED_ENVOY_VERSIONS:
            parse_envoy_version("{}.{}".format(*self.envoy_version))  # raises, with the range
        if self.request_timeout_s <= self.message_timeout_s:
            raise ValueError(
                f"request timeout ({self.request_timeout_s} s) must exceed the ext_proc message "
                f"timeout ({self.message_timeout_s} s): pdproc's body answer is part of it"
            )
        self._check_decode_choice()
        if (self.processor_tls_cert is None) != (self.processor_tls_key is None):
            raise ValueError("a processor client certificate needs both its cert and its key")
        tls_extras = (self.processor_tls_cert, self.processor_sni)
        if self.processor_tls_ca is None and any(v is not None for v in tls_extras):
            raise ValueError(
                "TLS to the processor needs --processor-tls-ca (its certificate is always verified)"
            )

    def _check_decode_choice(self) -> None:
        if self.decode_choice and self.single_message and not self.kv_guard:
            # The router picks the host when the headers reach it; in single-message mode
            # they reach it before pdproc's body answer unless the kv guard holds them.
            raise ValueError("the decode choice in single-message mode needs the kv guard")


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
        f"              - name: pd\n"
        f'                match: {{path: "{path}"}}\n'
        "                route: {cluster: decode, timeout: 0s}"
        for path in paths
    ]
    header = "              # P/D paths (processed by pdproc); no route timeout: answers stream."
    return "\n".join([header, *routes])


# An exact request path as a route matches it (and as YAML carries it in double quotes).
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@/-]*")
_EXT_PROC_PER_ROUTE = (
    "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute"
)


def _open_routes(paths: Sequence[str]) -> str:
    """Routes to the decode for the open paths: pdproc skips them, the kv guard does not."""
    if not paths:
        return ""
    routes = [
        f"              - name: open\n"
        f'                match: {{path: "{path}"}}\n'
        "                route: {cluster: decode, timeout: 0s}\n"
        "#@extproc-begin\n"
        "                typed_per_filter_config:\n"
        "                  envoy.filters.http.ext_proc:\n"
        f'                    "@type": {_EXT_PROC_PER_ROUTE}\n'
        "                    disabled: true\n"
        "#@extproc-end"
        for path in paths
    ]
    header = (
        "              # Open paths (--open-path): to the decode without pdproc, each body still\n"
        "              # checked by the kv guard."
    )
    return "\n".join([header, *routes])


def _pd_variant_regex(paths: Sequence[str]) -> str:
    """Other spellings of the P/D paths that the decode's HTTP server might still route to
    its P/D handler after Envoy's normalisation: another letter case, or anything after the
    path that starts with "/", ";", ".", "%" or white space (Starlette's route regex ends in
    `$`, which also matches before a final newline: "/v1/chat/completions%0A" reaches the
    chat handler). A single-quoted YAML scalar."""
    alternatives = "|".join(re.escape(path) for path in paths)
    return "'" + f"(?is)(?:{alternatives})(?:[/;.%\\s].*)?".replace("'", "''") + "'"


_NOT_ROUTED_BODY = json.dumps(
    json.dumps(
        {
            "object": "error",
            "message": "not found: this gateway serves the P/D endpoints and a few read-only ones",
            "type": "NotFoundError",
            "param": "",
            "code": 404,
        },
        separators=(",", ":"),
    )
)

_PD_VARIANT_BODY = json.dumps(
    json.dumps(
        {
            "object": "error",
            "message": "not found: the P/D endpoints are served under their exact path only",
            "type": "NotFoundError",
            "param": "",
            "code": 404,
        },
        separators=(",", ":"),
    )
)


def kv_guard_source() -> str:
    """The kv guard Lua filter (also for manifests that embed it elsewhere)."""
    return resources.files("pdproc.envoy_config").joinpath("kv_guard.lua").read_text("utf-8")


def _indented(text: str, spaces: int) -> str:
    pad = " " * spaces
    return "\n".join(pad + line if line else "" for line in text.splitlines())


def _tls_socket(options: EnvoyOptions) -> str:
    if options.processor_tls_ca is None:
        return ""
    if options.processor_sni is not None:
        sans = [("DNS", options.processor_sni)]
    else:
        sans = [("DNS" if t.ip is None else "IP_ADDRESS", t.host) for t in options.processor]
    san_lines = "\n".join(
        f"            - {{san_type: {kind}, matcher: {{exact: {json.dumps(name)}}}}}"
        for kind, name in dict.fromkeys(sans)
    )
    certificates = ""
    if options.processor_tls_cert is not None and options.processor_tls_key is not None:
        cert, key = json.dumps(options.processor_tls_cert), json.dumps(options.processor_tls_key)
        certificates = (
            "          tls_certificates:\n"
            f"          - certificate_chain: {{filename: {cert}}}\n"
            f"            private_key: {{filename: {key}}}\n"
        )
    sni = (
        f"        sni: {json.dumps(options.processor_sni)}\n"
        if options.processor_sni is not None
        else ""
    )
    return _TLS_SOCKET.format(
        mtls="; Envoy presents a client certificate (mTLS)" if certificates else "",
        sni=sni,
        certificates=certificates,
        ca=json.dumps(options.processor_tls_ca),
        sans=san_lines,
    )


def _decode_routing(options: EnvoyOptions) -> dict[str, str]:
    """How the decode cluster picks its host: its own least request, or pdproc's choice."""
    return {
        "decode_type": _cluster_type(options.decode),
        "decode_lb_policy": _OVERRIDE_HOST if options.decode_choice else _LEAST_REQUEST,
        "decode_header_strip": _DESTINATION_STRIP if options.decode_choice else "",
    }


def render(options: EnvoyOptions) -> str:
    template = Template(
        resources.files("pdproc.envoy_config").joinpath("bootstrap.yaml.tmpl").read_text("utf-8")
    )
    text = template.substitute(
        admin_host=options.admin.host,
        admin_port=options.admin.port,
        listen_host=options.listen.host,
        listen_port=options.listen.port,
        access_log=_ACCESS_LOG.rstrip("\n") if options.access_log else "",
        max_body_bytes=options.max_body_bytes,
        listener_buffer_limit=(
            _LISTENER_BUFFER_LIMIT.format(limit=options.max_body_bytes)
            if options.envoy_version < (1, 37)
            else ""
        ),
        pd_routes=_pd_routes(options.pd_paths),
        pd_variant_regex=_pd_variant_regex(options.pd_paths),
        pd_variant_body=_PD_VARIANT_BODY,
        open_routes=_open_routes(options.open_paths),
        not_routed_body=_NOT_ROUTED_BODY,
        headers_to_remove=json.dumps([PREFILL_HEADER, *GATEWAY_HEADERS]),
        forwarding_namespaces=_FORWARDING_NAMESPACES if options.single_message else "",
        kv_guard_source=_indented(kv_guard_source(), 18),
        processor_transport_socket=_tls_socket(options),
        failure_mode_allow="true" if options.failure_mode_allow else "false",
        response_header_mode="SEND" if options.hold_response else "SKIP",
        request_header_mode="SKIP" if options.single_message else "SEND",
        prefill_header_filter=_PREFILL_HEADER_FILTER if options.single_message else "",
        single_message_options=(
            _SINGLE_MESSAGE_OPTIONS.format(
                attributes=", ".join(f'"{a}"' for a in request_attributes(options))
            )
            if options.single_message
            else ""
        ),
        message_timeout_s=_seconds(options.message_timeout_s),
        request_headers_timeout_s=_seconds(options.request_headers_timeout_s),
        request_timeout_s=_seconds(options.request_timeout_s),
        max_message_timeout_s=_seconds(options.max_message_timeout_s),
        pod_idle_timeout_s=_seconds(POD_KEEPALIVE_S),
        **_decode_routing(options),
        processor_type=_cluster_type(options.processor),
        decode_endpoints=_endpoints(options.decode),
        processor_endpoints=_endpoints(options.processor),
    )
    dropped = {"extproc"} if not options.with_processor else set()
    if not options.kv_guard:
        dropped.add("kvguard")
    return "\n".join(_keep(text.splitlines(), dropped)) + "\n"


_MARKER = re.compile(r"#@([a-z]+)-(begin|end)")


def _keep(lines: list[str], dropped: set[str]) -> Iterator[str]:
    """Drop template marker lines (`#@NAME-begin` / `#@NAME-end`), lines left empty by unused
    blocks, and the lines inside the blocks whose NAME is in `dropped`."""
    inside: set[str] = set()
    for line in lines:
        marker = _MARKER.fullmatch(line.strip())
        if marker is not None:
            name, edge = marker.groups()
            if edge == "begin":
                inside.add(name)
            else:
                inside.discard(name)
        elif line.strip() and not inside & dropped:
            yield line


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def parse_targets(values: Sequence[str]) -> list[HostPort]:
    return [parse_host_port(v) for v in values]


def options_from(flags: EnvoyConfigSettings) -> EnvoyOptions:
    """The render options of `pdproc envoy-config`'s flags."""
    return EnvoyOptions(
        listen=flags.listen,
        processor=flags.processor,
        decode=flags.decode,
        admin=flags.admin,
        # The declared order first (a frozenset has none), then any others sorted.
        pd_paths=sorted(
            flags.pd_path,
            key=lambda p: (DEFAULT_PD_PATHS.index(p), "") if p in DEFAULT_PD_PATHS else (99, p),
        ),
        open_paths=flags.open_path,
        max_body_bytes=flags.max_body_bytes,
        max_message_timeout_s=flags.envoy_max_message_timeout,
        message_timeout_s=flags.envoy_message_timeout,
        with_processor=not flags.no_processor,
        access_log=flags.access_log,
        failure_mode_allow=not flags.fail_closed,
        hold_response=not flags.no_response_hold,
        single_message=flags.single_message,
        prefill_headers=flags.prefill_header,
        request_timeout_s=flags.request_timeout,
        request_headers_timeout_s=flags.request_headers_timeout,
        processor_tls_ca=flags.processor_tls_ca,
        processor_tls_cert=flags.processor_tls_cert,
        processor_tls_key=flags.processor_tls_key,
        processor_sni=flags.processor_sni,
        decode_choice=flags.decode_choice is DecodeChoice.PREFIX,
        envoy_version=(
            parse_envoy_version(flags.envoy_version)
            if flags.envoy_version
            else default_envoy_version()
        ),
    )


def request_attributes(options: EnvoyOptions) -> tuple[str, ...]:
    """What Envoy sends with the body in single-message mode: pdproc's own list, plus each
    extra header the operator wants on the prefill leg."""
    extra = (
        f"request.headers['{name.lower()}']"
        for name in options.prefill_headers
        if f"request.headers['{name.lower()}']" not in REQUEST_ATTRIBUTES
    )
    return (*REQUEST_ATTRIBUTES, *dict.fromkeys(extra))
