"""The prefix policy in service (pdproc.pool_choice): what the pool, the breakers and the
pods' engine ids do to the choice."""

from __future__ import annotations

from typing import Any

from pdproc.pool_choice import PrefixPool
from pdproc.targets import HostPort

PODS = [HostPort(f"10.0.0.{i}", 8000) for i in range(1, 4)]
SYSTEM = "Be brief. " * 100


def body(question: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages}


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


def test_a_conversation_returns_to_its_pod_and_is_counted() -> None:
    w = World()
    first = w.pool.refine(body("q1"), PODS[0])
    assert w.pool.refine(body("q1"), PODS[0]) == first
    assert w.reasons == ["home", "prefix"]


def test_an_open_breaker_is_never_chosen_and_forgets_the_pod() -> None:
    w = World()
    home = w.pool.refine(body("q1"), PODS[0])
    w.open.add(home)
    w.pool.breaker_opened(home)
    assert home not in w.pool.affinity.known()
    assert w.pool.refine(body("q1"), PODS[0]) != home


def test_a_member_that_refuses_its_half_open_probe_keeps_the_header_pick() -> None:
    w = World()
    home = w.pool.refine(body("q1"), PODS[0])
    other = next(p for p in PODS if p != home)
    w.refused.add(home)
    assert w.pool.refine(body("q1"), other) == other
    assert w.reasons[-1] == "kept"


def test_new_engine_ids_drop_what_the_pod_held() -> None:
    w = World()
    home = w.pool.refine(body("q1"), PODS[0])
    w.pool.engines_seen(home, {0: "a_dp0"})
    w.pool.engines_seen(home, {0: "a_dp0"})
    assert home in w.pool.affinity.known()
    w.pool.engines_seen(home, {0: "b_dp0"})  # restarted
    assert home not in w.pool.affinity.known()


def test_members_leaving_the_pool_lose_their_sets() -> None:
    w = World()
    for index in range(12):
        w.pool.refine(body(f"q{index}") | {"model": f"m{index}"}, PODS[0])
    assert len(w.pool.affinity.known()) >= 2
    w.members = [PODS[0]]
    assert w.pool.refine(body("q1"), PODS[0]) == PODS[0]
    assert set(w.pool.affinity.known()) == {PODS[0]}


def test_no_usable_member_keeps_the_header_pick() -> None:
    w = World()
    w.open.update(PODS)
    assert w.pool.refine(body("q1"), PODS[2]) == PODS[2]
    assert w.reasons == ["kept"]
