from __future__ import annotations

import pytest

from pdproc.outcomes import PrefillResult
from pdproc.pod_verdict import Verdict, of_bootstrap, of_prefill


@pytest.mark.parametrize("result", list(PrefillResult))
def test_every_prefill_outcome_has_a_verdict(result: PrefillResult) -> None:
    assert isinstance(of_prefill(result), Verdict)


def test_only_an_answer_says_the_pod_is_up() -> None:
    up = {result for result in PrefillResult if of_prefill(result).pod_is_up}
    assert up == {PrefillResult.OK, PrefillResult.CLIENT_ERROR}


def test_what_pdproc_or_the_client_caused_is_not_the_pods() -> None:
    mine = {r for r in PrefillResult if of_prefill(r) is Verdict.NOT_THE_POD}
    assert mine == {PrefillResult.CANCELLED, PrefillResult.EXHAUSTED, PrefillResult.INTERNAL}


def test_a_refused_connection_keeps_the_engine_map_a_failure_drops_it() -> None:
    assert not of_prefill(PrefillResult.CONNECT_ERROR).map_may_be_stale
    assert of_prefill(PrefillResult.SERVER_ERROR).map_may_be_stale
    assert of_prefill(PrefillResult.CLIENT_ERROR).map_may_be_stale
    assert not of_prefill(PrefillResult.OK).map_may_be_stale


def test_a_bootstrap_failure() -> None:
    assert of_bootstrap(reached=False, local=True) is Verdict.NOT_THE_POD
    assert of_bootstrap(reached=False, local=False) is Verdict.DOWN
    assert of_bootstrap(reached=True, local=False) is Verdict.FAILED
