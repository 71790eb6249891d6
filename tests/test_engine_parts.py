"""The engine's policy parts without a model: the scheduler and its request queue, and the KV
cache manager over a fake sequence memory that plays llama.cpp's part."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastrun_cpp.engine.kv_cache import MIN_SAVED_TOKENS, KVCacheManager, shared_prefix
from fastrun_cpp.engine.prompt_cache import CachedSequence, PromptCache
from fastrun_cpp.engine.request import FinishReason, GenerationRequest
from fastrun_cpp.engine.request_queue import FairShareQueue, FifoQueue, WaitingRequest
from fastrun_cpp.engine.scheduler import Admission, Picked, Preemption, Scheduler, StepResult
from fastrun_cpp.engine.slot import RunningChoice, Slot
from fastrun_cpp.engine.speculative import NgramDrafting, SpeculationConfig
from fastrun_cpp.engine.stats import EngineStats
from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher
from fastrun_cpp.engine.tokens import PrefixIndex, common_prefix_length


def waiting(request_id: str, n: int = 1, prompt: list[int] | None = None, *, account: str = "",
            priority: int = 0, weight: float = 1.0) -> WaitingRequest:
    request = GenerationRequest(request_id, prompt or [1, 2, 3], n=n, account=account, priority=priority,
                                weight=weight)
    return WaitingRequest(request, None, list(range(n)))


def occupy(slot: Slot, request_id: str, prompt: list[int] | None = None, *, cursor: int | None = None,
           admitted_at: int = 0, account: str = "", priority: int = 0) -> None:
    """Put a request in a slot the way the engine's start does, without a sampler."""
    request = GenerationRequest(request_id, prompt or [1, 2, 3], account=account, priority=priority)
    prompt_cursor = len(request.prompt_tokens) if cursor is None else cursor
    slot.start(RunningChoice(request, index=0, admitted_at=admitted_at, prompt_cursor=prompt_cursor,
                             cached_tokens=0, max_tokens=16, sampler=None, detokenizer=IncrementalDetokenizer([]),
                             stop_matcher=StopMatcher(())), leader=False)
    slot.choice.pending_token = 7 if prompt_cursor == len(request.prompt_tokens) else None


def scheduler(slots: int = 2, *, capacity: int = 64, speculation: SpeculationConfig | None = None) -> Scheduler:
    return Scheduler([Slot(i) for i in range(slots)], FifoQueue(), batch_capacity=capacity,
                     speculation=speculation or SpeculationConfig(kind="none"))


def admit_all(sched: Scheduler) -> list[tuple[str, list[int], bool]]:
    """Run the admissions, taking a slot per choice as the engine would."""
    started = []
    for admission in sched.admissions():
        for index, slot in zip(admission.choices, sched.free_slots()):
            occupy(slot, admission.item.request.request_id)
            slot.choice.index = index
        started.append((admission.item.request.request_id, admission.choices, admission.first_wave))
    return started


# ----------------------------------------------------------------------------- scheduler


def test_requests_start_first_come_first_served():
    sched = scheduler(2)
    for name in "abc":
        sched.queue.push(waiting(name))
    assert admit_all(sched) == [("a", [0], True), ("b", [0], True)]
    assert [item.request.request_id for item in sched.queue] == ["c"]


def test_a_wide_request_takes_the_free_slots_and_never_holds_up_the_queue():
    sched = scheduler(3)
    occupy(sched._slots[0], "busy")
    sched.queue.push(waiting("wide", n=3))
    sched.queue.push(waiting("small"))
    # Two slots are free: the wide request's first wave takes them, its last choice waits
    # behind the small request that came after it.
    assert admit_all(sched) == [("wide", [0, 1], True)]
    assert [item.request.request_id for item in sched.queue] == ["small", "wide"]
    sched._slots[0].release(1)
    assert admit_all(sched) == [("small", [0], True)]


def test_a_request_of_more_choices_than_slots_never_blocks_admission():
    sched = scheduler(2)
    occupy(sched._slots[0], "busy")
    sched.queue.push(waiting("huge", n=128))
    for name in "abc":
        sched.queue.push(waiting(name))
    started = admit_all(sched)
    assert started == [("huge", [0], True)]
    # Each slot that frees goes to the next in line: the small requests are not starved.
    order = []
    for turn in range(4):
        sched._slots[turn % 2].release(turn + 2)
        order += [request_id for request_id, _, _ in admit_all(sched)]
    assert order[:4] == ["a", "b", "c", "huge"]


def test_choices_beyond_the_slot_count_take_turns_with_the_requests_behind():
    sched = scheduler(2)
    sched.queue.push(waiting("many", n=5))
    sched.queue.push(waiting("next"))
    assert admit_all(sched) == [("many", [0, 1], True)]
    assert [item.request.request_id for item in sched.queue] == ["next", "many"]
    sched._slots[0].release(1)
    assert admit_all(sched) == [("next", [0], True)]
    sched._slots[1].release(2)
    assert admit_all(sched) == [("many", [2], False)]  # a later wave: its prompt is counted once
    assert [item.request.request_id for item in sched.queue] == ["many"] and list(sched.queue)[0].pending == [3, 4]


