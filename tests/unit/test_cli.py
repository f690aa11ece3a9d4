"""Settings: flag > environment > YAML file > default, with clear errors."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

import pytest

from pdproc import __version__
from pdproc.cli import ConfigError, load_config_file, main, resolve
from pdproc.config import BootstrapPolicy, Settings, declared, settings_table
from pdproc.targets import HostPort


def namespace(**given: object) -> argparse.Namespace:
    values: dict[str, object] = {setting.name: None for setting in declared()}
    values.update(given)
    return argparse.Namespace(**values)


def test_defaults() -> None:
    settings = resolve(namespace(), {}, {})
    assert settings == Settings()
    assert settings.listen == HostPort("0.0.0.0", 9002)
    assert settings.mooncake_bootstrap_port == 8998
    assert settings.prefill_timeout == 60.0
    assert settings.on_bootstrap_error is BootstrapPolicy.REJECT
    assert "/v1/chat/completions" in settings.pd_path


def test_every_setting_is_declared_once_with_flag_env_and_yaml_key() -> None:
    names = [setting.name for setting in declared()]
    assert len(names) == len(set(names))
    table = settings_table()
    for setting in declared():
        assert f"`{setting.flag}`" in table
        assert f"`PDPROC_{setting.name.upper()}`" in table
        # The default the table shows is the one Settings() has.
        assert getattr(Settings(), setting.name) == setting.default


def test_precedence_flag_over_env_over_file() -> None:
    file_values = {"mooncake_bootstrap_port": 9000, "prefill_timeout": 5, "breaker_failures": 7}
    env = {"MOONCAKE_BOOTSTRAP_PORT": "9001", "PDPROC_PREFILL_TIMEOUT": "6"}
    values = resolve(namespace(mooncake_bootstrap_port="9002"), env, file_values)
    assert values.mooncake_bootstrap_port == 9002  # flag
    assert values.prefill_timeout == 6.0  # env over file
    assert values.breaker_failures == 7  # file over default
    values = resolve(namespace(), env, file_values)
    assert values.mooncake_bootstrap_port == 9001


def test_pdproc_env_name_wins_over_vllm_alias() -> None:
    env = {"PDPROC_MOONCAKE_BOOTSTRAP_PORT": "7000", "MOONCAKE_BOOTSTRAP_PORT": "7001"}
    assert resolve(namespace(), env, {}).mooncake_bootstrap_port == 7000


def test_repeatable_settings_from_each_source(tmp_path: Path) -> None:
    config = tmp_path / "pdproc.yaml"
    config.write_text(
        "prefill:\n  - 10.0.0.1:8000\n  - '[fd00::1]:8000'\nprefill-allow: 10.0.0.0/8\n"
    )
    file_values = load_config_file(str(config))
    settings = resolve(namespace(), {}, file_values)
    assert settings.prefill == (HostPort("10.0.0.1", 8000), HostPort("fd00::1", 8000))
    env = {"PDPROC_PREFILL": "10.0.0.2:8000,10.0.0.3:8000"}
    assert len(resolve(namespace(), env, file_values).prefill) == 2
    flags = namespace(prefill=["10.0.0.9:1"])
    assert resolve(flags, env, file_values).prefill == (HostPort("10.0.0.9", 1),)


def test_unknown_file_key_is_rejected(tmp_path: Path) -> None:
    config = tmp_path / "pdproc.yaml"
    config.write_text("prefil: 10.0.0.1:8000\n")
    with pytest.raises(ConfigError, match=r"unknown key.*prefil"):
        resolve(namespace(), {}, load_config_file(str(config)))


@pytest.mark.parametrize(
    ("given", "env", "message"),
    [
        ({"prefill_timeout": "-1"}, {}, "--prefill-timeout"),
        ({}, {"MOONCAKE_BOOTSTRAP_PORT": "70000"}, "MOONCAKE_BOOTSTRAP_PORT"),
        ({"on_bootstrap_error": "maybe"}, {}, "--on-bootstrap-error"),
        ({"listen": "nowhere"}, {}, "--listen"),
        ({"tls_cert": "cert.pem"}, {}, "--tls-cert and --tls-key"),
        ({}, {"PDPROC_PD_PATH": "v1/chat"}, "PDPROC_PD_PATH"),
    ],
)
def test_bad_values_name_their_source(
    given: dict[str, str], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(namespace(**given), env, {})


def test_serve_reports_config_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("nope: 1\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert f"{config}: unknown key 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        # Enum settings list their choices (not "'mooncak' is not a valid KvConnector").
        (
            ["--kv-connector", "mooncak"],
            "--kv-connector: 'mooncak' is not one of mooncake, nixlv2, sglang",
        ),
        (
            ["--on-bootstrap-error", "drop"],
            "--on-bootstrap-error: 'drop' is not one of reject, decode-only",
        ),
        # Numbers say what is wrong (not "could not convert string to float").
        (["--prefill-timeout", "abc"], "--prefill-timeout: 'abc' is not a number"),
        (["--workers", "two"], "--workers: 'two' is not a whole number"),
        (["--mooncake-bootstrap-port", "8998.5"], "'8998.5' is not a whole number"),
    ],
)
def test_bad_flag_values_say_what_is_wrong(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert "Traceback" not in err


def test_malformed_yaml_names_file_and_line_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pdproc.yaml"
    config.write_text("prefill-timeout: 30\nprefill:\n  - a:8000\n bad: [\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdproc serve: {config}, line 4, column 2: not valid YAML")
    assert "<unicode string>" not in err
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_mistyped_key_names_the_file_and_the_nearest_key(tmp_path: Path) -> None:
    config = tmp_path / "pdproc.yaml"
    config.write_text("prefil-timeout: 30\n")
    with pytest.raises(ConfigError) as caught:
        load_config_file(str(config))
    assert (
        str(caught.value)
        == f"{config}: unknown key 'prefil-timeout' (did you mean prefill_timeout?)"
    )
    config.write_text("zzzz: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key 'zzzz' \(the keys are the flags' names\)"):
        load_config_file(str(config))


def test_yaml_keys_with_dashes_work_as_help_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pdproc.yaml"
    config.write_text("prefill-timeout: 7\nbreaker_failures: 3\n")
    settings = resolve(namespace(), {}, load_config_file(str(config)))
    assert (settings.prefill_timeout, settings.breaker_failures) == (7.0, 3)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "no dashes" not in help_text
    assert "or prefill_timeout: 30)" in help_text  # dashes or underscores


def test_serve_help_groups_every_setting(capsys: pytest.CaptureFixture[str]) -> None:
    from pdproc.cli import SETTING_GROUPS

    grouped = [name for names in SETTING_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(s.name for s in declared())
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    positions = [help_text.index(f"\n{title}:\n") for title in SETTING_GROUPS]
    assert positions == sorted(positions)
    # Each flag under its group's heading.
    for title, names in SETTING_GROUPS.items():
        section = group_section(help_text, title, SETTING_GROUPS)
        for name in names:
            assert "--" + name.replace("_", "-") in section, (title, name)


def group_section(help_text: str, title: str, titles: Iterable[str]) -> str:
    """The help text under the heading `title`, up to the next heading of `titles`."""
    start = help_text.index(f"\n{title}:\n")
    following = [help_text.find(f"\n{t}:\n", start + 1) for t in titles]
    end = min([p for p in following if p > start] or [len(help_text)])
    return help_text[start:end]


def test_unknown_propagator_stops_serve_with_the_choices(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_PROPAGATORS", "b3,jaeger")
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "OTEL_PROPAGATORS: unknown propagator 'jaeger'" in err
    assert "tracecontext, baggage, b3, b3multi, none" in err


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.strip() == f"pdproc {__version__}"
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    help_text = capsys.readouterr().out
    for setting in declared():
        assert setting.flag in help_text
    assert "PDPROC_PREFILL_TIMEOUT" in help_text


def test_switches_take_no_value_on_the_command_line_and_booleans_elsewhere() -> None:
    parser_values = resolve(namespace(log_bodies="true"), {"PDPROC_LOG_BODIES": "0"}, {})
    assert parser_values.log_bodies is True
    assert (
        resolve(namespace(), {"PDPROC_LOG_BODIES": "off"}, {"log_bodies": True}).log_bodies is False
    )
    assert resolve(namespace(), {}, {"log_bodies": True}).log_bodies is True
    assert resolve(namespace(), {}, {}).log_bodies is False
    with pytest.raises(ConfigError, match="PDPROC_LOG_BODIES"):
        resolve(namespace(), {"PDPROC_LOG_BODIES": "maybe"}, {})


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("fd00::1:9090", HostPort("fd00::1", 9090)),
        ("[fd00::1]:9090", HostPort("fd00::1", 9090)),
        ("10.1.2.3:9090", HostPort("10.1.2.3", 9090)),
        ("[::1]:0", HostPort("::1", 0)),
    ],
)
def test_listen_addresses_accept_a_bare_ipv6_pod_ip(value: str, expected: HostPort) -> None:
    """`$(POD_IP):9090` on an IPv6 cluster has no brackets; a listen address ends with its
    port, so it is still unambiguous."""
    assert resolve(namespace(metrics_listen=value), {}, {}).metrics_listen == expected


def test_envoy_config_shares_serve_declarations_where_they_must_agree() -> None:
    from dataclasses import fields

    from pdproc.config import EnvoyConfigSettings
    from pdproc.envoy_config import EnvoyOptions

    serve = {s.name: s for s in declared()}
    shared = [f for f in fields(EnvoyConfigSettings) if "serve" in f.metadata]
    assert {f.metadata["serve"] for f in shared} >= {
        "max_body_bytes",
        "envoy_message_timeout",
        "envoy_max_message_timeout",
        "pd_path",
    }
    for f in shared:
        source = serve[f.metadata["serve"]]
        # The same flag, default and parser as `serve`: nothing to keep equal by hand.
        assert f.name == source.name
        assert f.default == source.default
        assert f.metadata["option"].parse is source.option.parse
    # The render options default to the same values when built without the CLI.
    options = EnvoyOptions(
        HostPort("a", 1), [HostPort("b", 2)], [HostPort("c", 3)], HostPort("d", 4)
    )
    defaults = Settings()
    assert options.max_body_bytes == defaults.max_body_bytes
    assert options.message_timeout_s == defaults.envoy_message_timeout
    assert options.max_message_timeout_s == defaults.envoy_max_message_timeout


def _envoy_options(argv: list[str]) -> object:
    from pdproc.cli import resolve_flags
    from pdproc.envoy_config import options_from

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    from pdproc.cli import _add_envoy_config

    _add_envoy_config(sub)
    return options_from(resolve_flags(parser.parse_args(["envoy-config", *argv])))


def test_envoy_config_flags_reach_the_render_options() -> None:
    from pdproc.config import DEFAULT_PD_PATHS
    from pdproc.envoy_config import EnvoyOptions

    options = _envoy_options(["--decode", "127.0.0.1:8200"])
    assert isinstance(options, EnvoyOptions)
    assert list(options.pd_paths) == list(DEFAULT_PD_PATHS)  # declared order, not a set's
    assert options.processor == (HostPort("127.0.0.1", 9002),)
    argv = ["--decode", "10.0.0.1:8200", "--decode", "10.0.0.2:8200", "--max-body-bytes",
            "1234", "--envoy-message-timeout", "4", "--max-message-timeout", "90",
            "--pd-path", "/v1/completions", "--pd-path", "/b", "--pd-path", "/a",
            "--single-message", "--prefill-header", "x-api-key"]  # fmt: skip
    options = _envoy_options(argv)
    assert isinstance(options, EnvoyOptions)
    assert options.decode == (HostPort("10.0.0.1", 8200), HostPort("10.0.0.2", 8200))
    assert (options.max_body_bytes, options.message_timeout_s) == (1234, 4.0)
    assert options.max_message_timeout_s == 90.0  # the older spelling still works
    assert list(options.pd_paths) == ["/v1/completions", "/a", "/b"]
    assert options.single_message
    assert options.prefill_headers == ("x-api-key",)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "127.0.0.1:8200", "--max-body-bytes", "0"], "--max-body-bytes:"),
        (["--decode", "127.0.0.1:8200", "--envoy-message-timeout", "-1"], "not positive"),
        (["--decode", "nohost"], "--decode:"),
        (["--decode", "127.0.0.1:1", "--prefill-header", "x'] || y"], "not a header name"),
        (["--decode", "127.0.0.1:1", "--pd-path", "v1"], "is not a path"),
    ],
)
def test_envoy_config_refuses_bad_flags_with_the_flag_named(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(["envoy-config", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdproc envoy-config: ")
    assert message in err
    assert "Traceback" not in err
