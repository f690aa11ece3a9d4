"""An `x-prefiller-host-port` that names no pod.

The docs said an empty value means "no disaggregation" (llm-d's sidecar: an empty result
after trimming sends the request to the decode alone); the code treated an empty or ","
header like no header at all, so with a pool (`--prefill`) it disaggregated anyway. Now a
header that is present but names nothing (empty, blanks, commas) gets the decode alone in
both Envoy modes: an endpoint picker's "no disaggregation" is obeyed, and a client that
sends it only opts its own request out. Without the header, pool mode is unchanged.
In single-message mode Envoy's header_to_metadata skips empty values, so the generated
config records the header's presence in a second rule (`prefiller_present`).
"""

from __future__ import annotations

from collections.abc import Iterator

import orjson
import pytest
from pdproc_sim.devstack import Stack, running_stack

from tests.stacks import records, reset, served

from .conftest import CHAT_BYTES, PDPROC_ARGS, SIM_ARGS, metric, send

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module", params=["two-message", "single-message"])
def pool_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    """The simulated prefill is pdproc's pool: requests need no header to be P/D."""
    options = {"single_message": request.param == "single-message"}
    with running_stack(SIM_ARGS, PDPROC_ARGS, envoy_options=options, pool=True) as st:
        yield st


@pytest.mark.parametrize("value", ["", ",", ", ,", ",,"], ids=["empty", "comma", "blank", "commas"])
def test_a_header_naming_no_pod_means_decode_alone(pool_stack: Stack, value: str) -> None:
    reset(pool_stack)
    alone = metric(pool_stack, "pdproc_requests_total", outcome="passthrough")
    response = send(pool_stack, CHAT_BYTES, prefill=value)
    assert response.status_code == 200, response.text
    (decode,) = served(pool_stack, "decode", 1)
    assert "kv_transfer_params" not in decode["body"]
    assert records(pool_stack, "prefill") == []
    assert metric(pool_stack, "pdproc_requests_total", outcome="passthrough") == alone + 1


def test_without_the_header_the_pool_disaggregates(pool_stack: Stack) -> None:
    reset(pool_stack)
    response = send(pool_stack, CHAT_BYTES)
    assert response.status_code == 200, response.text
    (decode,) = served(pool_stack, "decode", 1)
    assert decode["body"]["kv_transfer_params"]["do_remote_prefill"] is True
    assert len(served(pool_stack, "prefill", 1)) == 1
    assert orjson.loads(response.content)["choices"]