def test_queued_choices_are_dropped_whole_or_one_by_one():
    sched = scheduler(1)
    occupy(sched._slots[0], "busy")
    sched.queue.push(waiting("a", n=3))
    sched.queue.push(waiting("b", n=1))
    dropped = sched.drop_queued({"b"}, {("a", 1)})
    assert sorted((item.request.request_id, index) for item, index in dropped) == [("a", 1), ("b", 0)]
    items = list(sched.queue)
    assert [item.request.request_id for item in items] == ["a"] and items[0].pending == [0, 2]
    assert [index for _, index in sched.drop_queued(set(), {("a", 0), ("a", 2)})] == [0, 2]
    assert len(sched.queue) == 0


def test_prompt_chunks_go_to_the_oldest_admission_within_the_rows_left():
    sched = scheduler(3, capacity=10)
    slots = sched._slots
    occupy(slots[0], "young", list(range(8)), cursor=0, admitted_at=5)
    occupy(slots[1], "old", list(range(6)), cursor=2, admitted_at=1)
    occupy(slots[2], "decoding")
    plan = sched.plan()
    assert plan.decoding == [slots[2]]
    assert plan.prefilling == [slots[1], slots[0]]
    chunks = sched.prompt_chunks(plan.prefilling, 10 - len(plan.decoding))
    assert [(slot.request.request_id, n) for slot, n in chunks] == [("old", 4), ("young", 5)]


def test_drafts_get_only_rows_no_prompt_waits_for():
    spec = SpeculationConfig(kind="ngram", batch_rows=16, draft_min=2)
    sched = scheduler(3, capacity=20, speculation=spec)
    slots = sched._slots
    occupy(slots[0], "a")
    occupy(slots[1], "b")
    assert sched.plan().draft_rows == 16 - 2  # the speculation's own bound
    occupy(slots[2], "long prompt", list(range(29)), cursor=0)
    assert sched.plan().draft_rows == 0  # the prompt needs every row left
    slots[2].choice.prompt_cursor = 20
    assert sched.plan().draft_rows == 20 - 2 - 9
    assert scheduler(2, speculation=SpeculationConfig(kind="none")).plan().draft_rows == 0


def test_slots_take_turns_to_draft():
    sched = scheduler(3, speculation=SpeculationConfig(kind="ngram"))
    for slot in sched._slots:
        occupy(slot, f"r{slot.seq_id}")
        slot.choice.speculative = True
    first = sched.draft_turns(sched._slots)
    sched.drafted(first[:1])
    assert sched.draft_turns(sched._slots)[-1] is first[0]


# ------------------------------------------------------------- fair shares, priorities


def ids(queue) -> list[str]:
    order = []
    while queue.peek() is not None:
        order.append(queue.pop().request.request_id)
    return order


def test_one_account_at_one_priority_is_served_first_come_first_served():
    queue = FairShareQueue(slots=4)
    for name in "abcde":
        queue.push(waiting(name))
    assert ids(queue) == list("abcde")


def test_accounts_take_turns_by_the_tokens_they_were_served_over_their_weight():
    queue = FairShareQueue(slots=4)
    for i in range(3):
        queue.push(waiting(f"heavy{i}", account="heavy"))
    queue.charge(GenerationRequest("x", [1], account="heavy"), 1000)
    queue.push(waiting("light0", account="light"))
    queue.push(waiting("light1", account="light"))
    assert queue.pop().request.request_id == "light0"  # it starts just behind the heavy account
    queue.charge(GenerationRequest("y", [1], account="light"), 400)
    assert queue.pop().request.request_id == "heavy0"  # 1000 served against 999 + 400
    queue.charge(GenerationRequest("x", [1], account="heavy"), 100)
    assert queue.pop().request.request_id == "heavy1"  # 1100 against 1399
    queue.charge(GenerationRequest("x", [1], account="heavy"), 1000)
    assert queue.pop().request.request_id == "light1"
    # A weight of 4 makes each token count a quarter.
    weighted = FairShareQueue(slots=4)
    weighted.push(waiting("a", account="a"))
    weighted.push(waiting("b", account="b", weight=4.0))
    weighted.charge(GenerationRequest("a", [1], account="a"), 100)
    weighted.charge(GenerationRequest("b", [1], account="b", weight=4.0), 300)
    assert weighted.peek().request.request_id == "b"


