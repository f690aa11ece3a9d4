"""--decode-choice prefix through Envoy: two simulated prefill pods and two simulated decodes
with prefix caches; pdproc names the decode of each request (pdproc.decode_endpoint) and the
decode cluster's override_host policy routes to it. A conversation's turns land on the decode
that holds its history, a turn whose decode holds most of its prompt skips P/D, and a client's
x-gateway-destination-endpoint never routes, with pdproc up or down."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdproc_sim.devstack import Envoy, Process, scrape_metric, start_envoy, start_pdproc
from pdproc_sim.poolstack import SimPool, running_pool
from prometheus_client.parser import text_string_to_metric_families

from pdproc.targets import HostPort

pytestmark = pytest.mark.e2e

CACHE = ("--prefix-cache-blocks", "512")
SYSTEM = "You answer questions about gardening with care and precision. " * 30
# Long enough that one turn's question and answer are far less than a fifth of the prompt.
LONG = SYSTEM * 4
DESTINATION = "x-gateway-destination-endpoint"


@contextlib.contextmanager
def decode_front(
    workdir: Path,
    pool: SimPool,
    args: Sequence[str] = (),
    *,
    decode_choice: bool = True,
    processes: list[Process] | None = None,
    single_message: bool = False,
) -> Iterator[tuple[Envoy, HostPort]]:
    """pdproc with the pool's prefills and decodes as static members, behind an Envoy whose
    decode cluster routes on pdproc's choice; yields Envoy and pdproc's metrics address
    (pdproc's process goes to `processes`, for a test that stops it)."""
    port = str(pool.bootstrap_port)
    argv = ["--prefill-allow", "127.0.0.0/8"]
    argv += ["--mooncake-bootstrap-port", port, "--sglang-bootstrap-port", port]
    for member in pool.prefills:
        argv += ["--prefill", str(member)]
    if decode_choice:
        argv += ["--decode-choice", "prefix"]
        for decode in pool.decodes:
            argv += ["--decode", str(decode)]
    procs = []
    try:
        proc, addr, metrics = start_pdproc(workdir, [*argv, *args])
        procs.append(proc)
        if processes is not None:
            processes.append(proc)
        envoy = start_envoy(
            workdir,
            pool.decodes,
            [addr],
            extra_options={"decode_choice": decode_choice, "single_message": single_message},
        )
        procs.append(envoy.process)
        yield envoy, metrics
    finally:
        for proc in reversed(procs):
            proc.stop()


def turn(
    client: httpx.Client,
    url: str,
    messages: list[dict[str, Any]],
    question: str,
    headers: dict[str, str] | None = None,
) -> None:
    messages.append({"role": "user", "content": question})
    body = {"model": "m", "messages": messages, "max_tokens": 8}
    response = client.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    messages.append(
        {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
    )


def decode_records(pool: SimPool) -> list[list[dict[str, Any]]]:
    """What each decode received, in the pool's order."""
    return [
        httpx.get(decode.url() + "/sim/requests", timeout=10).json()["requests"]
        for decode in pool.decodes
    ]


def prefill_count(pool: SimPool) -> int:
    return sum(
        len(httpx.get(member.url() + "/sim/requests", timeout=10).json()["requests"])
        for member in pool.prefills
    )


def tokens_by_source(decode: HostPort) -> dict[str, float]:
    page = httpx.get(decode.url() + "/metrics", timeout=10).text
    return {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == "vllm:prompt_tokens_by_source_total"
    }


def conversation_of(record: dict[str, Any]) -> str:
    return str(record["body"]["messages"][1]["content"]).split(":")[0]


def served_by(pool: SimPool) -> dict[str, set[int]]:
    """Conversation name -> the decodes that served its turns."""
    out: dict[str, set[int]] = {}
    for index, records in enumerate(decode_records(pool)):
        for record in records:
            out.setdefault(conversation_of(record), set()).add(index)
    return out


@pytest.mark.parametrize("connector", ["mooncake", "nixlv2", "sglang"])
def test_a_conversation_stays_on_the_decode_that_holds_it(tmp_path: Path, connector: str) -> None:
    """Never skipping P/D (fraction 0): every turn is P/D, and all turns of a conversation
    go to one decode, conversations spread over both (whichever connector builds the
    decode's body: pdproc's answer before the prefill, or after it for NIXL)."""
    kv = ("--kv-connector", connector)
    with (
        running_pool(tmp_path, 2, 2, (*CACHE, *kv), (*CACHE, *kv)) as pool,
        decode_front(tmp_path, pool, ["--decode-skip-pd-fraction", "0", *kv]) as (
            envoy,
            metrics,
        ),
        httpx.Client(timeout=30) as client,
    ):
        names = [f"conv{i}" for i in range(12)]
        for index, name in enumerate(names):
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"{index} {SYSTEM}"}]
            for number in range(3):
                turn(client, envoy.url, messages, f"{name}: question {number} " * 8)
        where = served_by(pool)
        assert set(where) == set(names)
        assert all(len(decodes) == 1 for decodes in where.values()), where
        assert {next(iter(decodes)) for decodes in where.values()} == {0, 1}, where
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="pd") == 36
        assert scrape_metric(metrics, "pdproc_decode_choices_total", reason="prefix") == 24
        assert prefill_count(pool) == 36


