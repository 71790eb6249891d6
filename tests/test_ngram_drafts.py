"""What speculation proposes and what it verifies: a copy in progress drafts its continuation,
a template that recurs with different values drafts up to the value and not past it, short or
missing matches draft nothing; and a draft is verified only where it pays for its rows, from
measured step costs (each rejected row costs a CPU about half a decode step, a GPU little)."""

from __future__ import annotations

from fastrun_cpp.engine.speculative import (
    Acceptance,
    AnswerMemory,
    DraftTurn,
    NgramDrafter,
    NgramDrafting,
    SpeculationConfig,
    StepCosts,
    expected_accepted,
    worth_verifying,
)

CONFIG = SpeculationConfig(draft_max=8, draft_min=2, ngram_min=3, match_min=5)


def drafter(prompt: list[int], generated: list[int]) -> NgramDrafter:
    drafts = NgramDrafter(CONFIG, prompt)
    drafts.accept(generated)
    return drafts


def test_a_copy_in_progress_drafts_what_follows():
    passage = list(range(100, 140))
    drafts = drafter([1, 2, *passage, 3], passage[:10])
    first = drafts.propose(8)
    assert len(first) >= 2 and first == passage[10 : 10 + len(first)]
    # All accepted: the next draft (after the bonus token) is longer, up to the limit.
    drafts.verified(len(first), len(first))
    drafts.accept(passage[10 : 11 + len(first)])
    assert drafts.propose(8) == passage[11 + len(first) : 19 + len(first)]


def test_a_draft_is_no_longer_than_its_limit_or_twice_its_match():
    passage = list(range(100, 140))
    assert drafter([1, *passage, 3], passage[:10]).propose(3) == passage[10:13]
    assert len(drafter([1, *passage, 3], passage[:10]).propose(2)) == 2
    # A 5-token match (the context starts with it) may draft 10 tokens at most.
    drafts = NgramDrafter(SpeculationConfig(draft_max=32, match_min=5), [*passage, 3, *passage[:5]])
    assert drafts.propose(32) == passage[5:15]


def test_a_template_with_different_values_drafts_up_to_the_value():
    template = [10, 11, 12, 13, 14, 15]  # "The keeper ... trims wick number"
    prompt = [token for value in range(20) for token in (*template, 200 + value, 16, 17)]
    drafts = drafter(prompt, [*template[:3]])
    assert drafts.propose(8) == template[3:]  # the rest of the template, not a value after it


def record(i: int) -> list[int]:
    """An id, a template longer than a match is compared, and a value other records share."""
    return [50, 300 + i, *range(10, 45), 200 + i % 3, 16]


RECORDS = [token for i in range(20) for token in record(i)]


def test_a_copy_of_one_record_drafts_through_its_values():
    # At a value every record's match is as long, so their votes disagree there; the answer,
    # though, is restating record 5, found by its id.
    drafts = drafter(RECORDS, [*record(4), 50, 305, 10, 11])
    first = drafts.propose(8)
    assert first and first == list(range(12, 12 + len(first)))
    drafts.verified(len(first), len(first))
    drafts.accept(list(range(12, 45)))
    assert drafts.propose(8) == [202, 16, 50, 306, 10, 11, 12, 13]  # record 5's value, then record 6


def test_a_token_that_differs_from_the_copy_ends_it():
    drafts = drafter(RECORDS, [*record(4), 50, 305, 10, 11])
    assert drafts.propose(8)
    drafts.accept([12, 13, 999])  # the answer leaves record 5
    assert drafts.propose(8) == []  # looked up again: 999 is nowhere before


def test_short_or_missing_matches_draft_nothing():
    prompt = [5, 6, 7, 8, 1, 2, 3, 40, 41, 42, 43]
    assert drafter(prompt, [9, 1, 2, 3]).propose(8) == []  # a 3-token match only
    assert drafter(prompt, [70, 71, 72]).propose(8) == []  # no match at all