def test_an_account_back_from_idling_has_banked_no_credit():
    queue = FairShareQueue(slots=2)
    queue.push(waiting("busy0", account="busy"))
    queue.charge(GenerationRequest("x", [1], account="busy"), 5000)
    queue.push(waiting("idle0", account="idle"))  # it starts just behind the least served waiting
    assert queue.peek().request.request_id == "idle0"
    queue.charge(GenerationRequest("x", [1], account="idle"), 2)  # not 5000 tokens of credit
    assert queue.peek().request.request_id == "busy0"


def test_the_most_urgent_priority_goes_first_whatever_the_shares():
    queue = FairShareQueue(slots=2)
    queue.push(waiting("normal", account="a"))
    queue.push(waiting("later", account="b", priority=5))
    queue.push(waiting("urgent", account="a", priority=-1))
    queue.charge(GenerationRequest("x", [1], account="a"), 10_000)
    assert ids(queue) == ["urgent", "normal", "later"]


def test_preemption_goes_to_the_least_urgent_then_to_the_account_most_over_its_share():
    sched = Scheduler([Slot(i) for i in range(4)], FairShareQueue(slots=4), batch_capacity=64,
                      speculation=SpeculationConfig(kind="none"))
    slots = sched._slots
    for slot in slots:
        occupy(slot, f"flood{slot.seq_id}", account="flood", admitted_at=slot.seq_id)
    sched.queue.push(waiting("small", account="small"))
    steps = list(sched.admissions())
    # One preemption, of the newest; then no slot is free (the caller did not free it), so
    # the same slot is not asked for again and admission stops.
    assert [type(step) for step in steps] == [Preemption] and steps[0].slot is slots[3]
    slots[3].detach(clock=1)
    steps = list(sched.admissions())
    assert [type(step) for step in steps] == [Admission] and steps[0].item.request.account == "small"
    assert steps[0].preempting is False  # the slot was freed by the caller, not in this round
    occupy(slots[3], "small", [5] * 30, cursor=0, account="small")
    slots[3].choice.owed = True  # as the engine marks a request that preempted for its slot
    plan = sched.plan()  # its prompt gets a step of its own: its first token waits for no one
    assert plan.decoding == [] and plan.prefilling == [slots[3]] and plan.draft_rows == 0
    slots[3].choice.owed = False
    assert len(sched.plan().decoding) == 3
    occupy(slots[3], "small", account="small")
    # The flood's next request is over its share (4 slots, 2 accounts: 2 each): no preemption.
    sched.queue.push(waiting("flood-more", account="flood"))
    assert list(sched.admissions()) == []
    # An urgent request preempts whatever runs at the least urgent priority, newest first.
    slots[1].request.priority = 3
    sched.queue.push(waiting("urgent", account="flood", priority=-1))
    steps = list(sched.admissions())
    assert steps and isinstance(steps[0], Preemption) and steps[0].slot is slots[1]


def test_an_admission_right_after_a_preemption_is_marked_as_preempting():
    sched = Scheduler([Slot(i) for i in range(2)], FairShareQueue(slots=2), batch_capacity=64,
                      speculation=SpeculationConfig(kind="none"))
    for slot in sched._slots:
        occupy(slot, f"flood{slot.seq_id}", account="flood", admitted_at=slot.seq_id)
    sched.queue.push(waiting("small", account="small"))
    steps = sched.admissions()
    preemption = next(steps)
    assert isinstance(preemption, Preemption)
    preemption.slot.detach(clock=1)
    admission = next(steps)
    assert isinstance(admission, Admission) and admission.preempting


def test_a_fifo_queue_never_preempts():
    sched = scheduler(1)
    occupy(sched._slots[0], "running", priority=9)
    sched.queue.push(waiting("urgent", priority=-9))
    assert list(sched.admissions()) == []


# ------------------------------------------------------------------- KV cache manager


class FakeMemory:
    """Sequences as token lists, as llama.cpp would hold their KV; `decode` plays llama_decode
    writing a slot's new tokens."""

    def __init__(self, n_swa_dropped: int = 0) -> None:
        self.sequences: dict[int, list[int]] = {}
        self.dropped_positions = n_swa_dropped  # a sliding window's oldest positions are gone

    def decode(self, slot: Slot) -> None:
        self.sequences[slot.seq_id] = list(slot.cache_tokens)

    def remove(self, seq_id: int, start: int) -> bool:
        del self.sequences.setdefault(seq_id, [])[max(0, start):]
        return True

    def copy(self, source: int, target: int) -> None:
        self.sequences[target] = list(self.sequences.get(source, []))

    def first_position(self, seq_id: int) -> int:
        return self.dropped_positions

    def state(self, seq_id: int) -> np.ndarray | None:
        return np.array(self.sequences.get(seq_id, []), dtype=np.int64).view(np.uint8)

    def set_state(self, seq_id: int, state: np.ndarray, nbytes: int) -> bool:
        self.sequences[seq_id] = state.view(np.int64).tolist()
        return True

    def clear(self) -> None:
        self.sequences.clear()


