"""Command line: `pdproc serve | envoy-config | sim | demo` (sim and demo: pdproc-sim).

Every `serve` setting is a flag, an environment variable (`PDPROC_<FLAG>`, plus vLLM's
`MOONCAKE_BOOTSTRAP_PORT`) and a key of the YAML file given with `--config`; the flag wins
over the environment, which wins over the file, which wins over the default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import Any

from pdproc import __version__
from pdproc.config import DEFAULT_PD_PATHS, BootstrapPolicy, Settings
from pdproc.targets import AllowList, TargetError, parse_host_port


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    default: Any
    parse: Callable[[str], Any] = str
    repeat: bool = False
    env: tuple[str, ...] = ()
    switch: bool = False  # a flag without a value (`--log-bodies`); true/false elsewhere

    @property
    def key(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def envs(self) -> tuple[str, ...]:
        return ("PDPROC_" + self.key.upper(), *self.env)


def _positive(value: str) -> float:
    number = float(value)
    if number <= 0:
        raise ValueError(f"{value} is not positive")
    return number


def _port(value: str) -> int:
    port = int(value)
    if not 0 < port < 65536:
        raise ValueError(f"port {value} out of range")
    return port


def _boolean(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean")


def _host_port(value: str) -> str:
    parse_host_port(value)  # validate only; the string is what the server binds
    return value


SERVE_OPTIONS: tuple[Option, ...] = (
    Option("--listen", "gRPC listen address of the processor.", "0.0.0.0:9002", _host_port),
    Option("--prefill", "Static prefill pool member HOST:PORT (repeatable).", [], repeat=True),
    Option(
        "--prefill-dns",
        "NAME:PORT whose A/AAAA records are all prefill pool members, re-resolved every "
        "--dns-refresh seconds (a headless Service; repeatable).",
        [],
        repeat=True,
    ),
    Option("--dns-refresh", "Seconds between --prefill-dns resolutions.", 10.0, _positive),
    Option(
        "--prefill-allow",
        "CIDR, host name or * allowed as a prefill target taken from the "
        "x-prefiller-host-port header (repeatable). Pool members are always allowed.",
        [],
        repeat=True,
    ),
    Option(
        "--pd-path",
        "Request path handled as P/D (repeatable; replaces the default list).",
        list(DEFAULT_PD_PATHS),
        repeat=True,
    ),
    Option(
        "--mooncake-bootstrap-port",
        "Port of the prefill pods' Mooncake bootstrap server.",
        8998,
        _port,
        env=("MOONCAKE_BOOTSTRAP_PORT",),
    ),
    Option("--bootstrap-timeout", "Bootstrap /query timeout, seconds.", 5.0, _positive),
    Option("--engine-cache-ttl", "Lifetime of a cached engine-id map, seconds.", 60.0, _positive),
    Option(
        "--engine-refresh",
        "Age after which a cached engine-id map is re-queried in the background, seconds "
        "(0: never).",
        5.0,
        float,
    ),
    Option("--prefill-timeout", "Prefill request timeout, seconds.", 60.0, _positive),
    Option(
        "--envoy-max-message-timeout",
        "The ext_proc filter's max_message_timeout, seconds (caps how long a decode's "
        "response headers may be held).",
        300.0,
        _positive,
    ),
    Option("--max-body-bytes", "Largest request body accepted.", 16 * 1024 * 1024, int),
    Option(
        "--on-bootstrap-error",
        "reject (502) or decode-only when no prefill can serve a request.",
        "reject",
        lambda v: BootstrapPolicy(v).value,
    ),
    Option("--breaker-failures", "Prefill failures in a row that open a pod's breaker.", 5, int),
    Option(
        "--breaker-cooldown",
        "Longest wait of an open prefill breaker, seconds (it starts at 1 s and doubles "
        "with each failed probe).",
        10.0,
        _positive,
    ),
    Option("--drain-timeout", "Seconds in-flight work may take after SIGTERM.", 30.0, float),
    Option("--shutdown-delay", "Seconds to keep serving after SIGTERM (NOT_SERVING).", 2.0, float),
    Option("--max-prefill-connections", "Connection pool size for prefill requests.", 1024, int),
    Option("--metrics-listen", "HOST:PORT for /metrics, /healthz, /readyz.", None, _host_port),
    Option(
        "--workers",
        "Processes sharing the listen port (SO_REUSEPORT), for more than one core.",
        1,
        int,
    ),
    Option("--log-level", "debug, info, warning or error.", "info"),
    Option("--log-format", "json or text.", "json", lambda v: _choice(v, ("json", "text"))),
    Option(
        "--log-bodies",
        "Add the first 4 KiB of each P/D request body (prompt text!) to its log line.",
        False,
        _boolean,
        switch=True,
    ),
)


def _choice(value: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValueError(f"{value!r} is not one of {', '.join(choices)}")
    return value


class ConfigError(ValueError):
    pass


def resolve(
    args: argparse.Namespace, env: Mapping[str, str], file_values: Mapping[str, Any]
) -> dict[str, Any]:
    """Settings by precedence: flag > environment > config file > default."""
    known = {opt.key for opt in SERVE_OPTIONS}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in config file: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for opt in SERVE_OPTIONS:
        given = getattr(args, opt.key)
        source: str
        if given is not None:
            raw: Any = given
            source = opt.flag
        elif any(name in env for name in opt.envs):
            name = next(name for name in opt.envs if name in env)
            raw = [v for v in env[name].split(",") if v.strip()] if opt.repeat else env[name]
            source = name
        elif opt.key in file_values:
            raw = file_values[opt.key]
            source = f"config key {opt.key}"
        else:
            values[opt.key] = opt.default
            continue
        try:
            if opt.repeat:
                items = raw if isinstance(raw, list) else [raw]
                values[opt.key] = [opt.parse(str(item)) for item in items]
            else:
                values[opt.key] = opt.parse(str(raw))
        except (ValueError, TargetError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return values


def load_config_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    import yaml

    data = yaml.safe_load(Path(path).read_text("utf-8")) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_settings(values: Mapping[str, Any]) -> Settings:
    try:
        pool = tuple(parse_host_port(v) for v in values["prefill"])
        dns = tuple(parse_host_port(v) for v in values["prefill_dns"])
        allow = AllowList.parse(values["prefill_allow"])
    except TargetError as exc:
        raise ConfigError(str(exc)) from None
    return Settings(
        listen=values["listen"],
        prefill_pool=pool,
        prefill_dns=dns,
        dns_refresh_s=values["dns_refresh"],
        allow=allow,
        pd_paths=frozenset(values["pd_path"]),
        bootstrap_port=values["mooncake_bootstrap_port"],
        bootstrap_timeout_s=values["bootstrap_timeout"],
        engine_cache_ttl_s=values["engine_cache_ttl"],
        engine_refresh_s=values["engine_refresh"],
        prefill_timeout_s=values["prefill_timeout"],
        envoy_max_message_timeout_s=values["envoy_max_message_timeout"],
        max_body_bytes=values["max_body_bytes"],
        on_bootstrap_error=BootstrapPolicy(values["on_bootstrap_error"]),
        breaker_failures=values["breaker_failures"],
        breaker_cooldown_s=values["breaker_cooldown"],
        drain_timeout_s=values["drain_timeout"],
        shutdown_delay_s=values["shutdown_delay"],
        max_prefill_connections=values["max_prefill_connections"],
        metrics_listen=values["metrics_listen"],
        log_bodies=values["log_bodies"],
    )


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the ext_proc processor",
        description="Run the ext_proc processor. Each flag can also be set by the environment "
        "variable shown and by the same key (dashes or underscores) in the --config YAML file; "
        "precedence: flag > environment > file > default.",
    )
    parser.add_argument("--config", help="YAML file of settings (keys as the flags, no dashes).")
    for opt in SERVE_OPTIONS:
        default = ", ".join(map(str, opt.default)) if opt.repeat else opt.default
        help_text = f"{opt.help} [env {', '.join(opt.envs)}; default {default or 'none'}]"
        if opt.switch:
            parser.add_argument(
                opt.flag, dest=opt.key, action="store_const", const="true", help=help_text
            )
            continue
        parser.add_argument(
            opt.flag,
            dest=opt.key,
            action="append" if opt.repeat else "store",
            default=None,
            help=help_text,
        )


def _add_envoy_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("envoy-config", help="print an Envoy bootstrap with pdproc in it")
    parser.add_argument("--listen", default="0.0.0.0:10000", help="Envoy listener HOST:PORT")
    parser.add_argument("--processor", action="append", help="pdproc HOST:PORT (repeatable)")
    parser.add_argument("--decode", action="append", required=True, help="decode HOST:PORT")
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin HOST:PORT")
    parser.add_argument("--pd-path", action="append", help="P/D path (repeatable)")
    parser.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument(
        "--max-message-timeout",
        type=float,
        default=300.0,
        help="max_message_timeout, seconds; keep it >= pdproc's --prefill-timeout + 1",
    )
    parser.add_argument("--access-log", action="store_true", help="JSON access log on stdout")
    parser.add_argument(
        "--no-processor", action="store_true", help="Envoy alone (benchmark baseline)"
    )
    parser.add_argument(
        "--single-message",
        action="store_true",
        help="request_header_mode SKIP: one ext_proc message on the request path instead "
        "of two (headers pdproc needs come as request_attributes)",
    )
    parser.add_argument(
        "--no-response-hold",
        action="store_true",
        help="response_header_mode: SKIP (measurement only: a failed prefill then cannot "
        "be turned into a clean error once the decode has answered)",
    )
    parser.add_argument(
        "--fail-closed",
        action="store_true",
        help="failure_mode_allow: false (500 when pdproc is unreachable)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=60.0,
        help="seconds a client may take to send its whole request (408 after; never cuts "
        "a response)",
    )
    parser.add_argument(
        "--request-headers-timeout",
        type=float,
        default=10.0,
        help="seconds a client may take to send its request headers (408 after)",
    )
    tls = parser.add_argument_group("TLS to pdproc (pdproc serve --tls-cert/--tls-key)")
    tls.add_argument("--processor-tls-ca", metavar="FILE", help="CA that signed pdproc's cert")
    tls.add_argument("--processor-tls-cert", metavar="FILE", help="client cert (mTLS)")
    tls.add_argument("--processor-tls-key", metavar="FILE", help="client key (mTLS)")
    tls.add_argument(
        "--processor-sni",
        metavar="NAME",
        help="SNI sent to pdproc and the DNS name its certificate must carry (default: the "
        "--processor hosts)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] in (["sim"], ["demo"]):
        # The simulator and the demo live in the separate pdproc-sim distribution.
        try:
            sim_entry: Callable[[list[str]], int] = import_module("pdproc_sim.cli").entry
        except ModuleNotFoundError as exc:
            if exc.name not in ("pdproc_sim", "pdproc_sim.cli"):
                raise
            print(f"pdproc {args_list[0]}: install pdproc-sim for this command", file=sys.stderr)
            return 2
        return sim_entry(args_list)
    parser = argparse.ArgumentParser(prog="pdproc", description=__doc__)
    parser.add_argument("--version", action="version", version=f"pdproc {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_envoy_config(sub)
    sub.add_parser("sim", help="simulated vLLM prefill/decode pair (pdproc-sim; `pdproc sim -h`)")
    sub.add_parser("demo", help="Envoy + pdproc + simulated P/D pair on loopback (pdproc-sim)")
    args = parser.parse_args(args_list)
    if args.command == "serve":
        return _serve(args)
    if args.command == "envoy-config":
        return _envoy_config(args)
    parser.error(f"unknown command {args.command}")
    return 2


def _serve(args: argparse.Namespace) -> int:
    from pdproc.logs import setup_logging
    from pdproc.server import run
    from pdproc.telemetry import provider_from_env

    try:
        values = resolve(args, os.environ, load_config_file(args.config))
        settings = build_settings(values)
        tracer_provider = provider_from_env()
    except (ConfigError, OSError, ValueError) as exc:
        print(f"pdproc serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(values["log_level"], values["log_format"])
    if values["workers"] > 1:
        from pdproc.workers import run_workers

        return run_workers(settings, values["workers"], values["log_level"], values["log_format"])
    return run(settings, tracer_provider)


def _envoy_config(args: argparse.Namespace) -> int:
    from pdproc.envoy_config import EnvoyOptions, parse_targets, render

    try:
        options = EnvoyOptions(
            listen=parse_host_port(args.listen),
            processor=parse_targets(args.processor or ["127.0.0.1:9002"]),
            decode=parse_targets(args.decode),
            admin=parse_host_port(args.admin),
            pd_paths=tuple(args.pd_path or DEFAULT_PD_PATHS),
            max_body_bytes=args.max_body_bytes,
            max_message_timeout_s=args.max_message_timeout,
            with_processor=not args.no_processor,
            access_log=args.access_log,
            failure_mode_allow=not args.fail_closed,
            hold_response=not args.no_response_hold,
            single_message=args.single_message,
            request_timeout_s=args.request_timeout,
            request_headers_timeout_s=args.request_headers_timeout,
            processor_tls_ca=args.processor_tls_ca,
            processor_tls_cert=args.processor_tls_cert,
            processor_tls_key=args.processor_tls_key,
            processor_sni=args.processor_sni,
        )
    except ValueError as exc:  # TargetError too
        print(f"pdproc envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def settings_table() -> str:
    """README's settings table, generated from SERVE_OPTIONS (a test keeps README current)."""
    rows = ["| flag | environment | YAML key | default | what it does |", "|---|---|---|---|---|"]
    for opt in SERVE_OPTIONS:
        default = ", ".join(map(str, opt.default)) if opt.repeat else opt.default
        envs = ", ".join(f"`{name}`" for name in opt.envs)
        rows.append(
            f"| `{opt.flag}` | {envs} | `{opt.key}` | `{default}` | {opt.help} |"
            if default not in (None, "")
            else f"| `{opt.flag}` | {envs} | `{opt.key}` | none | {opt.help} |"
        )
    return "\n".join(rows)
