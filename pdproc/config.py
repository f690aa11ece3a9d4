"""Settings of `pdproc serve` and `pdproc envoy-config`, each declared once.

A field of `Settings` is the whole declaration of a setting: its name is the YAML key and,
with dashes, the flag (`prefill_timeout` -> `--prefill-timeout`); `PDPROC_<NAME>` is its
environment variable; its metadata carries the help text, the parser of one textual value
and, for repeatable settings, how the parsed items combine. The CLI, the environment, the
YAML file, the defaults and docs/settings.md's settings table are all derived from these fields.

`EnvoyConfigSettings` declares `pdproc envoy-config`'s flags the same way (flags only). The
ones that must agree with the processor (body size, the ext_proc message timeouts, the P/D
paths) are `serve`'s own fields, taken over with `_serve_setting`: one default, one parser,
one flag name for both commands.
"""

# _setting() returns a dataclasses.field; ruff cannot see that.
# ruff: noqa: RUF009

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from pdproc.targets import AllowList, HostPort, parse_host_port

DEFAULT_PD_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/inference/v1/generate",
)
# Paths other than the P/D ones that reach the decode pods (with the kv guard, without
# pdproc): read-only ones a client of an OpenAI-style server expects. Every other path is
# refused by the generated Envoy config (`--open-path` replaces this list).
DEFAULT_OPEN_PATHS = ("/v1/models", "/health", "/version")
MiB = 1024 * 1024
GiB = 1024 * MiB


class BootstrapPolicy(Enum):
    """What to do when no prefill can be used for a request (bootstrap failed, pod known down)."""

    REJECT = "reject"  # 502 to the client, as llm-d does
    DECODE_ONLY = "decode-only"  # let the decode pod do the whole request alone


class PoolPolicy(Enum):
    """How pdproc picks a prefill pool member when no endpoint picker names one."""

    PREFIX = "prefix"  # the member likely to hold the prompt's prefix, within a load bound
    LEAST_LOADED = "least-loaded"  # the member with the fewest prefills in flight


class DecodeChoice(Enum):
    """Who picks the decode pod of a pool-mode P/D request."""

    OFF = "off"  # Envoy's decode cluster (least request)
    PREFIX = "prefix"  # pdproc: the decode likely to hold the prompt, within a load bound


class KvConnector(Enum):
    """The KV transfer protocol between the prefill and the decode pods (llm-d's names)."""

    MOONCAKE = "mooncake"  # vLLM MooncakeConnector: prefill beside the decode
    NIXLV2 = "nixlv2"  # vLLM NixlConnector: prefill first, its answer feeds the decode
    SGLANG = "sglang"  # SGLang disaggregation: both legs meet in a bootstrap room


@dataclass(frozen=True, slots=True)
class Option:
    """How one setting is read from text (flag, environment, YAML) and documented."""

    help: str
    parse: Callable[[str], Any]
    repeat: bool = False
    # Repeatable settings: what the parsed items become (a tuple unless given).
    combine: Callable[[list[Any]], Any] = tuple
    extra_env: tuple[str, ...] = ()
    switch: bool = False  # a flag without a value (`--log-bodies`); true/false elsewhere
    required: bool = False  # the command refuses to run without it
    aliases: tuple[str, ...] = ()  # older flag spellings still accepted


def _setting(default: Any, help: str, parse: Callable[[str], Any] = str, **kw: Any) -> Any:
    option = Option(help, parse, **kw)
    if isinstance(default, (list, set, dict)):
        raise TypeError("settings are frozen: use a tuple or frozenset default")
    return field(default=default, metadata={"option": option})


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a number") from None


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a whole number") from None


def _positive(value: str) -> float:
    number = _float(value)
    if not number > 0:
        raise ValueError(f"{value} is not positive")
    return number


def _non_negative(value: str) -> float:
    number = _float(value)
    if not number >= 0:
        raise ValueError(f"{value} is negative")
    return number


def _at_least_one(value: str) -> float:
    number = _float(value)
    if not number >= 1:
        raise ValueError(f"{value} is less than 1")
    return number


def _count(value: str) -> int:
    number = _int(value)
    if number < 1:
        raise ValueError(f"{value} is not a positive integer")
    return number


def _non_negative_int(value: str) -> int:
    number = _int(value)
    if number < 0:
        raise ValueError(f"{value} is negative")
    return number


def _port(value: str) -> int:
    port = _int(value)
    if not 0 < port < 65536:
        raise ValueError(f"port {value} out of range")
    return port