def manager(slots: int = 2, *, n_swa: int = 0, host_mib: int = 16, memory: FakeMemory | None = None):
    memory = memory or FakeMemory()
    all_slots = [Slot(i) for i in range(slots)]
    kv = KVCacheManager(memory, all_slots, n_swa=n_swa, prompt_cache=PromptCache(host_mib << 20), disk_cache=None,
                        counters=EngineStats())
    return kv, memory, all_slots


def fill(kv: KVCacheManager, memory: FakeMemory, slot: Slot, tokens: list[int], namespace: str = "") -> None:
    """The slot evaluates `tokens` from scratch, as a request's prompt and answer."""
    kv.clear(slot)
    slot.namespace = namespace
    kv.extend(slot, tokens)
    memory.decode(slot)


def prepare(kv: KVCacheManager, slot: Slot, prompt: list[int], namespace: str) -> tuple[str, int]:
    """The manager's prepare, given what the slot holds of the prompt as `choose` reports it."""
    return kv.prepare(slot, prompt, namespace, shared_prefix(slot, prompt, namespace))


def holds_exactly_its_tokens(memory: FakeMemory, slots: list[Slot]) -> bool:
    return all(memory.sequences.get(slot.seq_id, []) == slot.cache_tokens for slot in slots)


def test_a_prompt_goes_to_the_slot_with_the_longest_prefix_it_may_reuse():
    kv, memory, slots = manager(3)
    document = list(range(100))
    fill(kv, memory, slots[0], document[:80])
    fill(kv, memory, slots[1], document[:40] + [7])
    slots[2].last_used = -1
    assert kv.choose(slots, document, "") == (slots[0], 80)  # the slot, and the prefix it holds
    # Another namespace may reuse nothing, so it gets the least recently used slot.
    assert kv.choose(slots, document, "tenant")[0] is slots[2]


def test_a_few_shared_template_tokens_do_not_take_a_slot_holding_another_conversation():
    kv, memory, slots = manager(2)
    template = [9, 9, 9, 9, 9]
    fill(kv, memory, slots[0], template + list(range(100, 400)))  # a long, unrelated conversation
    slots[0].last_used, slots[1].last_used = 2, 1
    assert kv.choose(slots, template + [7, 7, 7], "")[0] is slots[1]  # the other slot: nothing to save or lose
    assert kv.choose(slots, template + list(range(100, 200)) + [7], "")[0] is slots[0]  # a real prefix wins


def test_a_prompt_no_slot_holds_goes_next_to_running_slots():
    # Running slots with consecutive ids share llama.cpp's micro-batch (ubatch.py): a new
    # request joins their run rather than the least recently used slot away from it.
    kv, memory, slots = manager(5)
    for seq, last_used in enumerate([3, 0, 4, 5, 1]):
        slots[seq].last_used = last_used
    occupy(slots[1], "running")
    free = [slot for slot in slots if slot.is_free]
    assert kv.choose(free, list(range(50)), "")[0] is slots[0]  # next to 1, and older than 2
    occupy(slots[3], "running")
    free = [slot for slot in slots if slot.is_free]
    assert kv.choose(free, list(range(50)), "")[0] is slots[2]  # fills the hole between 1 and 3
    for slot in slots:
        slot.choice = None
    assert kv.choose(slots, list(range(50)), "")[0] is slots[1]  # nothing running: least recently used


def test_a_prefix_the_host_tier_holds_too_does_not_pull_a_request_away_from_running_slots():
    # Any slot can restore it from RAM; only what a slot alone holds is worth a run of its own.
    kv, memory, slots = manager(5)
    document = list(range(100))
    fill(kv, memory, slots[0], document[:80])
    kv.save(slots[0])  # the host tier holds the same 80 tokens
    occupy(slots[3], "running")
    free = [slot for slot in slots if slot.is_free]
    assert kv.choose(free, document, "")[0] in (slots[2], slots[4])
    fill(kv, memory, slots[0], document[:80] + [7] * 60)  # now a longer prefix only slot 0 holds
    prompt = document[:80] + [7] * 60 + [1]
    assert kv.choose(slots[:1], prompt, "") == (slots[0], 140)  # the only free slot: used where it is


def test_a_prefix_only_a_slot_away_from_running_slots_holds_moves_beside_them():
    # Taken where it lies, it would split every step into two passes for as long as both run
    # (seen: 8 answers on slots 0 and 6..12, 0.87x); through the host tier it joins their run.
    kv, memory, slots = manager(5)
    conversation = list(range(140))
    fill(kv, memory, slots[0], conversation)
    occupy(slots[3], "running")
    free = [slot for slot in slots if slot.is_free]
    slot, held = kv.choose(free, conversation + [1], "")
    assert slot in (slots[2], slots[4]) and held == 0
    assert prepare(kv, slot, conversation + [1], "") == ("host", 140)  # nothing recomputed
    assert memory.sequences[slot.seq_id] == conversation


