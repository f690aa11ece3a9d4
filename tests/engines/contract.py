"""The simulator's contract with the real engines: one scenario through Envoy and pdproc,
once to a real pair and once to `pdproc-sim`, with a recording proxy on each leg; the field
sets (paths, nesting, nulls) and statuses each leg sent and received must be the same."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdproc_sim.devstack import start_sim

from tests.engines.front import openai_body, prompt, running_front, send
from tests.engines.harness import Engine, measured
from tests.engines.recorder import Exchange, recording_proxy, shape

SCENARIO = [
    ("/v1/completions", False),
    ("/v1/completions", True),
    ("/v1/chat/completions", True),
]
SIM_CONNECTOR = {"nixl": "nixlv2", "mooncake": "mooncake"}


def leg_fields(leg: str, exchanges: list[Exchange]) -> dict[str, set[str]]:
    """What crossed one leg, per request: the kv_transfer_params it carried, the answer's
    status and the answer's fields (each SSE event's, for a stream)."""
    out: dict[str, set[str]] = {}
    for exchange in exchanges:
        request = exchange.request if isinstance(exchange.request, dict) else {}
        stream = bool(request.get("stream"))
        name = f"{leg} {exchange.path} stream={stream}"
        out[f"{name} request kv_transfer_params"] = shape(
            request.get("kv_transfer_params"), "$.kv_transfer_params"
        )
        out[f"{name} status"] = {str(exchange.status)}
        if stream:
            fields: set[str] = set()
            for event in exchange.events():
                fields |= shape(event, "$event")
            out[f"{name} answer"] = fields
        else:
            out[f"{name} answer"] = shape(exchange.response_json())
    return out


@contextlib.contextmanager
def proxied(prefill: Engine, decode: Engine, log: Path) -> Iterator[tuple[Engine, Engine, Any]]:
    """Stand-ins for `prefill` and `decode` whose ports are recording proxies in front of
    them (the bootstrap / side-channel port stays the engine's own)."""
    with (
        recording_proxy(prefill.url) as p_rec,
        recording_proxy(decode.url) as d_rec,
    ):
        p = Engine("proxy-prefill", "prefill", prefill.connector, p_rec.port, [], {}, log)
        p.side_port = prefill.side_port
        d = Engine("proxy-decode", "decode", decode.connector, d_rec.port, [], {}, log)
        yield p, d, (p_rec, d_rec)


def scenario_fields(
    prefill: Engine, decode: Engine, workdir: Path, name: str
) -> dict[str, set[str]]:
    workdir.mkdir(parents=True, exist_ok=True)
    with proxied(prefill, decode, workdir / "proxy.log") as (p, d, (p_rec, d_rec)):
        with running_front(f"contract-{name}", workdir, p, d, workers="1") as front:
            for path, stream in SCENARIO:
                answer = send(front.url, path, openai_body(path, prompt("contract"), stream))
                assert answer.status == 200, (name, path, answer.body)
        seen = {**leg_fields("prefill", p_rec.exchanges), **leg_fields("decode", d_rec.exchanges)}
    return {**seen, **probe_statuses(prefill.connector, prefill.url)}


def sim_fields(connector: str, workdir: Path) -> dict[str, set[str]]:
    """The same scenario against `pdproc-sim pair` (the installed wheel)."""
    workdir.mkdir(parents=True, exist_ok=True)
    sim = start_sim(workdir, ["--kv-connector", SIM_CONNECTOR[connector]])
    try:
        log = workdir / "sim.log"
        prefill = Engine("sim-prefill", "prefill", connector, sim.prefill.port, [], {}, log)
        prefill.side_port = sim.bootstrap.port
        decode = Engine("sim-decode", "decode", connector, sim.decode.port, [], {}, log)
        return scenario_fields(prefill, decode, workdir, "sim")
    finally:
        sim.process.stop()


def differences(real: dict[str, set[str]], sim: dict[str, set[str]]) -> list[str]:
    """Readable differences: a leg seen on one side only, or a field whose presence or kind
    differs."""
    out = []
    for key in sorted(set(real) | set(sim)):
        if key not in sim:
            out.append(f"{key}: only the real engines")
            continue
        if key not in real:
            out.append(f"{key}: only the simulator")
            continue
        only_real = sorted(real[key] - sim[key])
        only_sim = sorted(sim[key] - real[key])
        if only_real or only_sim:
            out.append(f"{key}: real only {only_real}; sim only {only_sim}")
    return out


def compare(prefill: Engine, decode: Engine, workdir: Path, sim_connector: str) -> list[str]:
    """The scenario through the real pair and through pdproc-sim (`sim_connector`): the
    differences, each also recorded among the measured lines."""
    real = scenario_fields(prefill, decode, workdir / "real", "real")
    sim = sim_fields(sim_connector, workdir / "sim")
    found = differences(real, sim)
    for line in found:
        measured(f"{prefill.connector} contract difference: {line}")
    return found


# Requests a router could get wrong, sent straight to the prefill: the status each gets.
# The real prefill logs a warning and serves them (200). Only prefill probes: the same kind
# of mistake on the decode leg (do_remote_prefill without remote_block_ids, NIXL; without
# remote_bootstrap_addr, Mooncake) kills vLLM 0.32's EngineCore (an AssertionError in the
# NIXL scheduler; a KeyError in Mooncake's once the request is aborted), so the suite cannot
# send it to the pair it shares; the simulator answers those with a 400 instead
# (docs/engines.md).
def _nixl_probes() -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
    return {
        "prefill: remote_* fields set": (
            {"do_remote_decode": True, "remote_port": 1, "remote_host": "127.0.0.1"},
            {"x-request-id": "probe-1"},
        ),
        "prefill: no x-request-id": ({"do_remote_decode": True}, {}),
    }


def _mooncake_probes() -> dict[str, tuple[dict[str, Any], dict[str, str]]]:
    return {"prefill: no transfer_id": ({"do_remote_decode": True}, {})}


def probe_statuses(connector: str, prefill_url: str) -> dict[str, set[str]]:
    probes = _nixl_probes() if connector == "nixl" else _mooncake_probes()
    out: dict[str, set[str]] = {}
    for name, (params, headers) in probes.items():
        body = openai_body("/v1/completions", prompt("probe"), False, max_tokens=1)
        body["kv_transfer_params"] = params
        try:
            answer = send(prefill_url, "/v1/completions", body, timeout_s=60, headers=headers)
        except TimeoutError:
            out[f"probe {name} status"] = {"no answer in 60 s"}
        else:
            out[f"probe {name} status"] = {str(answer.status)}
    return out
