"""Grammar compiles, schema conversions and image encodes take turns by account
(fastrun_cpp/fair_turns.py): one tenant's queue of compiles delays another's by at most one of
each, a tenant's turns count by the time they take, and a compile whose client left while it
waited never runs; an account's weight scales its share of the time."""

from __future__ import annotations

import asyncio
from typing import Callable

from fastrun_cpp.fair_turns import FairTurns, Share


async def _job(turns: FairTurns, account: str, name: str, ran: list[str], release: asyncio.Event,
               weight: float = 1.0) -> None:
    async with turns.turn(Share(account, weight)):
        ran.append(name)
        await release.wait()


async def _run_in_order(turns: FairTurns, jobs: list[tuple[str, str]], weights: dict[str, float] | None = None):
    ran: list[str] = []
    releases = {name: asyncio.Event() for _, name in jobs}
    tasks = []
    for account, name in jobs:
        weight = (weights or {}).get(account, 1.0)
        tasks.append(asyncio.create_task(_job(turns, account, name, ran, releases[name], weight)))
        await asyncio.sleep(0)  # each queues in the order given
    return ran, tasks, releases


def test_a_tenant_with_many_compiles_waits_its_turn_behind_one_with_few():
    async def scenario() -> list[str]:
        turns = FairTurns(1, clock=lambda: 0.0)  # jobs of equal cost: turns go round the accounts
        jobs = [("a", f"a{i}") for i in range(5)] + [("b", "b0"), ("c", "c0")]
        ran, tasks, releases = await _run_in_order(turns, jobs)
        for _ in jobs:  # let each running job finish, one at a time
            while not ran or releases[ran[-1]].is_set():
                await asyncio.sleep(0)
            releases[ran[-1]].set()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return ran

    order = asyncio.run(scenario())
    assert order[:4] == ["a0", "a1", "b0", "c0"], order  # b and c wait for at most one more of a's
    assert sorted(order) == sorted(["a0", "a1", "a2", "a3", "a4", "b0", "c0"])


def test_a_compile_whose_caller_left_while_waiting_never_runs_and_gives_its_place_on():
    async def scenario() -> tuple[list[str], int]:
        turns = FairTurns(1)
        ran, tasks, releases = await _run_in_order(turns, [("a", "first"), ("b", "gone"), ("c", "next")])
        tasks[1].cancel()  # its client disconnected
        await asyncio.sleep(0)
        releases["first"].set()
        releases["next"].set()
        await asyncio.gather(tasks[0], tasks[2])
        waiting = turns.waiting
        async with turns.turn(Share("d")):  # the place came back
            ran.append("after")
        return ran, waiting

    ran, waiting = asyncio.run(scenario())
    assert ran == ["first", "next", "after"] and waiting == 0


async def _finish_in_turn(ran: list[str], releases: dict[str, asyncio.Event], count: int, cost_s: Callable[[str], float],
                          clock: list[float]) -> None:
    """Let `count` running jobs finish, one at a time, the fake clock moved on by each one's cost."""
    for _ in range(count):
        while not ran or releases[ran[-1]].is_set():
            await asyncio.sleep(0)
        clock[0] += cost_s(ran[-1])
        releases[ran[-1]].set()
        await asyncio.sleep(0)


def test_a_tenants_turns_count_by_the_time_they_take_not_by_their_number():
    """After one of a heavy tenant's long compiles, a light tenant's quick ones all go before its
    next (turns round by count gave the light tenant one compile per heavy one: each of its
    quick compiles waited out a long one)."""
    async def scenario() -> list[str]:
        clock = [0.0]
        turns = FairTurns(1, clock=lambda: clock[0])
        jobs = [("heavy", f"h{i}") for i in range(4)] + [("light", f"l{i}") for i in range(4)]
        ran, tasks, releases = await _run_in_order(turns, jobs)
        await _finish_in_turn(ran, releases, len(jobs), lambda name: 10.0 if name[0] == "h" else 0.01, clock)
        await asyncio.gather(*tasks)
        return ran

    assert asyncio.run(scenario()) == ["h0", "l0", "l1", "l2", "l3", "h1", "h2", "h3"]


def test_an_account_that_comes_later_starts_level_with_those_present():
    """An account that starts waiting after another used much time is not owed that time: at
    equal costs from then on, their turns alternate (it does not take every place until it has
    used as much)."""
    async def scenario() -> list[str]:
        clock = [0.0]
        turns = FairTurns(1, clock=lambda: clock[0])
        ran: list[str] = []
        releases: dict[str, asyncio.Event] = {}
        tasks = []

        async def queue(account: str, names: list[str]) -> None:
            for name in names:
                releases[name] = asyncio.Event()
                tasks.append(asyncio.create_task(_job(turns, account, name, ran, releases[name])))
                await asyncio.sleep(0)

        await queue("old", [f"o{i}" for i in range(6)])
        await _finish_in_turn(ran, releases, 3, lambda name: 5.0, clock)
        await queue("new", [f"n{i}" for i in range(3)])
        await _finish_in_turn(ran, releases, 6, lambda name: 5.0, clock)
        await asyncio.gather(*tasks)
        return ran

    assert asyncio.run(scenario()) == ["o0", "o1", "o2", "o3", "n0", "o4", "n1", "o5", "n2"]


def test_an_accounts_weight_scales_its_share_of_the_time():
    """With `keys weight` 3 against 1 and compiles of equal cost, the heavier account gets three
    turns for each of the other's while both wait (by time used over weight); at weight 1 each,
    the same queue alternates."""
    async def scenario(weights: dict[str, float]) -> list[str]:
        clock = [0.0]
        turns = FairTurns(1, clock=lambda: clock[0])
        jobs = [("big", f"b{i}") for i in range(8)] + [("small", f"s{i}") for i in range(8)]
        ran, tasks, releases = await _run_in_order(turns, jobs, weights)
        await _finish_in_turn(ran, releases, len(jobs), lambda name: 1.0, clock)
        await asyncio.gather(*tasks)
        return ran

    weighted = asyncio.run(scenario({"big": 3.0, "small": 1.0}))
    first_twelve = weighted[:12]
    assert sum(name[0] == "b" for name in first_twelve) >= 8, weighted  # about 3 of every 4
    assert sum(name[0] == "s" for name in first_twelve) >= 3, weighted  # and the lighter one is not starved
    even = asyncio.run(scenario({}))
    assert even[:6] == ["b0", "s0", "b1", "s1", "b2", "s2"], even