def test_a_prefix_the_host_tier_cannot_take_stays_where_it_is():
    kv, memory, slots = manager(5, host_mib=0)
    conversation = list(range(140))
    fill(kv, memory, slots[0], conversation)
    occupy(slots[3], "running")
    free = [slot for slot in slots if slot.is_free]
    assert kv.choose(free, conversation + [1], "") == (slots[0], 140)


def test_prepare_keeps_the_shared_prefix_but_never_the_last_prompt_token():
    kv, memory, slots = manager(1)
    fill(kv, memory, slots[0], [1, 2, 3, 4, 5, 6])
    assert prepare(kv, slots[0], [1, 2, 3, 9], "") == ("slot", 3)
    assert slots[0].cache_tokens == [1, 2, 3] and holds_exactly_its_tokens(memory, slots)
    assert prepare(kv, slots[0], [1, 2, 3], "") == ("slot", 2)  # the whole prompt cached: its last is evaluated
    assert prepare(kv, slots[0], [5, 5], "") == ("miss", 0)
    assert slots[0].cache_tokens == [] and holds_exactly_its_tokens(memory, slots)


def test_another_namespace_reuses_nothing_from_any_tier():
    kv, memory, slots = manager(1)
    secret = list(range(100, 100 + 2 * MIN_SAVED_TOKENS))
    fill(kv, memory, slots[0], secret, namespace="account:a")
    assert kv.cached_prefix(secret, "account:b") == 0
    assert prepare(kv, slots[0], secret + [1], "account:b") == ("miss", 0)  # the slot's KV is saved, not reused
    assert kv.cached_prefix(secret, "account:b") == 0
    assert kv.cached_prefix(secret, "account:a") == len(secret)  # from the host tier
    fill(kv, memory, slots[0], [7] * 40, namespace="account:b")
    assert prepare(kv, slots[0], secret + [1], "account:a") == ("host", len(secret))
    assert slots[0].namespace == "account:a" and holds_exactly_its_tokens(memory, slots)


def test_a_longer_prefix_in_the_host_tier_is_restored_over_the_slots_own():
    kv, memory, slots = manager(1)
    long = list(range(3 * MIN_SAVED_TOKENS))
    fill(kv, memory, slots[0], long)
    kv.save(slots[0])
    fill(kv, memory, slots[0], long[:5] + [999] * 40)
    source, reused = prepare(kv, slots[0], long + [1, 2], "")
    assert (source, reused) == ("host", len(long))
    assert slots[0].cache_tokens == long and holds_exactly_its_tokens(memory, slots)


def test_short_sequences_are_not_worth_saving():
    kv, memory, slots = manager(1)
    fill(kv, memory, slots[0], list(range(MIN_SAVED_TOKENS - 1)))
    kv.save(slots[0])
    assert len(kv.prompt_cache) == 0
    fill(kv, memory, slots[0], list(range(MIN_SAVED_TOKENS)))
    kv.save(slots[0])
    assert len(kv.prompt_cache) == 1


def test_a_sliding_window_that_dropped_the_prefix_start_is_not_reused():
    memory = FakeMemory(n_swa_dropped=50)
    kv, memory, slots = manager(1, n_swa=16, memory=memory)
    fill(kv, memory, slots[0], list(range(60)))
    assert prepare(kv, slots[0], list(range(60)) + [1], "") == ("miss", 0)
    memory.dropped_positions = 0
    fill(kv, memory, slots[0], list(range(60)))
    assert prepare(kv, slots[0], list(range(60)) + [1], "") == ("slot", 60)


@pytest.mark.parametrize("operation", ["truncate", "copy", "clear", "take_for_copy", "clear_all"])
def test_every_change_keeps_a_sequence_holding_exactly_its_tokens(operation):
    kv, memory, slots = manager(2)
    fill(kv, memory, slots[0], list(range(40)))
    fill(kv, memory, slots[1], list(range(50, 90)))
    if operation == "truncate":
        kv.truncate(slots[0], 17)
        assert slots[0].cache_tokens == list(range(17))
    elif operation == "copy":
        kv.copy(slots[0], slots[1])
        assert slots[1].cache_tokens == list(range(40))
    elif operation == "clear":
        kv.clear(slots[1])
    elif operation == "take_for_copy":
        kv.take_for_copy(slots[1], "x")
        assert slots[1].cache_tokens == [] and len(kv.prompt_cache) == 1  # what it held is saved
    else:
        kv.clear_all()
        assert all(slot.cache_tokens == [] for slot in slots)
    assert holds_exactly_its_tokens(memory, slots)


