"""Command line: `pdproc serve | envoy-config | sim | demo` (sim and demo: pdproc-sim).

Every `serve` setting is a flag, an environment variable (`PDPROC_<NAME>`, plus vLLM's
`MOONCAKE_BOOTSTRAP_PORT`) and a key of the YAML file given with `--config`; the flag wins
over the environment, which wins over the file, which wins over the default. The settings
themselves are declared once, in `pdproc.config.Settings`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from pathlib import Path
from typing import Any

from pdproc import __version__
from pdproc.config import DEFAULT_PD_PATHS, Declared, Settings, declared
from pdproc.targets import TargetError, parse_host_port


class ConfigError(ValueError):
    pass


class _DefaultsShown(argparse.HelpFormatter):
    """Help that names each option's default, where it has one worth naming."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: {action.default})"


def resolve(
    args: argparse.Namespace, env: Mapping[str, str], file_values: Mapping[str, Any]
) -> Settings:
    """Settings by precedence: flag > environment > config file > default."""
    settings = declared()
    unknown = sorted(set(file_values) - {s.name for s in settings})
    if unknown:
        raise ConfigError(f"config file: {unknown_key_message(unknown[0])}")
    values: dict[str, Any] = {}
    for setting in settings:
        found = _given(setting, args, env, file_values)
        if found is None:
            continue
        raw, source = found
        try:
            values[setting.name] = setting.parse(raw)
        except (ValueError, TargetError) as exc:
            raise ConfigError(f"{source}: {exc}") from None
    try:
        return Settings(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _given(
    setting: Declared,
    args: argparse.Namespace,
    env: Mapping[str, str],
    file_values: Mapping[str, Any],
) -> tuple[Any, str] | None:
    """The raw value of a setting and where it came from, or None for the default."""
    flag_value = getattr(args, setting.name, None)
    if flag_value is not None:
        return flag_value, setting.flag
    for name in setting.envs:
        if name in env:
            text = env[name]
            if setting.option.repeat:
                return [v for v in text.split(",") if v.strip()], name
            return text, name
    if setting.name in file_values:
        return file_values[setting.name], f"config key {setting.name}"
    return None


def unknown_key_message(key: str) -> str:
    """An unknown settings key, with the nearest known one (a typo is the usual cause)."""
    import difflib

    names = [s.name for s in declared()]
    near = difflib.get_close_matches(key.replace("-", "_"), names, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else " (the keys are the flags' names)"
    return f"unknown key {key!r}{hint}"


def load_config_file(path: str | None) -> dict[str, Any]:
    """The YAML settings file as a mapping of setting names (dashes or underscores)."""
    if not path:
        return {}
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text("utf-8")) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark else path
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings (key: value lines)")
    known = {s.name for s in declared()}
    for key in data:
        if str(key).replace("-", "_") not in known:
            raise ConfigError(f"{path}: {unknown_key_message(str(key))}")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


# serve --help: the settings in groups (a setting not listed here lands in the last group).
SETTING_GROUPS: dict[str, tuple[str, ...]] = {
    "listening and TLS": ("listen", "tls_cert", "tls_key", "tls_client_ca", "workers"),
    "prefill targets": (
        "prefill",
        "prefill_dns",
        "dns_refresh",
        "prefill_allow",
        "pd_path",
        "pd_min_prompt",
    ),
    "KV connector and bootstrap": (
        "kv_connector",
        "mooncake_bootstrap_port",
        "sglang_bootstrap_port",
        "bootstrap_timeout",
        "engine_cache_ttl",
        "engine_refresh",
        "on_bootstrap_error",
    ),
    "timeouts (keep them in step with the Envoy filter)": (
        "prefill_timeout",
        "envoy_message_timeout",
        "envoy_max_message_timeout",
    ),
    "limits and resilience": (
        "max_body_bytes",
        "stream_body_bytes",
        "max_inflight_bytes",
        "max_prefill_connections",
        "max_targets",
        "breaker_failures",
        "breaker_cooldown",
    ),
    "shutdown": ("drain_timeout", "shutdown_delay", "trace_flush_timeout"),
    "observability (tracing: the OTEL_* variables, see README)": (
        "metrics_listen",
        "log_level",
        "log_format",
        "log_bodies",
    ),
}


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the ext_proc processor",
        usage="pdproc serve [--config FILE] [options]  (options by group below)",
        description="Run the ext_proc processor. Each flag can also be set by the environment "
        "variable shown and by the same key (dashes or underscores) in the --config YAML file; "
        "precedence: flag > environment > file > default.",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of settings: one `key: value` per line, the key being the flag without "
        "its leading -- (prefill-timeout: 30, or prefill_timeout: 30); lists for repeatable "
        "settings.",
    )
    groups = {
        title: parser.add_argument_group(title) for title in [*SETTING_GROUPS, "other settings"]
    }
    group_of = {name: title for title, names in SETTING_GROUPS.items() for name in names}
    for setting in declared():
        group = groups[group_of.get(setting.name, "other settings")]
        default = setting.shown_default() or "none"
        repeat = "; repeatable" if setting.option.repeat else ""
        help_text = (
            f"{setting.option.help} [env {', '.join(setting.envs)}; default {default}{repeat}]"
        )
        if setting.option.switch:
            group.add_argument(
                setting.flag, dest=setting.name, action="store_const", const="true", help=help_text
            )
            continue
        group.add_argument(
            setting.flag,
            dest=setting.name,
            action="append" if setting.option.repeat else "store",
            default=None,
            help=help_text,
        )


