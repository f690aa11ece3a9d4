"""pdproc.budget: one handle per request body, released once by whoever holds its bytes last."""

from __future__ import annotations

import asyncio

from pdproc.budget import ByteBudget


def test_a_body_handed_on_stays_counted_until_its_last_holder_lets_go() -> None:
    levels: list[int] = []
    budget = ByteBudget(100, levels.append)
    held = budget.body()
    assert held.take(90)
    let_go = held.share()  # a decode leg still to be built from the body
    held.release()  # the request's own part is done
    assert budget.held == 90
    assert not budget.body().take(20)  # others see it
    held.release()  # again: nothing
    assert budget.held == 90
    let_go()
    let_go()
    assert budget.held == 0
    assert levels[-1] == 0


async def test_a_body_being_sent_stays_counted_until_it_is_sent() -> None:
    budget = ByteBudget(100)
    held = budget.body()
    assert held.take(60)
    sent: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    held.until(sent)
    held.release()
    assert budget.held == 60
    sent.set_result(None)
    await asyncio.sleep(0)  # done callbacks run on the next turn of the loop
    assert budget.held == 0


def test_a_body_alone_is_admitted_past_the_limit_but_not_beside_others() -> None:
    budget = ByteBudget(100)
    first = budget.body()
    assert first.take(150)  # nothing else held: one body is --max-body-bytes' to bound
    assert not budget.body().take(1)
    assert first.take(10)  # its own bytes do not refuse it
    first.release()
    assert budget.held == 0


def test_bytes_taken_after_the_request_let_go_are_let_go_again() -> None:
    budget = ByteBudget(100)
    held = budget.body()
    assert held.take(10)
    held.release()
    assert held.take(5)  # a message already on its way
    assert budget.held == 5
    held.release()
    assert budget.held == 0