def test_a_garbage_collection_is_not_charged_to_the_grammar():
    """A grammar's step is measured in this thread's CPU time less garbage collection: a gen-2
    pass over a long-running server's objects (tens of ms) once failed a legitimate request
    for going over the per-token grammar limit."""
    import gc
    import time

    from fastrun_cpp.engine.sampling import grammar_clock

    garbage = [[i] for i in range(1_000_000)]
    cpu, clock = time.thread_time(), grammar_clock()
    gc.collect()
    spent_cpu, spent_clock = time.thread_time() - cpu, grammar_clock() - clock
    del garbage
    assert spent_cpu > 0.005  # the collection did take CPU time in this thread
    assert spent_clock < spent_cpu / 10


# ------------------------------------------------------------------ prefix index


def test_the_prefix_index_answers_as_comparing_every_sequence_would():
    """Random sequences in two namespaces, sharing prefixes of every length, added, replaced
    (in either namespace) and removed: the index's longest prefix, and the sequences that are
    prefixes of a prompt, are what comparing the prompt with every held sequence of its
    namespace gives; it references no removed sequence, and removing all leaves no tree."""
    rng = random.Random(7)
    for _ in range(100):
        index, held = PrefixIndex(), {}  # key -> (namespace, tokens)
        base = [rng.randrange(4) for _ in range(40)]
        for _ in range(150):
            if rng.random() < 0.6:
                key = rng.randrange(50)
                held[key] = rng.choice("ab"), base[:rng.randrange(41)] + [rng.randrange(4)
                                                                         for _ in range(rng.randrange(12))]
                index.add(key, held[key][1], held[key][0])
            elif held:
                key = rng.choice(list(held))
                index.remove(key)
                del held[key]
            namespace = rng.choice("ab")
            mine = {k: tokens for k, (ns, tokens) in held.items() if ns == namespace}
            prompt = base[:rng.randrange(41)] + [rng.randrange(4) for _ in range(rng.randrange(8))]
            best = max((common_prefix_length(tokens, prompt) for tokens in mine.values()), default=0)
            key, length = index.longest_prefix(prompt, namespace)
            assert length == best
            assert (key is None) if best == 0 else common_prefix_length(mine[key], prompt) == best
            assert sorted(index.prefixes_of(prompt, namespace)) == sorted(
                k for k, tokens in mine.items() if prompt[:len(tokens)] == tokens)
            # Edges read only from sequences still held (a removed one is not kept alive).
            nodes = [child for root in index._roots.values() for child in root.children.values()]
            while nodes:
                node = nodes.pop()
                assert any(node.source is tokens for _, tokens in held.values())
                nodes.extend(node.children.values())
        for key in list(held):
            index.remove(key)
        assert len(index) == 0 and index.longest_prefix(base) == (None, 0)
        assert not index._roots


def test_the_host_tier_finds_the_longest_prefix_among_thousands_by_namespace():
    cache = PromptCache(capacity_bytes=2**30)
    state = np.zeros(8, dtype=np.uint8)
    system = list(range(1000, 1040))
    for i in range(3000):
        cache.insert(CachedSequence([*system, i, *range(i, i + 20)], state, namespace=f"ns{i % 2}"))
    prompt = [*system, 1234, *range(1234, 1244), 7]
    entry, length = cache.longest_prefix(prompt, "ns0")
    assert length == len(prompt) - 1 and entry.tokens[:length] == prompt[:length]
    assert cache.longest_prefix(prompt, "ns1")[1] == len(system)  # 1234 is ns0's
    assert cache.covers(prompt[:-1], "ns0") and not cache.covers(prompt, "ns0")
    # An entry that extends others replaces them; only its own namespace's.
    cache.insert(CachedSequence([*system, 1234, *range(1234, 1254), 5], state, namespace="ns0"))
    assert len(cache) == 3000


class RefusingMemory(FakeMemory):
    """llama.cpp refusing to restore states of some lengths (saved with another context shape,
    or by another build)."""

    def __init__(self, refused_lengths: set[int]) -> None:
        super().__init__()
        self.refused_lengths = refused_lengths

    def set_state(self, seq_id: int, state: np.ndarray, nbytes: int) -> bool:
        if len(state.view(np.int64)) in self.refused_lengths:
            self.sequences[seq_id] = [-1]  # half written, as a failed restore may leave it
            return False
        return super().set_state(seq_id, state, nbytes)


def test_a_failed_restore_falls_back_to_the_prefix_the_slot_held():
    system = list(range(1000, 1000 + MIN_SAVED_TOKENS * 4))
    longer = system + list(range(5000, 5000 + MIN_SAVED_TOKENS))
    memory = RefusingMemory({len(longer)})
    kv, memory, slots = manager(1, memory=memory)
    kv.prompt_cache.insert(CachedSequence(list(longer), np.array(longer, dtype=np.int64).view(np.uint8)))
    fill(kv, memory, slots[0], system + [7, 7])  # the slot holds the system prompt, the host a longer prefix
    prompt = longer + [9, 9]
    source, reused = prepare(kv, slots[0], prompt, "")
    # The longer prefix could not be restored: it is dropped, and the slot's own copy (saved
    # before the attempt) serves the system prompt.
    assert (source, reused) == ("host", len(system))
    assert slots[0].cache_tokens == system and holds_exactly_its_tokens(memory, slots)
    assert kv.prompt_cache.longest_prefix(prompt, "")[1] == len(system)  # the bad entry is gone