def test_drafts_pause_after_repeated_misses():
    passage = list(range(100, 140))
    drafts = drafter([1, 2, *passage, 3], passage[:10])
    draft = drafts.propose(8)
    assert draft
    drafts.verified(len(draft), 0)
    drafts.verified(len(draft), 0)
    assert drafts.propose(8) == []  # paused


def costs(seconds_by_rows: dict[int, float]) -> StepCosts:
    measured = StepCosts()
    for rows, seconds in seconds_by_rows.items():
        measured.record(rows, seconds)
    return measured


CPU = {1: 0.010, 2: 0.019, 4: 0.030, 8: 0.047, 9: 0.052, 16: 0.083, 24: 0.118}  # a 2-core EPYC
GPU = {1: 0.010, 9: 0.0105, 16: 0.011}


def test_an_answer_of_the_same_namespace_drafts_its_shape_and_another_namespace_gets_nothing():
    """A tool call's shape (long, in no prompt) answered before drafts the next one's; the
    memory is the account's own: another namespace's request drafts nothing from it."""
    drafting = NgramDrafting(CONFIG)
    call = [60, *range(400, 430), 61]  # '{"name": "get_weather", "arguments": {"city": ...'
    drafting.start(0, [1, 2, 3], namespace="acct-a")
    drafting.accept(0, call)
    drafting.finished(0)

    def first_draft(namespace: str) -> list[int]:
        drafting.start(1, [7, 8, 9], namespace=namespace)
        drafting.accept(1, call[:8])  # the same call begins (its last token sampled, not yet decoded)
        return drafting.propose([DraftTurn(1, [7, 8, 9, *call[:7]], call[7], room=64)], rows=8).get(1, [])

    assert first_draft("acct-a") == call[8 : 8 + len(first_draft("acct-a"))] != []
    assert first_draft("acct-b") == []
    assert first_draft("") == []


def test_the_answer_memory_is_bounded_per_namespace_and_in_namespaces():
    memory = AnswerMemory(tokens=10, namespaces=2)
    memory.remember("a", list(range(6)))
    memory.remember("a", list(range(10, 16)))
    assert memory.recall("a") == list(range(10, 16))  # the older answer left to make room
    memory.remember("a", list(range(100, 130)))
    assert memory.recall("a") == list(range(120, 130))  # a long answer: its end
    memory.remember("b", [1])
    memory.remember("c", [2])
    assert memory.recall("a") == [] and memory.recall("b") == [1] and memory.recall("c") == [2]


def test_step_costs_interpolate_and_stay_optimistic_past_what_was_measured():
    assert StepCosts().estimate(4) is None
    measured = costs({2: 0.020, 6: 0.040})
    assert measured.estimate(4) == 0.030
    assert measured.estimate(1) == 0.020 and measured.estimate(12) == 0.040  # tried, then measured
    measured.record(6, 0.050)
    assert 0.040 < measured.estimate(6) < 0.050  # a moving average: one slow step does not rule


def test_a_size_measured_once_too_slow_is_tried_again_and_drafts_come_back():
    # One 11-row step took 445 ms (a pause): alone, it would keep 10-token drafts out for good.
    measured = costs({1: 0.022, 11: 0.445})
    draft = [(0, 10, 0.95)]
    assert worth_verifying(draft, [0], measured, 512) == {}
    for _ in range(StepCosts.RETRY_STEPS):
        measured.passed()
        measured.record(1, 0.022)  # plain steps go on being measured
        assert worth_verifying(draft, [0], measured, 512) == {}
    measured.passed()
    assert worth_verifying(draft, [0], measured, 512) == {0: 10}  # tried again
    measured.record(11, 0.060)  # and measured afresh
    assert measured.estimate(11) == 0.060
    assert worth_verifying(draft, [0], measured, 512) == {0: 10}


