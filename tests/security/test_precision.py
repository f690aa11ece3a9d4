"""Numbers that one leg carries and the other does not.

The decode body is the client's bytes with the gateway's params spliced in, so its numbers
keep their exact spelling; the prefill body is re-serialised by orjson, which holds 64-bit
integers and turns larger ones into floats. Earlier, `"seed": 18446744073709551616`
(2**64) reached the decode as that integer and the prefill as `1.8446744073709552e19`: the
two legs of one request sampled differently. Now integers outside [-2**63, 2**64 - 1] are a
400, and those inside reach both legs exactly.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from pdproc_sim.devstack import Stack

from tests.stacks import records, served

from .conftest import Pd, raw_records, send
from .pods import HostilePod

OUT_OF_RANGE = [2**64, -(2**63) - 1, 10**30, -(10**30)]
EXACT = [2**64 - 1, 2**63, 2**63 - 1, -(2**63)]


def body_with_seed(seed: int) -> bytes:
    return (
        b'{"model":"m","messages":[{"role":"user","content":"Hello"}],"max_tokens":4,"seed":'
        + str(seed).encode()
        + b"}"
    )


@pytest.mark.e2e
@pytest.mark.parametrize("seed", OUT_OF_RANGE)
def test_integer_beyond_64_bits_gets_400(fresh: Stack, seed: int) -> None:
    response = send(fresh, body_with_seed(seed), str(fresh.sim.prefill))
    assert response.status_code == 400, response.text
    assert response.headers["x-pdproc-error"] == "bad_request"
    assert "64 bits" in response.json()["message"]
    assert records(fresh, "decode") == []
    assert records(fresh, "prefill") == []


@pytest.mark.e2e
@pytest.mark.parametrize("seed", EXACT)
def test_64_bit_integers_reach_both_legs_exactly(fresh: Stack, seed: int) -> None:
    response = send(fresh, body_with_seed(seed), str(fresh.sim.prefill))
    assert response.status_code == 200, response.text
    served(fresh, "decode", 1)
    served(fresh, "prefill", 1)
    # Parsed with Python's json: an integer of any size stays exact (and a float stays one).
    (decode,) = raw_records(fresh, "decode")
    (prefill,) = raw_records(fresh, "prefill")
    for leg in (decode, prefill):
        assert type(leg["body"]["seed"]) is int
        assert leg["body"]["seed"] == seed
    assert (
        decode["body"]["kv_transfer_params"]["transfer_id"]
        == (prefill["body"]["kv_transfer_params"]["transfer_id"])
    )


@pytest.mark.parametrize("seed", EXACT)
async def test_both_legs_carry_the_exact_bytes_of_a_64_bit_integer(
    pod: HostilePod, make_pdproc: Any, seed: int
) -> None:
    """The same, on the wire: the decode body Envoy forwards and the prefill body the
    (hostile) prefill pod receives, compared as raw bytes and as exact integers."""
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(body_with_seed(seed), prefill=pod.address)
    assert outcome.disaggregated
    assert outcome.decode_body is not None
    (prefill,) = pod.prefills()
    spelled = b'"seed":' + str(seed).encode()
    assert spelled in outcome.decode_body
    assert spelled in prefill.body
    assert json.loads(outcome.decode_body)["seed"] == seed
    assert json.loads(prefill.body)["seed"] == seed


@pytest.mark.parametrize("seed", OUT_OF_RANGE)
async def test_out_of_range_integer_anywhere_gets_400_in_process(
    pod: HostilePod, make_pdproc: Any, seed: int
) -> None:
    pd: Pd = await make_pdproc(pod)
    nested = b'{"model":"m","tools":[{"x":{"y":[1,2,' + str(seed).encode() + b"]}}]}"
    for body in (body_with_seed(seed), nested):
        outcome = await pd.play(body, prefill=pod.address)
        assert outcome.status == 400
        assert outcome.error_kind == "bad_request"
    # A digit run inside a string is text, not a number: it passes.
    text = b'{"model":"m","prompt":"' + str(seed).encode() + b'"}'
    assert (await pd.play(text, prefill=pod.address)).disaggregated
    assert len(pod.prefills()) == 1