def test_the_request_types_and_the_scheduler_load_without_libllama():
    # What the scheduler and its tests need is plain policy over plain data: importing it (and
    # the package's names, which load on first use) must not load llama.cpp.
    import subprocess
    import sys

    script = ("import sys\n"
              "import fastrun_cpp.engine.scheduler, fastrun_cpp.engine.kv_cache, fastrun_cpp.engine.output\n"
              "from fastrun_cpp.engine import GenerationRequest, SamplingParams, CapacityError\n"
              "loaded = sorted(name for name in sys.modules if name.startswith('llama_cpp'))\n"
              "assert not loaded, loaded\n"
              "from fastrun_cpp.engine import Engine\n"
              "assert 'llama_cpp' in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ------------------------------------------------- a request's life, schedule to update


class Choices:
    """A ChoiceFactory without llama.cpp: no sampler (the fake step picks), one byte per token."""

    def sampler(self, request, grammar, index):
        return None

    def detokenizer(self, request):
        return IncrementalDetokenizer([bytes([ord("a") + token % 26]) for token in range(64)])


def live_scheduler(slots: int, capacity: int):
    speculation = SpeculationConfig(kind="ngram")
    kv, memory, all_slots = manager(slots)
    sched = Scheduler(all_slots, FifoQueue(), batch_capacity=capacity, speculation=speculation, ctx_size=64,
                      kv_cache=kv, choices=Choices(), drafter=NgramDrafting(speculation), eog_token_ids=frozenset({0}))
    return sched, kv, memory


def run_step(sched, memory, pick, drafts=None):
    """One step as the runner would run it: every row decoded (the fake memory takes what the
    scheduler's sequences then hold), `pick(seq, position)` the sampled token of a row."""
    plan = sched.schedule()
    drafts = drafts or {}
    picked = {}
    for decode in plan.decodes:
        draft = drafts.get(decode.seq_id, [])
        tokens = []
        for offset in range(len(draft) + 1):
            tokens.append(pick(decode.seq_id, decode.position + offset))
            if offset == len(draft) or tokens[-1] != draft[offset]:
                break
        picked[decode.seq_id] = Picked(tokens, None, drafted=len(draft))
    for chunk in plan.chunks:
        if chunk.ends_prompt:
            end = chunk.position + len(chunk.tokens)
            picked[chunk.seq_id] = Picked([pick(chunk.seq_id, end)], None)
            for seq, _ in plan.forks.get(chunk.seq_id, ()):
                picked[seq] = Picked([pick(seq, end)], None)
    result = StepResult(0, {seq: list(draft) for seq, draft in drafts.items()}, list(drafts), {}, picked, {},
                        started=0.0, passes=())
    outputs = sched.update_from_output(plan, result)
    for slot in sched._slots:
        memory.decode(slot)
    return plan, outputs


def test_a_request_lives_through_schedule_and_update_without_a_model():
    sched, kv, memory = live_scheduler(3, capacity=8)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    request = GenerationRequest("r", prompt, n=2, max_tokens=4)
    sched.accept(request)
    sched.queue.push(WaitingRequest(request, None, [0, 1]))
    assert sched.admit() == []
    leader, follower = [slot for slot in sched._slots if not slot.is_free]

    # The prompt is longer than a batch: two chunks, and only at its end does anyone pick.
    plan, outputs = run_step(sched, memory, pick=lambda seq, position: 1 + seq)
    assert [(chunk.seq_id, chunk.tokens, chunk.position, chunk.ends_prompt) for chunk in plan.chunks] == [
        (leader.seq_id, prompt[:8], 0, False)]
    assert outputs == [] and leader.choice.prompt_cursor == 8 and follower.cache_tokens == []
    # The plan is by value: it is not the slots' state, and later steps do not change it.
    assert plan.chunks[0].tokens is not prompt

    plan, outputs = run_step(sched, memory, pick=lambda seq, position: 1 + seq)
    assert plan.chunks[0].tokens == prompt[8:] and plan.chunks[0].ends_prompt
    assert plan.forks == {leader.seq_id: ((follower.seq_id, follower.choice),)}
    # The follower copied the prompt's KV and drew its own first token from the same logits.
    assert [(o.index, o.token_ids) for o in outputs] == [(0, [1 + leader.seq_id]), (1, [1 + follower.seq_id])]
    assert follower.cache_tokens == prompt and leader.cache_tokens == prompt
    assert holds_exactly_its_tokens(memory, sched._slots)

    # Decodes: each slot's pending token, at the sequence's end; a drafted row that is not the
    # pick is dropped from the KV again.
    plan, outputs = run_step(sched, memory, pick=lambda seq, position: 2, drafts={leader.seq_id: [2, 3, 4]})
    assert [(decode.seq_id, decode.position) for decode in plan.decodes] == [(leader.seq_id, 12), (follower.seq_id, 12)]
    assert [o.token_ids for o in outputs] == [[2, 2], [2]]  # the leader: one draft accepted, then its own pick
    assert leader.cache_tokens == [*prompt, 1 + leader.seq_id, 2]  # pending + the accepted draft, not the rest
    assert holds_exactly_its_tokens(memory, sched._slots)

    # max_tokens ends both answers; the slots are free and keep what they computed.
    while any(not slot.is_free for slot in sched._slots):
        _, outputs = run_step(sched, memory, pick=lambda seq, position: 3)
    assert all(o.finished for o in outputs) and {o.finish_reason for o in outputs} == {FinishReason.LENGTH}
    assert leader.cache_tokens[:len(prompt)] == prompt and sched.stats.generated_tokens == 8


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on():
    sched, kv, memory = live_scheduler(2, capacity=8)
    for name in "ab":
        request = GenerationRequest(name, [5, 6, 7], max_tokens=4)
        sched.accept(request)
        sched.queue.push(WaitingRequest(request, None, [0]))
    sched.admit()
    plan = sched.schedule()
    outputs = sched.update_from_output(plan, StepResult(1, {}, [], {}, {}, {}, 0.0, ()))
    assert sorted(o.request_id for o in outputs) == ["a", "b"] and all(o.error for o in outputs)
    assert all(slot.is_free and slot.cache_tokens == [] for slot in sched._slots)
    sched.finished(["a", "b"])
    assert sched.load() == (0, 0)


def mrope_request(prompt_length: int = 20) -> GenerationRequest:
    """Two M-RoPE images in a prompt: 8 tokens taking 3 positions from token 2, 6 taking 2 from
    token 12 (what Qwen2-VL's grids of 4 x 2 and 3 x 2 merged patches take)."""
    from fastrun_cpp.engine.request import MediaSpan, RopeGrid

    spans = (MediaSpan(2, 8, b"", False, RopeGrid(b"x", b"x", advance=3)),
             MediaSpan(12, 6, b"", False, RopeGrid(b"x", b"x", advance=2)))
    return GenerationRequest("r", list(range(prompt_length)), media=spans)


def test_tokens_after_an_mrope_image_sit_below_their_index_by_what_it_saved():
    request = mrope_request()
    assert [request.position_of(i) for i in (0, 2, 10, 11, 12, 18, 19, 25)] == [0, 2, 5, 6, 7, 9, 10, 16]
    plain = GenerationRequest("p", list(range(20)))
    assert [plain.position_of(i) for i in (0, 7, 30)] == [0, 7, 30]


def test_a_causal_image_goes_a_chunk_at_a_time_and_one_attending_both_ways_whole():
    from fastrun_cpp.engine.request import MediaSpan

    request = mrope_request()  # causal images at 2..10 and 12..18
    # Text stops where an image starts; a chunk in an image stays in it, within the rows left.
    assert [request.chunk_length(cursor, rows) for cursor, rows in ((0, 100), (2, 5), (7, 100), (10, 100))] \
        == [2, 5, 3, 2]
    assert request.media_at(7) is request.media[0] and request.media_at(10) is None
    both_ways = GenerationRequest("g", list(range(20)), media=(MediaSpan(2, 8, b"", True),))
    assert both_ways.chunk_length(2, 3) == 8


def test_a_reused_prefix_after_an_mrope_image_is_cut_at_its_position():
    """The slot's KV is cut by llama.cpp position, which after an image is below the token's
    index; the cut never falls inside an image."""
    removed: list[int] = []

    class RecordingMemory(FakeMemory):
        def remove(self, seq_id: int, start: int) -> bool:
            removed.append(start)
            return super().remove(seq_id, start)

    request = mrope_request()
    kv, memory, slots = manager(1, memory=RecordingMemory())
    fill(kv, memory, slots[0], request.prompt_tokens[:11] + [99, 98])
    removed.clear()
    source, reused = kv.prepare(slots[0], request.prompt_tokens, "", 11, cut=request.reusable_prefix,
                                position=request.position_of)
    assert (source, reused, removed) == ("slot", 11, [request.position_of(11)]) and removed == [6]
    fill(kv, memory, slots[0], request.prompt_tokens[:14] + [99])
    removed.clear()
    assert kv.prepare(slots[0], request.prompt_tokens, "", 14, cut=request.reusable_prefix,
                      position=request.position_of) == ("slot", 12)  # cut back to where the image starts
    assert removed == [7]