def _add_envoy_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap with pdproc in it",
        formatter_class=_DefaultsShown,
    )
    parser.add_argument("--listen", default="0.0.0.0:10000", help="Envoy listener HOST:PORT")
    parser.add_argument(
        "--processor", action="append", help="pdproc HOST:PORT (repeatable; default 127.0.0.1:9002)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, help="decode HOST:PORT (repeatable)"
    )
    parser.add_argument("--admin", default="127.0.0.1:9901", help="Envoy admin HOST:PORT")
    parser.add_argument("--pd-path", action="append", help="P/D path (repeatable)")
    parser.add_argument(
        "--open-path",
        action="append",
        help="non-P/D path that reaches the decode pods, its body checked by the kv guard "
        "(repeatable; replaces the default /v1/models, /health, /version; every other path "
        "gets a 404)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="largest request body Envoy buffers (keep it equal to pdproc's)",
    )
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
        "--prefill-header",
        action="append",
        default=[],
        metavar="NAME",
        help="single-message mode: also send this request header to pdproc, for the "
        "prefill leg (repeatable; authorization and trace context are always sent)",
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
    parser.add_argument(
        "--envoy-version",
        metavar="X.Y",
        help="the Envoy release to write the config for, 1.36 to 1.40 (default: "
        "$PDPROC_ENVOY_VERSION, else the newest)",
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
    from pdproc.telemetry import describe_tracing, propagator_from_env, provider_from_env

    try:
        settings = resolve(args, os.environ, load_config_file(args.config))
        tracer_provider = provider_from_env()
        propagator_from_env()  # an unknown OTEL_PROPAGATORS name stops here, not in a worker
    except (ConfigError, OSError, ValueError) as exc:
        print(f"pdproc serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    logging.getLogger("pdproc").info(describe_tracing())
    from pdproc.limits import apply_descriptor_limit, needed_descriptors
    from pdproc.listeners import PortInUse, check_ports_free
    from pdproc.workers import run_workers, worker_count

    try:
        check_ports_free(
            [(settings.listen, "--listen"), (settings.metrics_listen, "--metrics-listen")]
        )
    except PortInUse as exc:
        print(f"pdproc serve: {exc}", file=sys.stderr)
        return 2
    plan = apply_descriptor_limit(
        needed_descriptors(settings.max_prefill_connections, settings.metrics_listen is not None)
    )
    if plan.refusal is not None:
        print(f"pdproc serve: {plan.refusal}", file=sys.stderr)
        return 2
    if plan.warning is not None:
        logging.getLogger("pdproc").warning("%s", plan.warning)
    if worker_count(settings) > 1:
        return run_workers(settings)
    return run(settings, tracer_provider)


def _envoy_config(args: argparse.Namespace) -> int:
    from pdproc.envoy_config import (
        DEFAULT_OPEN_PATHS,
        EnvoyOptions,
        default_envoy_version,
        parse_envoy_version,
        parse_targets,
        render,
    )

    try:
        options = EnvoyOptions(
            listen=parse_host_port(args.listen),
            processor=parse_targets(args.processor or ["127.0.0.1:9002"]),
            decode=parse_targets(args.decode),
            admin=parse_host_port(args.admin),
            pd_paths=tuple(args.pd_path or DEFAULT_PD_PATHS),
            open_paths=tuple(DEFAULT_OPEN_PATHS if args.open_path is None else args.open_path),
            max_body_bytes=args.max_body_bytes,
            max_message_timeout_s=args.max_message_timeout,
            with_processor=not args.no_processor,
            access_log=args.access_log,
            failure_mode_allow=not args.fail_closed,
            hold_response=not args.no_response_hold,
            single_message=args.single_message,
            prefill_headers=tuple(_header_names(args.prefill_header)),
            request_timeout_s=args.request_timeout,
            request_headers_timeout_s=args.request_headers_timeout,
            processor_tls_ca=args.processor_tls_ca,
            processor_tls_cert=args.processor_tls_cert,
            processor_tls_key=args.processor_tls_key,
            processor_sni=args.processor_sni,
            envoy_version=(
                parse_envoy_version(args.envoy_version)
                if args.envoy_version
                else default_envoy_version()
            ),
        )
    except ValueError as exc:  # TargetError too
        print(f"pdproc envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(options))
    return 0


def _header_names(names: Sequence[str]) -> list[str]:
    for name in names:
        if not name or not all(c.isascii() and (c.isalnum() or c in "-_") for c in name):
            raise TargetError(f"invalid --prefill-header {name!r}: not a header name")
    return list(names)


if __name__ == "__main__":
    sys.exit(main())
