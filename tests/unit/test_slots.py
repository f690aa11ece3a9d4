from __future__ import annotations

import asyncio

from pdproc.slots import Slots


async def test_a_named_host_gets_its_share_and_no_more() -> None:
    slots = Slots(total=4, per_named_host=2)
    assert await slots.take("tarpit", 0.0)
    assert await slots.take("tarpit", 0.0)
    assert not await slots.take("tarpit", 0.0)  # past its share: at once
    assert await slots.take(None, 0.0)  # a pool member still gets one
    assert await slots.take("other", 0.0)
    slots.give_back("tarpit")
    assert await slots.take("tarpit", 0.0)


async def test_a_wait_for_a_slot_ends_when_one_is_given_back() -> None:
    slots = Slots(total=1, per_named_host=1)
    assert await slots.take(None, 0.0)
    waiting = asyncio.ensure_future(slots.take(None, 30.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    slots.give_back(None)
    assert await waiting


async def test_a_wait_that_outlasts_its_bound_gives_up_and_frees_its_hosts_share() -> None:
    slots = Slots(total=1, per_named_host=1)
    assert await slots.take(None, 0.0)
    assert not await slots.take("named", 0.01)
    slots.give_back(None)
    assert await slots.take("named", 0.0)  # the failed wait left no share behind