@pytest.mark.parametrize("connector", ["mooncake", "nixlv2"])
def test_the_next_turn_of_a_long_prompt_skips_pd_on_its_decode(
    tmp_path: Path, connector: str
) -> None:
    """The first turn is P/D; the second, whose decode holds nearly all of its prompt, goes to
    that decode alone: no prefill, no kv_transfer_params, counted decode_cached."""
    kv = ("--kv-connector", connector)
    with (
        running_pool(tmp_path, 2, 2, (*CACHE, *kv), (*CACHE, *kv)) as pool,
        decode_front(tmp_path, pool, kv) as (envoy, metrics),
        httpx.Client(timeout=30) as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "system", "content": LONG}]
        turn(client, envoy.url, messages, "long: the first question")
        assert prefill_count(pool) == 1
        turn(client, envoy.url, messages, "long: the second question")
        assert prefill_count(pool) == 1
        records = decode_records(pool)
        served = [index for index, found in enumerate(records) if found]
        assert len(served) == 1, records
        first, second = records[served[0]]
        assert "kv_transfer_params" in first["body"]
        assert "kv_transfer_params" not in second["body"]
        assert second["body"]["messages"] == messages[:-1]
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="decode_cached") == 1
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="pd") == 1
        # The decode found the first turn's prompt and answer in its own cache.
        assert tokens_by_source(pool.decodes[served[0]])["local_cache_hit"] > len(LONG) // 8


def test_bodies_past_the_stream_threshold_are_buffered_to_be_routed(tmp_path: Path) -> None:
    """Envoy picks the upstream host when the request headers go on, before a streamed body
    is known: with the decode choice on, a body past --stream-body-bytes is buffered, so
    its decode is still the conversation's."""
    args = ["--decode-skip-pd-fraction", "0", "--stream-body-bytes", "1024"]
    with (
        running_pool(tmp_path, 2, 2, prefill_args=CACHE, decode_args=CACHE) as pool,
        decode_front(tmp_path, pool, args) as (envoy, metrics),
        httpx.Client(timeout=30) as client,
    ):
        for index in range(6):
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"{index} {LONG}"}]
            for number in range(3):
                turn(client, envoy.url, messages, f"big{index}: question {number}")
        where = served_by(pool)
        assert len(where) == 6
        assert all(len(decodes) == 1 for decodes in where.values()), where
        assert scrape_metric(metrics, "pdproc_streamed_request_bodies_total") == 0
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="pd") == 18


