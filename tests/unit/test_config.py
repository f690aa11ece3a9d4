"""pdproc.config: each setting declared once, for `serve` and for `envoy-config`."""

from __future__ import annotations

import dataclasses

import pytest

from pdproc.config import (
    DEFAULT_PD_PATHS,
    EnvoyConfigSettings,
    KvConnector,
    MiB,
    Settings,
    declared,
    serve_default,
)
from pdproc.targets import AllowList, HostPort


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"tls_cert": "/c.pem"}, "--tls-cert and --tls-key go together"),
        ({"tls_key": "/k.pem"}, "--tls-cert and --tls-key go together"),
        ({"tls_client_ca": "/ca.pem"}, "--tls-client-ca needs --tls-cert"),
    ],
)
def test_tls_settings_that_cannot_work_alone_are_refused(
    given: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Settings(**given)


def test_grpc_messages_may_exceed_the_body_limit() -> None:
    # An oversized body must reach pdproc's 413, not fail the gRPC stream.
    assert Settings().grpc_max_message_bytes == 64 * MiB
    big = Settings(max_body_bytes=100 * MiB)
    assert big.grpc_max_message_bytes > big.max_body_bytes


def test_an_unknown_choice_names_the_choices() -> None:
    connector = declared()[[s.name for s in declared()].index("kv_connector")]
    assert connector.parse("nixlv2") is KvConnector.NIXLV2
    with pytest.raises(ValueError, match="'nixl' is not one of mooncake, nixlv2, sglang"):
        connector.parse("nixl")


def test_repeatable_settings_combine_their_items() -> None:
    settings = {s.name: s for s in declared()}
    assert settings["pd_path"].parse(["/a", "/b", "/a"]) == frozenset({"/a", "/b"})
    assert settings["prefill"].parse("10.0.0.1:8000") == (HostPort("10.0.0.1", 8000),)
    allow = settings["prefill_allow"].parse(["10.0.0.0/8"])
    assert isinstance(allow, AllowList)
    with pytest.raises(ValueError, match="is not a path"):
        settings["pd_path"].parse(["v1/chat"])


def test_every_default_is_frozen_and_shown() -> None:
    for setting in declared():
        assert not isinstance(setting.default, (list, set, dict))
    shown = {s.name: s.shown_default() for s in declared()}
    assert shown["pd_path"] == ", ".join(DEFAULT_PD_PATHS)
    assert shown["kv_connector"] == "mooncake"
    assert shown["prefill_allow"] is None


def test_envoy_config_flags_have_no_environment_and_a_serve_twin_where_shared() -> None:
    envoy = {f.name: f for f in dataclasses.fields(EnvoyConfigSettings)}
    for name in ("max_body_bytes", "envoy_message_timeout", "envoy_max_message_timeout"):
        assert envoy[name].metadata["serve"] == name
        assert envoy[name].default == serve_default(name) == getattr(Settings(), name)
    flags = [s.flag for s in declared(EnvoyConfigSettings)]
    assert len(flags) == len(set(flags))
    assert "--decode" in flags
    assert EnvoyConfigSettings().processor == (HostPort("127.0.0.1", 9002),)
