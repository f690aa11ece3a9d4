"""Command line: `pdproc serve | envoy-config | sim | demo` (sim and demo: pdproc-sim).

Every `serve` setting is a flag, an environment variable (`PDPROC_<NAME>`, plus vLLM's
`MOONCAKE_BOOTSTRAP_PORT`) and a key of the YAML file given with `--config`; the flag wins
over the environment, which wins over the file, which wins over the default. The settings
themselves are declared once, in `pdproc.config.Settings`; `envoy-config`'s flags in
`pdproc.config.EnvoyConfigSettings`, which shares serve's declarations where the two must
agree (same flag, same default).
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
from pdproc.config import Declared, EnvoyConfigSettings, Settings, declared
from pdproc.targets import TargetError


class ConfigError(ValueError):
    pass


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


def resolve_flags(args: argparse.Namespace) -> EnvoyConfigSettings:
    """envoy-config's settings: its flags over their defaults."""
    values: dict[str, Any] = {}
    for setting in declared(EnvoyConfigSettings):
        raw = getattr(args, setting.name, None)
        if raw is None:
            continue
        try:
            values[setting.name] = setting.parse(raw)
        except (ValueError, TargetError) as exc:
            raise ConfigError(f"{setting.flag}: {exc}") from None
    return EnvoyConfigSettings(**values)


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
    "listening and TLS": (
        "listen",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
        "tls_reload",
        "tls_max_connection_age",
        "workers",
    ),
    "prefill targets": (
        "prefill",
        "prefill_dns",
        "dns_refresh",
        "prefill_allow",
        "pd_path",
        "pd_min_prompt",
        "pool_policy",
        "prefix_blocks_per_pod",
        "prefix_balance",
        "decode",
        "decode_dns",
        "decode_choice",
        "decode_skip_pd_fraction",
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
        "max_named_host_connections",
        "dead_peer_timeout",
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
        _add_flag(groups[group_of.get(setting.name, "other settings")], setting, env=True)


def _add_flag(group: argparse._ActionsContainer, setting: Declared, *, env: bool) -> None:
    """One declared setting as a flag: its help names its default (and environment)."""
    default = setting.shown_default()
    if env:
        shown = [f"env {', '.join(setting.envs)}", f"default {default or 'none'}"]
    elif setting.option.required:
        shown = ["required"]
    else:
        shown = [f"default {default}"] if default and not setting.option.switch else []
    if setting.option.repeat:
        shown.append("repeatable")
    help_text = f"{setting.option.help} [{'; '.join(shown)}]" if shown else setting.option.help
    flags = (setting.flag, *setting.option.aliases)
    if setting.option.switch:
        group.add_argument(
            *flags, dest=setting.name, action="store_const", const="true", help=help_text
        )
        return
    group.add_argument(
        *flags,
        dest=setting.name,
        action="append" if setting.option.repeat else "store",
        default=None,
        required=setting.option.required,
        help=help_text,
    )


# envoy-config --help: its flags in groups (a flag not listed here lands in the last group).
ENVOY_CONFIG_GROUPS: dict[str, tuple[str, ...]] = {
    "addresses": ("listen", "processor", "decode", "admin"),
    "routes": ("pd_path", "open_path"),
    "pass pdproc serve's values": (
        "max_body_bytes",
        "envoy_message_timeout",
        "envoy_max_message_timeout",
        "decode_choice",
    ),
    "TLS to pdproc (pdproc serve --tls-cert/--tls-key)": (
        "processor_tls_ca",
        "processor_tls_cert",
        "processor_tls_key",
        "processor_sni",
    ),
}


def _add_envoy_config(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "envoy-config",
        help="print an Envoy bootstrap with pdproc in it",
        description="Print an Envoy bootstrap with pdproc in its filter chain. The flags "
        "shared with `pdproc serve` take the same values on both commands.",
    )
    groups = {
        title: parser.add_argument_group(title)
        for title in [*ENVOY_CONFIG_GROUPS, "Envoy behaviour"]
    }
    group_of = {name: title for title, names in ENVOY_CONFIG_GROUPS.items() for name in names}
    for setting in declared(EnvoyConfigSettings):
        _add_flag(groups[group_of.get(setting.name, "Envoy behaviour")], setting, env=False)


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


def _check_tls_files(settings: Settings) -> None:
    """Unusable --tls-* files stop the start here (BadTlsFiles, OSError), not in a worker."""
    from pdproc.tls_reload import TlsFiles, parse_material

    if settings.tls_cert is not None and settings.tls_key is not None:
        parse_material(
            *TlsFiles(settings.tls_cert, settings.tls_key, settings.tls_client_ca).read()
        )


def _serve(args: argparse.Namespace) -> int:
    from pdproc.logs import setup_logging
    from pdproc.server import run
    from pdproc.telemetry import describe_tracing, propagator_from_env, provider_from_env

    try:
        settings = resolve(args, os.environ, load_config_file(args.config))
        tracer_provider = provider_from_env()
        propagator_from_env()  # an unknown OTEL_PROPAGATORS name stops here, not in a worker
        _check_tls_files(settings)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"pdproc serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    logging.getLogger("pdproc").info(describe_tracing())
    from pdproc.limits import apply_descriptor_limit, needed_descriptors
    from pdproc.multiprocess.listeners import PortInUse, check_ports_free
    from pdproc.multiprocess.supervisor import run_workers, worker_count
    from pdproc.pod_http import CONTROL_CONNECTIONS

    try:
        check_ports_free(
            [(settings.listen, "--listen"), (settings.metrics_listen, "--metrics-listen")]
        )
    except PortInUse as exc:
        print(f"pdproc serve: {exc}", file=sys.stderr)
        return 2
    plan = apply_descriptor_limit(
        needed_descriptors(
            settings.max_prefill_connections + CONTROL_CONNECTIONS,
            settings.metrics_listen is not None,
        )
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
    from pdproc.envoy_config import options_from, render

    try:
        options = options_from(resolve_flags(args))
    except ValueError as exc:  # ConfigError and TargetError too
        print(f"pdproc envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render(options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