def test_a_pass_that_only_runs_beside_others_is_priced_from_the_steps_it_runs_in():
    # 8 slots decoding, 3 adjacent ones drafting 12 tokens: a pass of 8 rows, then one of 36.
    # 36 rows never run alone, so until a step of both is priced, 36 is guessed at 8's cost.
    measured = costs({8: 0.050})
    drafts = [(slot, 12, 0.9) for slot in range(3)]
    assert worth_verifying(drafts, list(range(8)), measured, 512) == dict.fromkeys(range(3), 12)
    measured.record_step((8, 36), 0.050 + 0.200)
    assert abs(measured.estimate(36) - 0.200) < 1e-9
    assert worth_verifying(drafts, list(range(8)), measured, 512) == {}  # 8 + 19 expected tokens in 250 ms: not worth it


def test_a_measurement_that_keeps_agreeing_holds_longer():
    measured = costs({1: 0.022})
    for _ in range(4):  # agreeing measurements, a step apart
        measured.passed()
        measured.record(1, 0.023)
    for _ in range(2 * StepCosts.RETRY_STEPS):
        measured.passed()
    assert measured.estimate(1) is not None
    # A step far faster than the estimate is taken at once: slow ones were pauses.
    measured.record(1, 0.010)
    assert measured.estimate(1) == 0.010


def test_a_long_draft_is_expected_to_yield_less_than_its_length_times_its_rate():
    # 9 in 10 tokens taken: 8 drafted yield 5.1, 64 drafted 9.0, not 57.6.
    assert abs(expected_accepted(0.9, 8) - 5.13) < 0.01 and abs(expected_accepted(0.9, 64) - 8.99) < 0.01
    assert expected_accepted(1.0, 64) == 64
    rate = Acceptance(0.5, weight=1.0)
    rate.verified(13, 6)  # 6 taken, the 7th refused
    assert rate.rate == 6 / 7


def test_one_stream_on_a_cpu_verifies_only_drafts_likely_to_be_accepted():
    assert worth_verifying([(0, 8, 0.9)], [0], costs(CPU), 512) == {0: 8}
    assert worth_verifying([(0, 8, 0.3)], [0], costs(CPU), 512) == {}


def test_on_a_gpu_rows_are_cheap_and_even_doubtful_drafts_are_verified():
    assert worth_verifying([(0, 8, 0.3)], [0], costs(GPU), 512) == {0: 8}


def test_a_lone_draft_beside_plain_decodes_pays_a_pass_of_its_own():
    # 8 slots decoding: llama.cpp runs one slot's draft as a second pass over the weights.
    drafts = [(slot, 8, rate) for slot, rate in enumerate([0.95, 0.6, 0.5])]
    assert worth_verifying(drafts, list(range(8)), costs(CPU), 512) == {}


def test_drafts_of_every_slot_share_the_decodes_pass():
    drafts = [(slot, 4, 0.9) for slot in range(8)]
    assert worth_verifying(drafts, list(range(8)), costs(CPU), 512) == dict.fromkeys(range(8), 4)


def test_adjacent_drafts_are_cut_to_one_length_to_share_a_pass():
    # 8 and 4 tokens: one pass of 2 x 5 rows beats two passes (2 rows, then 8).
    assert worth_verifying([(0, 8, 0.9), (1, 4, 0.9)], [0, 1], costs(CPU), 512) == {0: 4, 1: 4}


def test_a_held_back_draft_is_checked_against_the_tokens_that_come_instead():
    rate = Acceptance(0.9)
    rate.verified(8, 0)
    low = rate.rate
    assert low < 0.5
    rate.held_back([5, 6, 7, 8])
    rate.held_back([1, 2])  # one held draft at a time: the first is still being checked
    assert rate.observe([5]) is None and rate.observe([6, 7]) is None  # as drafted so far
    assert rate.observe([8, 9]) == (4, 4) and rate.rate > low + 0.2  # it would have been accepted whole
    rate.held_back([1, 2, 3])
    assert rate.observe([1, 4]) == (3, 1)  # one of three
    assert rate.observe([1]) is None  # nothing held