def test_single_message_mode_routes_on_the_choice_too(tmp_path: Path) -> None:
    """Single-message mode: the request headers are not held for pdproc's body answer, but
    the kv guard after ext_proc holds them until the body is checked, so the host is picked
    after pdproc named it; the second turn skips P/D there."""
    with (
        running_pool(tmp_path, 2, 2, prefill_args=CACHE, decode_args=CACHE) as pool,
        decode_front(tmp_path, pool, single_message=True) as (envoy, metrics),
        httpx.Client(timeout=30) as client,
    ):
        for index in range(6):
            messages: list[dict[str, Any]] = [{"role": "system", "content": f"{index} {LONG}"}]
            for number in range(2):
                turn(client, envoy.url, messages, f"single{index}: question {number}")
        where = served_by(pool)
        assert len(where) == 6
        assert all(len(decodes) == 1 for decodes in where.values()), where
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="decode_cached") == 6


def test_sglang_decodes_are_named_but_never_skip_pd(tmp_path: Path) -> None:
    """An SGLang decode refuses a request without a bootstrap room: the second turn goes to
    the same decode, still P/D."""
    kv = ("--kv-connector", "sglang")
    with (
        running_pool(tmp_path, 2, 2, (*CACHE, *kv), (*CACHE, *kv)) as pool,
        decode_front(tmp_path, pool, kv) as (envoy, metrics),
        httpx.Client(timeout=30) as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "system", "content": LONG}]
        turn(client, envoy.url, messages, "sglang: the first question")
        turn(client, envoy.url, messages, "sglang: the second question")
        assert prefill_count(pool) == 2
        assert sorted(len(found) for found in decode_records(pool)) == [0, 2]
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="pd") == 2


def test_a_client_destination_header_never_routes(tmp_path: Path) -> None:
    """A client naming the other decode in x-gateway-destination-endpoint: with pdproc up the
    turn goes to the conversation's decode; with pdproc down (Envoy fails open) the decode
    is least request's, and no decode ever sees the header."""
    processes: list[Process] = []
    with (
        running_pool(tmp_path, 2, 2, prefill_args=CACHE, decode_args=CACHE) as pool,
        decode_front(tmp_path, pool, processes=processes) as (envoy, _),
        httpx.Client(timeout=30) as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        turn(client, envoy.url, messages, "forged: first")
        home = next(index for index, found in enumerate(decode_records(pool)) if found)
        other = pool.decodes[1 - home]
        forged = {DESTINATION: str(other)}
        for number in range(3):
            turn(client, envoy.url, messages, f"forged: again {number}", headers=forged)
        records = decode_records(pool)
        assert len(records[home]) == 4, records
        assert not records[1 - home], records
        processes[0].stop()
        # Each of these is least request's choice between the two (both idle): that every
        # one lands on the forged decode has odds 2**-24 unless the header routes.
        for number in range(24):
            response = client.post(
                envoy.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"down {number}"}]},
                headers=forged,
            )
            assert response.status_code == 200, response.text
        records = decode_records(pool)
        assert len(records[home]) > 4, [len(found) for found in records]
        for found in records:
            assert all(DESTINATION not in record["headers"] for record in found)


def test_with_the_choice_off_the_decode_is_envoys(tmp_path: Path) -> None:
    """Without --decode-choice the generated cluster is least request and pdproc names no
    decode: a conversation's P/D turns spread over both decodes."""
    with (
        running_pool(tmp_path, 2, 2, prefill_args=CACHE, decode_args=CACHE) as pool,
        decode_front(tmp_path, pool, decode_choice=False) as (envoy, metrics),
        httpx.Client(timeout=30) as client,
    ):
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for number in range(16):
            turn(client, envoy.url, messages, f"off: question {number}")
        records = decode_records(pool)
        assert all(records), [len(found) for found in records]
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="pd") == 16
        assert scrape_metric(metrics, "pdproc_requests_total", outcome="decode_cached") == 0
