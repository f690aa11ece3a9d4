"""The prefix policy in service (pdproc.pool_choice): what the pool, the breakers and the
pods' engine ids do to the choice."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdproc.connectors import ClientRequest
from pdproc.pool_choice import PrefixPool, cached_share
from pdproc.prefix_affinity import MIN_BLOCKS_PER_POD
from pdproc.request_body import parse_body
from pdproc.targets import HostPort

PODS = [HostPort(f"10.0.0.{i}", 8000) for i in range(1, 4)]
SYSTEM = "Be brief. " * 100


def body(question: str, model: str = "m", request_id: str = "") -> ClientRequest:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    raw = msgspec.json.encode({"model": model, "messages": messages})
    return ClientRequest("/v1/chat/completions", raw, parse_body(raw), request_id)


class World:
    def __init__(self) -> None:
        self.members = list(PODS)
        self.open: set[HostPort] = set()
        self.refused: set[HostPort] = set()
        self.loads: dict[HostPort, int] = dict.fromkeys(PODS, 0)
        self.reasons: list[str] = []
        self.pool = PrefixPool(
            lambda: tuple(self.members),
            is_open=self.open.__contains__,
            allow=lambda pod: pod not in self.refused,
            in_flight=lambda pod: self.loads.get(pod, 0),
            blocks_per_pod=1000,
            balance=1.25,
            on_choice=self.reasons.append,
        )


def refine(w: World, request: ClientRequest, provisional: HostPort) -> HostPort:
    return w.pool.refine(request, provisional).target


def test_the_prediction_is_told_for_the_log_line() -> None:
    w = World()
    first = w.pool.refine(body("q1"), PODS[0])
    # Nothing cached anywhere yet: the home was chosen, nothing of the prompt predicted.
    assert first.facts["prefix_matched_bytes"] == 0
    prompt_size = first.facts["prefix_prompt_bytes"]
    again = w.pool.refine(body("q1"), PODS[0])
    assert again.target == first.target
    assert again.facts["prefix_prompt_bytes"] == prompt_size
    # The whole prompt was recorded on that pod: predicted whole, never past its size.
    assert again.facts["prefix_matched_bytes"] == prompt_size
    # Every breaker open: the header-time pick is kept, and nothing is predicted.
    w.open.update(PODS)
    kept = w.pool.refine(body("q1"), PODS[2])
    assert (kept.target, kept.facts, w.reasons[-1]) == (PODS[2], {}, "kept")


def test_a_conversation_returns_to_its_pod_and_is_counted() -> None:
    w = World()
    first = refine(w, body("q1"), PODS[0])
    assert refine(w, body("q1"), PODS[0]) == first
    assert w.reasons == ["home", "prefix"]


def test_an_open_breaker_is_never_chosen_and_forgets_the_pod() -> None:
    w = World()
    home = refine(w, body("q1"), PODS[0])
    w.open.add(home)
    w.pool.breaker_opened(home)
    assert home not in w.pool.affinity.known()
    assert refine(w, body("q1"), PODS[0]) != home


def test_a_member_that_refuses_its_half_open_probe_keeps_the_header_pick() -> None:
    w = World()
    home = refine(w, body("q1"), PODS[0])
    other = next(p for p in PODS if p != home)
    w.refused.add(home)
    assert refine(w, body("q1"), other) == other
    assert w.reasons[-1] == "kept"


def test_new_engine_ids_drop_what_the_pod_held() -> None:
    w = World()
    home = refine(w, body("q1"), PODS[0])
    w.pool.engines_seen(home, {0: "a_dp0"})
    w.pool.engines_seen(home, {0: "a_dp0"})
    assert home in w.pool.affinity.known()
    w.pool.engines_seen(home, {0: "b_dp0"})  # restarted
    assert home not in w.pool.affinity.known()


def test_members_leaving_the_pool_lose_their_sets() -> None:
    w = World()
    for index in range(12):
        refine(w, body(f"q{index}", model=f"m{index}"), PODS[0])
    assert len(w.pool.affinity.known()) >= 2
    w.members = [PODS[0]]
    assert refine(w, body("q1"), PODS[0]) == PODS[0]
    assert set(w.pool.affinity.known()) == {PODS[0]}


def test_no_usable_member_keeps_the_header_pick() -> None:
    w = World()
    w.open.update(PODS)
    assert refine(w, body("q1"), PODS[2]) == PODS[2]
    assert w.reasons == ["kept"]


def answer(cached: Any, prompt: Any = 1000) -> bytes:
    usage = {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}}
    return msgspec.json.encode({"id": "x", "usage": usage})


def test_cached_share_reads_vllms_usage() -> None:
    assert cached_share(answer(250)) == 0.25
    assert cached_share(b'{"usage": {"prompt_tokens": 4, "prompt_tokens_details": null}}') is None


@given(st.one_of(st.binary(max_size=200), st.builds(answer, st.integers(), st.integers())))
def test_cached_share_of_any_answer_is_a_share_or_none(raw: bytes) -> None:
    share = cached_share(raw)
    assert share is None or 0 <= share <= 1


def test_a_pod_reporting_fewer_cached_tokens_than_predicted_shrinks_its_set() -> None:
    def remembered(cached: int) -> int:
        w = World()
        home = refine(w, body("q0", request_id="r0"), PODS[0])
        for index in range(1, 40):
            question = f"q{index} " * 200  # blocks of its own beyond the system prompt's
            chosen = refine(w, body(question, request_id=f"r{index}"), PODS[0])
            assert chosen == home
            w.pool.answered(f"r{index}", home, answer(cached))
        return w.pool.affinity.known()[home]

    assert remembered(cached=1000) > MIN_BLOCKS_PER_POD  # as predicted: all kept
    assert remembered(cached=0) == MIN_BLOCKS_PER_POD  # it held nothing: the set shrinks


def test_answers_without_a_prediction_or_from_another_pod_teach_nothing() -> None:
    w = World()
    home = refine(w, body("q0", request_id="r0"), PODS[0])
    refine(w, body("q1", request_id="r1"), PODS[0])
    before = dict(w.pool.affinity.known())
    other = next(p for p in PODS if p != home)
    w.pool.answered("r1", other, answer(0))
    w.pool.answered("unknown", home, answer(0))
    w.pool.answered("r0", home, None)
    assert w.pool.affinity.known() == before


def test_a_member_whose_prefill_failed_is_left_out_for_a_while() -> None:
    now = [0.0]
    w = World()
    w.pool = PrefixPool(
        lambda: tuple(w.members),
        is_open=w.open.__contains__,
        allow=lambda pod: True,
        in_flight=lambda pod: 0,
        blocks_per_pod=1000,
        balance=1.25,
        clock=lambda: now[0],
    )
    home = refine(w, body("q1"), PODS[0])
    w.pool.prefill_failed(home)
    moved = refine(w, body("q1"), home)
    assert moved != home  # not even as the header-time pick
    now[0] = 10.0
    assert refine(w, body("q1"), PODS[0]) == moved  # it stays where its cache now is
