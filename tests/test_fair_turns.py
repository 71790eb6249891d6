"""Grammar compiles and schema conversions take turns by account (fastrun_cpp/fair_turns.py):
one tenant's queue of compiles delays another's by at most one of each, and a compile whose
client left while it waited never runs."""

from __future__ import annotations

import asyncio

from fastrun_cpp.fair_turns import FairTurns


async def _job(turns: FairTurns, account: str, name: str, ran: list[str], release: asyncio.Event) -> None:
    async with turns.turn(account):
        ran.append(name)
        await release.wait()


async def _run_in_order(turns: FairTurns, jobs: list[tuple[str, str]]):
    ran: list[str] = []
    releases = {name: asyncio.Event() for _, name in jobs}
    tasks = []
    for account, name in jobs:
        tasks.append(asyncio.create_task(_job(turns, account, name, ran, releases[name])))
        await asyncio.sleep(0)  # each queues in the order given
    return ran, tasks, releases


def test_a_tenant_with_many_compiles_waits_its_turn_behind_one_with_few():
    async def scenario() -> list[str]:
        turns = FairTurns(1)
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
        async with turns.turn("d"):  # the place came back
            ran.append("after")
        return ran, waiting

    ran, waiting = asyncio.run(scenario())
    assert ran == ["first", "next", "after"] and waiting == 0
