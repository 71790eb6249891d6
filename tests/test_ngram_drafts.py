"""What the n-gram drafter proposes: a copy in progress drafts its continuation, a template
that recurs with different values drafts up to the value and not past it, and short or
missing matches draft nothing (each rejected row costs a CPU about half a decode step)."""

from __future__ import annotations

from fastrun_cpp.engine.speculative import NgramDrafter, SpeculationConfig

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
