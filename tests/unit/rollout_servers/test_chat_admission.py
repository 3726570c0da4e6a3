"""Chat sessions' places within the staleness bound: counted as groups of n sessions, granted to waiting
sessions before prompt groups, given back when sessions close, never held by a session that gave up."""

from __future__ import annotations

import asyncio

import pytest

from rollout_servers.chat.admission import ChatAdmission

SHORT_WAIT_S = 0.05
LONG_WAIT_S = 5.0


async def settle() -> None:
    """Let every task waiting for a place run up to its wait."""
    for _ in range(3):
        await asyncio.sleep(0)  # loop turns, no time: each waiting task runs up to its wait


def test_sessions_count_as_groups_of_n_and_take_only_the_grants_they_need():
    async def scenario():
        places = ChatAdmission(sessions_per_group=4)
        sessions = [asyncio.create_task(places.enter(LONG_WAIT_S)) for _ in range(5)]
        await settle()
        asked = places.wanted()
        left_for_prompts = places.take_grants(3)
        await asyncio.gather(*sessions)
        return asked, left_for_prompts, places.held, places.open, places.wanted()

    # 5 sessions in groups of 4 need 2 grants; of 3 granted, 1 is left to start a prompt group
    assert asyncio.run(scenario()) == (2, 1, 2, 5, 0)


def test_closing_sessions_gives_their_grants_back():
    async def scenario():
        places = ChatAdmission(sessions_per_group=2)
        sessions = [asyncio.create_task(places.enter(LONG_WAIT_S)) for _ in range(3)]
        await settle()
        places.take_grants(places.wanted())
        await asyncio.gather(*sessions)
        held = [places.held]
        for _ in range(3):
            places.leave()
            held.append(places.held)
        return held

    assert asyncio.run(scenario()) == [2, 1, 1, 0]  # ceil(open / 2) after each close


def test_a_closed_session_makes_room_for_a_waiting_one_without_a_new_grant():
    async def scenario():
        places = ChatAdmission(sessions_per_group=2)
        first = [asyncio.create_task(places.enter(LONG_WAIT_S)) for _ in range(2)]
        await settle()
        places.take_grants(1)
        await asyncio.gather(*first)
        third = asyncio.create_task(places.enter(LONG_WAIT_S))
        await settle()
        waiting_before = (places.waiting, places.wanted())
        places.leave()
        await third
        return waiting_before, places.waiting, places.held, places.open, places.wanted()

    assert asyncio.run(scenario()) == ((1, 1), 0, 1, 2, 0)


def test_a_session_that_times_out_holds_nothing_and_wants_nothing():
    async def scenario():
        places = ChatAdmission(sessions_per_group=2)
        with pytest.raises(TimeoutError):
            await places.enter(SHORT_WAIT_S)
        return places.waiting, places.wanted(), places.open, places.held, places.take_grants(2)

    assert asyncio.run(scenario()) == (0, 0, 0, 0, 2)  # a later grant goes to prompts whole


def test_a_cancelled_wait_gives_its_place_up():
    async def scenario():
        places = ChatAdmission(sessions_per_group=1)
        waiting = asyncio.create_task(places.enter(LONG_WAIT_S))
        await settle()
        wanted_while_waiting = places.wanted()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return wanted_while_waiting, places.waiting, places.wanted(), places.open

    assert asyncio.run(scenario()) == (1, 0, 0, 0)
