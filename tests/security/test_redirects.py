"""A pod inside the allow list redirects pdproc to an address outside it.

Earlier, aiohttp followed redirects: a bootstrap server answering `302 Location:
http://<another pod>/query` handed the decode another pod's engine id, and a prefill pod
answering `307` had the (client's) prefill body re-posted to any address it named, past
the allow list (SSRF). Now redirects are never followed: the other address is never
contacted and the request fails cleanly.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.envoy_side import Outcome

from .conftest import CHAT_BYTES, Pd
from .pods import HostilePod, redirect


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_bootstrap_redirect_is_not_followed(
    pod: HostilePod, other_pod: HostilePod, make_pdproc: Any, status: int
) -> None:
    pod.on_query = redirect(f"http://127.0.0.1:{other_pod.bootstrap_port}/query", status)
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "bootstrap_error"
    assert outcome.error is not None
    assert f"status {status}" in outcome.error["message"]
    assert outcome.decode_body is None  # the decode was never sent anything
    assert other_pod.total_hits == 0
    # No prefill either (a failed early query may be asked once more for the body).
    assert set(pod.hits) == {"query"}


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
async def test_prefill_redirect_is_not_followed(
    pod: HostilePod, other_pod: HostilePod, make_pdproc: Any, status: int
) -> None:
    location = f"http://127.0.0.1:{other_pod.port}/v1/chat/completions"
    pod.on_prefill = redirect(location, status)
    pd: Pd = await make_pdproc(pod)
    outcome = await pd.play(CHAT_BYTES, prefill=pod.address)
    assert outcome.status == 502
    assert outcome.error_kind == "prefill_failed"
    assert outcome.error is not None
    assert f"status {status}" in outcome.error["message"]
    assert "redirects are not followed" in outcome.error["message"]
    assert other_pod.total_hits == 0
    assert pod.hits["prefill"] == 1
    assert_decode_pointed_only_at(outcome, pod)


def assert_decode_pointed_only_at(outcome: Outcome, pod: HostilePod) -> None:
    """The decode (reset by Envoy) was only ever pointed at the pod the allow list
    admitted."""
    assert outcome.decode_body is not None
    assert b"OTHER-POD-ENGINE" not in outcome.decode_body
    assert outcome.kv_params is not None
    assert outcome.kv_params["remote_engine_id"] == "e0"
    assert outcome.kv_params["remote_bootstrap_addr"] == f"http://127.0.0.1:{pod.bootstrap_port}"


async def test_prefill_redirect_to_a_forbidden_address_carries_no_prompt(
    pod: HostilePod, other_pod: HostilePod, make_pdproc: Any
) -> None:
    """A 307 re-posts the body: followed, the prompt would reach an address the allow list
    forbids (pdproc allows 127.0.0.1/32 here; the redirect names [::1])."""
    pod.on_prefill = redirect(f"http://[::1]:{other_pod.port}/steal", 307)
    pd: Pd = await make_pdproc(pod)
    secret = b'{"model":"m","messages":[{"role":"user","content":"SECRET-PROMPT"}]}'
    outcome = await pd.play(secret, prefill=pod.address)
    assert outcome.status == 502
    assert other_pod.total_hits == 0
    assert [seen.path for seen in pod.prefills()] == ["/v1/chat/completions"]