def _listen(value: str) -> HostPort:
    """A listen address; port 0 picks a free one (tests). A bare IPv6 address before the
    port (`fd00::1:9090`, what `$(POD_IP):9090` gives on an IPv6 cluster) is accepted: a
    listen address always ends with its port."""
    host, sep, port = value.strip().rpartition(":")
    if sep and ":" in host and not host.startswith("["):
        host = f"[{host}]"
    if sep and port == "0":
        return HostPort(parse_host_port(f"{host}:1").host, 0)
    return parse_host_port(f"{host}{sep}{port}")


def _boolean(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
        return value

    return parse


def _path(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} is not a path")
    return value


def _header_name(value: str) -> str:
    if not value or not all(c.isascii() and (c.isalnum() or c in "-_") for c in value):
        raise ValueError(f"{value!r} is not a header name")
    return value


@dataclass(frozen=True)
class Settings:
    listen: HostPort = _setting(
        HostPort("0.0.0.0", 9002), "gRPC listen address of the processor.", _listen
    )
    prefill: tuple[HostPort, ...] = _setting(
        (), "Static prefill pool member HOST:PORT.", parse_host_port, repeat=True
    )
    prefill_dns: tuple[HostPort, ...] = _setting(
        (),
        "NAME:PORT whose A/AAAA records are all prefill pool members, re-resolved every "
        "--dns-refresh seconds (a headless Service).",
        parse_host_port,
        repeat=True,
    )
    dns_refresh: float = _setting(
        1.0,
        "Seconds between --prefill-dns resolutions; each lookup may take at most 0.8 of it.",
        _positive,
    )
    prefill_allow: AllowList = _setting(
        AllowList(),
        "CIDR, host name or * allowed as a prefill target taken from the "
        "x-prefiller-host-port header. Pool members are always allowed.",
        repeat=True,
        combine=AllowList.parse,
    )
    pd_path: frozenset[str] = _setting(
        frozenset(DEFAULT_PD_PATHS),
        "Request path handled as P/D (replaces the default list).",
        _path,
        repeat=True,
        combine=frozenset,
    )
    pd_min_prompt: int = _setting(
        0,
        "Pool mode (no x-prefiller-host-port): request bodies shorter than this many bytes "
        "are served by the decode alone (0: every request is disaggregated).",
        _non_negative_int,
    )
    pool_policy: PoolPolicy = _setting(
        PoolPolicy.PREFIX,
        "Pool mode: how a prefill pool member is picked: prefix (the member likely to hold "
        "the prompt's prefix in its KV cache, unless its load is past --prefix-balance times "
        "the mean; docs/prefix-routing.md) or least-loaded (the fewest prefills in flight).",
        PoolPolicy,
    )
    prefix_blocks_per_pod: int = _setting(
        16384,
        "Pool policy prefix: 256-byte prompt blocks remembered per pool member (about 120 "
        "bytes of memory each, per worker process).",
        _count,
    )
    prefix_balance: float = _setting(
        1.25,
        "Pool policy prefix: a member whose prefills in flight would pass this many times "
        "the pool's mean (plus one) is not chosen for its cache.",
        _at_least_one,
    )
    decode: tuple[HostPort, ...] = _setting(
        (),
        "Decode pod IP:PORT for --decode-choice (as Envoy's decode cluster lists it).",
        parse_host_port,
        repeat=True,
    )
    decode_dns: tuple[HostPort, ...] = _setting(
        (),
        "NAME:PORT whose A/AAAA records are all decode pods, for --decode-choice, re-resolved "
        "every --dns-refresh seconds (the headless Service Envoy's decode cluster resolves).",
        parse_host_port,
        repeat=True,
    )
    decode_choice: DecodeChoice = _setting(
        DecodeChoice.OFF,
        "Pool mode: who picks the decode pod: off (Envoy's least-request choice) or prefix "
        "(pdproc names the --decode/--decode-dns member likely to hold the prompt, within "
        "--prefix-balance; Envoy's config must route on it: `pdproc envoy-config "
        "--decode-choice prefix`; docs/prefix-routing.md).",
        DecodeChoice,
    )
    decode_skip_pd_fraction: float = _setting(
        0.8,
        "--decode-choice prefix: when the chosen decode holds at least this share of the "
        "prompt's blocks, it serves the request alone, without a prefill (counted "
        "decode_cached; 0 or more than 1: never; never with --kv-connector sglang, whose "
        "decodes serve no request alone).",
        _non_negative,
    )
    kv_connector: KvConnector = _setting(
        KvConnector.MOONCAKE,
        "KV connector of the prefill and decode pods: mooncake, nixlv2 or sglang.",
        KvConnector,
    )
    mooncake_bootstrap_port: int = _setting(
        8998,
        "Port of the prefill pods' Mooncake bootstrap server.",
        _port,
        extra_env=("MOONCAKE_BOOTSTRAP_PORT",),
    )
    sglang_bootstrap_port: int = _setting(
        8998,
        "Port of the prefill pods' SGLang bootstrap server (--kv-connector sglang).",
        _port,
        extra_env=("SGLANG_BOOTSTRAP_PORT",),
    )
    bootstrap_timeout: float = _setting(5.0, "Bootstrap /query timeout, seconds.", _positive)
    # Engine ids change when a prefill pod restarts, which takes a real engine 30 s and more:
    # a map queried less than this long ago cannot name an engine the pod replaced (see
    # engine_maps.py). Older maps are re-queried before any request uses them.
    engine_cache_ttl: float = _setting(
        15.0,
        "Age (from its query) past which a cached engine-id map is re-queried before it is "
        "used, seconds. Keep it under a prefill pod's restart time (30 s and more for vLLM).",
        _positive,
    )
    # Younger maps in use are re-queried in the background, so a busy pod's requests rarely
    # wait for a query.
    engine_refresh: float = _setting(
        5.0,
        "Age after which a cached engine-id map in use is re-queried in the background, "
        "seconds (0: never).",
        _non_negative,
    )
    prefill_timeout: float = _setting(60.0, "Prefill request timeout, seconds.", _positive)
    envoy_message_timeout: float = _setting(
        10.0,
        "The ext_proc filter's message_timeout, seconds: an answer pdproc holds for less "
        "than this costs no extra message.",
        _positive,
    )
    # Must not exceed the filter's max_message_timeout, or Envoy ignores our hold request.
    envoy_max_message_timeout: float = _setting(
        300.0,
        "The ext_proc filter's max_message_timeout, seconds (caps how long a decode's "
        "response headers may be held).",
        _positive,
    )
    max_body_bytes: int = _setting(16 * MiB, "Largest request body accepted.", _count)
    stream_body_bytes: int = _setting(
        256 * 1024,
        "P/D request bodies of at least this many bytes (by content-length) pass on to the "
        "decode chunk by chunk as Envoy receives them, only their end rewritten, instead of "
        "crossing to pdproc and back whole (Mooncake and SGLang, two-message mode; 0: never).",
        _non_negative_int,
    )
    max_inflight_bytes: int = _setting(
        1 * GiB,
        "Total request-body bytes held across all streams; past it new P/D requests get "
        "503 (bounds memory under a burst of large prompts).",
        _count,
    )
    on_bootstrap_error: BootstrapPolicy = _setting(
        BootstrapPolicy.REJECT,
        "reject (502) or decode-only when no prefill can serve a request.",
        BootstrapPolicy,
    )
    breaker_failures: int = _setting(
        5, "Prefill failures in a row that open a pod's breaker.", _count
    )
    breaker_cooldown: float = _setting(
        10.0,
        "Longest wait of an open prefill breaker, seconds (it starts at 1 s and doubles "
        "with each failed probe).",
        _positive,
    )
    drain_timeout: float = _setting(
        61.0,
        "Seconds in-flight work may take after SIGTERM (keep it above --prefill-timeout).",
        _non_negative,
    )
    # After SIGTERM, keep serving this long while health checks report NOT_SERVING, so Envoy
    # moves new streams to other replicas before this one refuses them.
    shutdown_delay: float = _setting(
        2.0, "Seconds to keep serving after SIGTERM (NOT_SERVING).", _non_negative
    )
    dead_peer_timeout: float = _setting(
        5.0,
        "How long a prefill pod's node may leave what pdproc sent, or a keepalive probe, "
        "unacknowledged before the pod is taken for dead (TCP_USER_TIMEOUT and TCP "
        "keepalive on pod connections; a pod's compute never delays it), seconds; 0: no "
        "bound.",
        _non_negative,
    )
    max_prefill_connections: int = _setting(
        1024,
        "Prefill connections pdproc keeps open at once; a prefill waits for a free one "
        "(counted `exhausted`, never against the pod, when none frees within "
        "--prefill-timeout).",
        _count,
    )
    max_named_host_connections: int = _setting(
        256,
        "Of those, the most the ports of one host that a request header names and that "
        "never answered a prefill 2xx (not pool members) may take; past it their prefills "
        "are `exhausted` at once.",
        _count,
    )
    max_targets: int = _setting(
        1024,
        "Prefill targets pdproc keeps state for (breakers, metrics labels); the least "
        "recently used are forgotten beyond it.",
        _count,
    )
    metrics_listen: HostPort | None = _setting(
        None, "HOST:PORT for /metrics, /healthz, /readyz.", _listen
    )
    tls_cert: str | None = _setting(
        None, "PEM certificate chain: serve gRPC over TLS (with --tls-key)."
    )
    tls_key: str | None = _setting(None, "PEM private key of --tls-cert.")
    tls_client_ca: str | None = _setting(
        None, "PEM CA bundle: require and verify client certificates (mTLS)."
    )
    tls_reload: float = _setting(
        5.0,
        "Seconds between checks of the --tls-* files: changed files that load are served "
        "from the next handshake on (a rotated Secret), others keep the previous ones.",
        _positive,
    )
    tls_max_connection_age: float = _setting(
        300.0,
        "With TLS, seconds after which a connection is asked to go away (in-flight streams "
        "finish): bounds how long a rotated-away client CA or certificate stays in use.",
        _positive,
    )
    workers: int = _setting(
        0,
        "Processes sharing the listen port (SO_REUSEPORT). 0: one per CPU of the "
        "container's CPU limit; without a limit, one per two CPUs the process may run on "
        "(the rest are Envoy's); one when the port is 0.",
        _non_negative_int,
    )
    log_level: str = _setting(
        "info", "debug, info, warning or error.", _choice("debug", "info", "warning", "error")
    )
    log_format: str = _setting("json", "json or text.", _choice("json", "text"))
    trace_flush_timeout: float = _setting(
        5.0,
        "Seconds the exit may spend sending the spans still queued (OpenTelemetry).",
        _non_negative,
    )
    log_bodies: bool = _setting(
        False,
        "Add the first 4 KiB of each P/D request body (prompt text!) and prefill error "
        "bodies to the log.",
        _boolean,
        switch=True,
    )
    # Not a flag: a bound that only tests change.
    engine_cache_size: int = 4096

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        if self.decode_choice is DecodeChoice.PREFIX and not (self.decode or self.decode_dns):
            raise ValueError("--decode-choice prefix needs --decode or --decode-dns")

    @property
    def grpc_max_message_bytes(self) -> int:
        # Envoy frames the buffered body in one gRPC message. Receive more than we accept, so
        # an oversized body reaches our 413 instead of failing the stream (which Envoy's
        # failure_mode_allow would turn into an unprocessed request).
        return max(self.max_body_bytes + MiB, 64 * MiB)


def _serve_setting(name: str, help: str | None = None, **kw: Any) -> Any:
    """`serve`'s setting `name`, for another command that must agree with it: the same
    default and parser (and help text, unless given)."""
    source = Settings.__dataclass_fields__[name]
    option: Option = source.metadata["option"]
    option = dataclasses.replace(option, help=help or option.help, **kw)
    return field(default=source.default, metadata={"option": option, "serve": name})


def serve_default(name: str) -> Any:
    """The default of `serve`'s setting `name` (for code that takes it as a parameter)."""
    return Settings.__dataclass_fields__[name].default


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class EnvoyConfigSettings:
    """`pdproc envoy-config`'s flags (no environment variables, no file)."""

    listen: HostPort = _setting(
        HostPort("0.0.0.0", 10000), "Envoy listener HOST:PORT.", parse_host_port
    )
    processor: tuple[HostPort, ...] = _setting(
        (HostPort("127.0.0.1", 9002),), "pdproc HOST:PORT.", parse_host_port, repeat=True
    )
    decode: tuple[HostPort, ...] = _setting(
        (), "Decode HOST:PORT.", parse_host_port, repeat=True, required=True
    )
    admin: HostPort = _setting(
        HostPort("127.0.0.1", 9901), "Envoy admin HOST:PORT.", parse_host_port
    )
    decode_choice: DecodeChoice = _serve_setting(
        "decode_choice",
        "prefix: the decode cluster routes to the decode pdproc names (an override_host "
        "policy on its metadata, least request without it; pass pdproc's value).",
    )
    pd_path: frozenset[str] = _serve_setting(
        "pd_path", "P/D path (replaces the default list; pass pdproc's --pd-path values)."
    )
    open_path: tuple[str, ...] = _setting(
        DEFAULT_OPEN_PATHS,
        "Non-P/D path that reaches the decode pods, its body checked by the kv guard "
        "(replaces the default list; every other path gets a 404).",
        _path,
        repeat=True,
    )
    max_body_bytes: int = _serve_setting(
        "max_body_bytes", "Largest request body Envoy buffers (pass pdproc's value)."
    )
    envoy_message_timeout: float = _serve_setting("envoy_message_timeout")
    envoy_max_message_timeout: float = _serve_setting(
        "envoy_max_message_timeout",
        "The ext_proc filter's max_message_timeout, seconds: caps how long a decode's "
        "response headers may be held; keep it >= pdproc's --prefill-timeout + 1.",
        aliases=("--max-message-timeout",),
    )
    request_timeout: float = _setting(
        60.0,
        "Seconds a client may take to send its whole request (408 after; never cuts a response).",
        _positive,
    )
    request_headers_timeout: float = _setting(
        10.0, "Seconds a client may take to send its request headers (408 after).", _positive
    )
    access_log: bool = _setting(False, "JSON access log on stdout.", _boolean, switch=True)
    no_processor: bool = _setting(False, "Envoy alone (benchmark baseline).", _boolean, switch=True)
    single_message: bool = _setting(
        False,
        "request_header_mode SKIP: one ext_proc message on the request path instead of two "
        "(headers pdproc needs come as request_attributes).",
        _boolean,
        switch=True,
    )
    prefill_header: tuple[str, ...] = _setting(
        (),
        "Single-message mode: also send this request header to pdproc, for the prefill leg "
        "(authorization and trace context are always sent).",
        _header_name,
        repeat=True,
    )
    no_response_hold: bool = _setting(
        False,
        "response_header_mode SKIP (measurement only: a failed prefill then cannot be turned "
        "into a clean error once the decode has answered).",
        _boolean,
        switch=True,
    )
    fail_closed: bool = _setting(
        False,
        "failure_mode_allow: false (500 when pdproc is unreachable).",
        _boolean,
        switch=True,
    )
    envoy_version: str | None = _setting(
        None,
        "The Envoy release to write the config for, X.Y from 1.36 to 1.40 (default: "
        "$PDPROC_ENVOY_VERSION, else the newest).",
    )
    processor_tls_ca: str | None = _setting(None, "CA that signed pdproc's certificate.")
    processor_tls_cert: str | None = _setting(None, "Client certificate (mTLS).")
    processor_tls_key: str | None = _setting(None, "Client key (mTLS).")
    processor_sni: str | None = _setting(
        None,
        "SNI sent to pdproc and the DNS name its certificate must carry (default: the "
        "--processor hosts).",
    )


@dataclass(frozen=True, slots=True)
class Declared:
    """A setting as the CLI, the environment, YAML and the README see it."""

    name: str
    default: Any
    option: Option

    @property
    def flag(self) -> str:
        return _flag(self.name)

    @property
    def envs(self) -> tuple[str, ...]:
        return ("PDPROC_" + self.name.upper(), *self.option.extra_env)

    def parse(self, raw: Any) -> Any:
        """A value from its text (or list of texts, for repeatable settings)."""
        if self.option.repeat:
            items = raw if isinstance(raw, list) else [raw]
            return self.option.combine([self._parse_one(str(item)) for item in items])
        return self._parse_one(str(raw))

    def _parse_one(self, text: str) -> Any:
        parse = self.option.parse
        if isinstance(parse, type) and issubclass(parse, Enum):
            # Enum's own message ("'x' is not a valid KvConnector") names no choice.
            choices = [str(member.value) for member in parse]
            if text not in choices:
                raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return parse(text)

    def shown_default(self) -> str | None:
        value = self.default
        if isinstance(value, Enum):
            return str(value.value)
        if isinstance(value, frozenset):
            value = sorted(value, key=DEFAULT_PD_PATHS.index) if value else None
        if isinstance(value, (tuple, list)) and not isinstance(value, HostPort):
            return ", ".join(map(str, value)) or None
        if value is None or isinstance(value, AllowList):
            return None
        return str(value)


def declared(command: type[Any] = Settings) -> tuple[Declared, ...]:
    """The declared settings of `serve` (Settings) or of `envoy-config` (EnvoyConfigSettings)."""
    return tuple(
        Declared(f.name, f.default, f.metadata["option"])
        for f in dataclasses.fields(command)
        if "option" in f.metadata
    )


def settings_table(settings: Iterable[Declared] | None = None) -> str:
    """docs/settings.md's settings table (a test keeps it current)."""
    rows = ["| flag | environment | YAML key | default | what it does |", "|---|---|---|---|---|"]
    for s in settings or declared():
        envs = ", ".join(f"`{name}`" for name in s.envs)
        default = s.shown_default()
        shown = f"`{default}`" if default not in (None, "") else "none"
        repeat = " Repeatable." if s.option.repeat else ""
        rows.append(f"| `{s.flag}` | {envs} | `{s.name}` | {shown} | {s.option.help}{repeat} |")
    return "\n".join(rows)
