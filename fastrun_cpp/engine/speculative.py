"""Speculative decoding: cheap guesses of a slot's next tokens, verified together with every
other slot's decode token in the same batch.

A guess is only a proposal: the target model's sampler picks each token as it would without
speculation, and a drafted token counts only where it equals that pick. With point-mass drafts
(n-gram lookup, or a draft model's greedy choice) this is the rejection-sampling rule reduced
to "keep while equal", so the output - its distribution, and with a seed the very tokens - is
the one speculation off would give, at any temperature, with grammars, penalties and
logit_bias. Lengths adapt to how much recent drafts were accepted, so a stream that stops
accepting stops paying for drafts; and a draft is verified only where the step's expected
yield per second rises with it, from what steps of each size were measured to cost here
(a CPU pays about half a decode step per extra row, a GPU almost nothing).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from fastrun_cpp.engine.ubatch import micro_batches

SpecType = Literal["none", "ngram", "draft"]


class DraftTurn(NamedTuple):
    """A slot that may draft this step."""

    seq_id: int
    tokens: list[int]  # the sequence so far (decoded)
    pending: int  # its sampled token, not yet decoded
    room: int  # most tokens it may draft (the answer's and the context's room)


class Drafter(Protocol):
    """Where drafts come from: n-gram lookup in each slot's own context, or a draft model that
    drafts for all slots at once."""

    def start(self, seq_id: int, prompt: list[int], namespace: str = "") -> None:
        """A new request in the slot, of the cache namespace `namespace` (its account's)."""

    def accept(self, seq_id: int, tokens: list[int]) -> None:
        """Tokens now part of the slot's answer."""

    def finished(self, seq_id: int) -> None:
        """The slot's answer came to its end."""

    def propose(self, turns: list[DraftTurn], rows: int) -> dict[int, list[int]]:
        """Drafts by slot, in `turns` order while the `rows` last; none shorter than
        draft_min."""

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class SpeculationConfig:
    kind: SpecType = "ngram"
    # Longest draft for one slot in one step. On a CPU each extra batch row costs about half a
    # decode step and 8 pays best; a GPU verifies a few rows almost for free (raise it there).
    draft_max: int = 8
    draft_min: int = 2  # shorter drafts are not worth a verification
    ngram_min: int = 3  # the context suffix looked up
    match_min: int = 5  # shortest match a draft is taken from
    match_max: int = 32  # how far back a match is compared (longer: more sure)
    match_slack: int = 4  # candidates matched this much less than the best still vote
    agreement: float = 0.75  # share of the voting candidates that must agree on a drafted token
    # N-gram drafts also follow the latest answers of the request's cache namespace, up to this
    # many tokens of them: an account's answers often repeat a shape (a tool call with other
    # values, a reply template) that its prompt does not hold.
    answer_memory: int = 2048
    # Drafts fill the batch up to this many rows after the decode tokens of every slot (at
    # least one slot's longest draft): under load the batch is full of decode tokens and
    # speculation yields to batching.
    batch_rows: int = 16

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def step_rows(self) -> int:
        """Rows a step's decode tokens and drafts may take together."""
        return max(self.batch_rows, self.draft_max + 1)


class Acceptance:
    """How likely a drafted token is to be accepted once the ones before it were, recently: a
    slot's, starting from the engine's (which starts optimistic, so a fresh engine tries its
    first drafts). A draft of 13 with 6 accepted tried 7 tokens and lost 1: a token was taken
    6 times in 7, not 6 in 13, and a longer draft of the same text yields less than its length
    times that (`expected_accepted`). A draft the cost gate holds back is checked against the
    tokens that come instead, as if it had been verified: the rate keeps learning while
    nothing is verified, so a stream whose text turns copyable again has its drafts verified
    again as soon as they would have been accepted."""

    def __init__(self, rate: float = 1.0, weight: float = 0.5) -> None:
        self.rate = rate
        self._weight = weight  # of the latest verification
        self._held: list[int] = []  # a draft held back, being checked against what comes
        self._matched = 0  # how much of it came

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted:
            tried = accepted + (accepted < drafted)  # the accepted ones and the first refused
            self.rate += self._weight * (accepted / tried - self.rate)

    def held_back(self, draft: list[int]) -> None:
        if not self._held:
            self._held, self._matched = list(draft), 0

    def observe(self, tokens: list[int]) -> tuple[int, int] | None:
        """The tokens the slot's answer went on with: (drafted, accepted) of the held draft
        once they settle it."""
        if not self._held:
            return None
        for token in tokens:
            if token != self._held[self._matched]:
                break
            self._matched += 1
            if self._matched == len(self._held):
                break
        else:
            return None  # as drafted so far
        outcome = len(self._held), self._matched
        self._held, self._matched = [], 0
        self.verified(*outcome)
        return outcome


class StepCosts:
    """Seconds one pass over the weights takes by its number of rows, learned from this
    engine's own steps that llama.cpp ran as one micro-batch (ubatch.py). A size not measured
    yet is interpolated between its measured neighbours, and past the largest taken as the
    largest: optimistic, so that each size gets tried, and then measured.

    A size the gate stops verifying is never measured again, so one slow step (a pause of the
    process, a burst of other work) would shut drafts of that size and every larger one out
    for good. So a measurement holds for a while only - RETRY_STEPS steps after a single one,
    twice as long after each that agrees with it - and then the size counts as unmeasured
    again, is tried once more and measured afresh."""

    WEIGHT = 0.2
    RETRY_STEPS = 32
    RETRY_MAX_STEPS = 4096

    def __init__(self) -> None:
        self._seconds: dict[int, float] = {}
        self._measured_at: dict[int, int] = {}  # the step of a size's last measurement
        self._holds: dict[int, int] = {}  # steps its measurement holds
        self._step = 0

    def passed(self) -> None:
        """A step went by (measured or not)."""
        self._step += 1

    def record(self, rows: int, seconds: float) -> None:
        previous = self._seconds.get(rows)
        # New, stale, or far faster than thought (steps are slowed by pauses, never sped up):
        # taken as it is.
        if previous is None or not self._holding(rows) or seconds < 0.75 * previous:
            self._seconds[rows], self._holds[rows] = seconds, self.RETRY_STEPS
        else:
            self._seconds[rows] = previous + self.WEIGHT * (seconds - previous)
            agrees = seconds <= 1.25 * previous
            self._holds[rows] = min(self.RETRY_MAX_STEPS, 2 * self._holds[rows]) if agrees else self.RETRY_STEPS
        self._measured_at[rows] = self._step

    def record_step(self, passes: tuple[int, ...], seconds: float) -> None:
        """A step of these passes (their rows) took `seconds`. One pass prices its size. Of
        several (a draft's rows beside plain decodes take a pass of their own), the largest is
        priced at what the others, at their estimates, leave of the step: a size that only ever
        runs beside others is measured too, instead of staying at its optimistic guess."""
        if len(passes) == 1:
            self.record(passes[0], seconds)
            return
        largest = max(passes)
        others = list(passes)
        others.remove(largest)
        known = self.estimate_step(others)
        if known is not None and seconds > known:
            self.record(largest, seconds - known)

    def _holding(self, rows: int) -> bool:
        return self._step - self._measured_at[rows] <= self._holds[rows]

    def estimate(self, rows: int) -> float | None:
        known = {size: seconds for size, seconds in self._seconds.items() if self._holding(size)}
        if rows in known:
            return known[rows]
        below = max((size for size in known if size < rows), default=None)
        above = min((size for size in known if size > rows), default=None)
        if below is None or above is None:
            nearest = below if above is None else above
            return None if nearest is None else known[nearest]
        share = (rows - below) / (above - below)
        return known[below] + share * (known[above] - known[below])

    def estimate_step(self, micro_batches: list[int]) -> float | None:
        """A step of these micro-batches (their rows): one pass each."""
        passes = [self.estimate(rows) for rows in micro_batches]
        return None if None in passes else sum(passes)


VERIFY_MARGIN = 0.1


def expected_accepted(rate: float, length: int) -> float:
    """Tokens a draft of `length` is expected to have accepted when each is with probability
    `rate` once the ones before it were: rate + rate^2 + ... + rate^length (the usual estimate
    of speculative decoding)."""
    if rate >= 1.0:
        return float(length)
    return rate * (1 - rate**length) / (1 - rate)


def worth_verifying(drafts: list[tuple[int, int, float]], decoding: list[int], costs: StepCosts,
                    n_ubatch: int) -> dict[int, int]:
    """The drafts to verify in a step whose decoding slots are `decoding` (sequence ids, in
    batch order), and how many tokens of each: `drafts` holds (sequence id, length, the slot's
    acceptance rate). Verified drafts are those that raise the tokens the step is expected to
    yield per second - every decode token counts 1, a draft what it is expected to have
    accepted (`expected_accepted`) - by more than VERIFY_MARGIN, because each row verified slows
    the step, and so every slot's next token. The step is priced as llama.cpp runs it, a pass per micro-batch (ubatch.py): drafts beside plain
    decodes take a pass of their own, which equally long drafts of adjacent slots share. So
    the kept drafts are cut to one length: the best set of the most accepted drafts at the
    best length."""
    def step_cost(chosen: list[tuple[int, int, float]], length: int) -> float | None:
        rows = dict.fromkeys(decoding, 1)
        for seq, _, _ in chosen:
            rows[seq] += length
        return costs.estimate_step(micro_batches(list(rows.items()), n_ubatch))

    if not drafts:
        return {}
    plain = step_cost([], 0)
    if plain is None:  # nothing measured yet: verify them, and so measure
        return {seq: length for seq, length, _ in drafts}
    # Drafts must beat the plain step by a margin: the figures they are priced with are
    # estimates (a recent acceptance, steps that vary), and a draft that barely pays on paper
    # costs as often as it gains.
    best_rate, kept = (1 + VERIFY_MARGIN) * len(decoding) / plain, {}
    ranked = sorted(drafts, key=lambda draft: -draft[2])
    for length in sorted({length for _, length, _ in drafts}):
        candidates = [draft for draft in ranked if draft[1] >= length]
        gain = 0.0
        for count in range(1, len(candidates) + 1):
            gain += expected_accepted(candidates[count - 1][2], length)
            rate = (len(decoding) + gain) / step_cost(candidates[:count], length)
            if rate > best_rate:
                best_rate, kept = rate, {seq: length for seq, _, _ in candidates[:count]}
    return kept


class DraftLength:
    """How long a slot's next draft may be, from how much of its recent drafts was accepted:
    all accepted doubles it, a partial acceptance shrinks it to what was accepted, and repeated
    total misses pause drafting for a growing number of steps."""

    def __init__(self, config: SpeculationConfig) -> None:
        self._config = config
        self.length = max(config.draft_min, config.draft_max // 2)
        self._misses = 0
        self._pause = 0

    def allowed(self) -> int:
        if self._pause > 0:
            self._pause -= 1
            return 0
        return self.length

    def verified(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        config = self._config
        if accepted == drafted:
            self.length = min(config.draft_max, self.length * 2)
            self._misses = 0
        elif accepted == 0:
            self._misses += 1
            self.length = config.draft_min
            if self._misses >= 2:
                self._pause = min(64, 2 ** self._misses)
        else:
            self._misses = 0
            self.length = max(config.draft_min, accepted + 1)


class NgramDrafter:
    """Prompt-lookup drafts. The earlier places where the context's last `ngram_min` tokens
    occur are candidates, each scored by how far back its match with the context extends. The
    draft follows the best-matched candidates token by token and stops where they stop agreeing:
    text with one continuation (a copy, an unchanged line of code) drafts long, while a
    template that recurs with different values ("wick number 7", "wick number 13") drafts up to
    the value and not past it. Nothing is drafted from a match shorter than `match_min`, and a
    draft is no longer than twice its match. The context is the request's prompt and everything
    accepted since.

    Once the best match is one place alone, that place is the copy's source: the context is
    taken to be walking through it, and later drafts continue from the token after it, through
    the values where the candidates would disagree ("wick number 7" of record 4, since the
    answer is restating record 4), for as long as the context keeps equal to it. A token that
    differs ends the copy, and drafts are looked up again.

    `remembered` (earlier answers of the same namespace) goes before the prompt: its places are
    candidates like any other, older than the prompt's."""

    def __init__(self, config: SpeculationConfig, prompt: list[int], remembered: Sequence[int] = ()) -> None:
        self._config = config
        self._tokens = [*remembered, *prompt]
        self._answer_start = len(self._tokens)  # the answer's tokens follow
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)  # n-gram -> where its occurrences end
        self._indexed = 0  # n-grams ending at or before this position are indexed
        self._source: int | None = None  # the copy being followed: the context's next token is expected to be this one
        self.length = DraftLength(config)

    def accept(self, tokens: list[int]) -> None:
        """Tokens now part of the context (generated, or the pending token decoded)."""
        for token in tokens:
            if self._source is not None:
                self._source = self._source + 1 if self._tokens[self._source] == token else None
            self._tokens.append(token)

    def propose(self, limit: int) -> list[int]:
        limit = min(limit, self.length.allowed())
        config = self._config
        if limit < config.draft_min:
            return []
        if self._source is not None:
            draft = self._tokens[self._source : self._source + limit]
            if len(draft) >= config.draft_min:
                return draft
        candidates = self._candidates()
        if not candidates:
            return []
        best = max(match for match, _ in candidates)
        if best < config.match_min:
            return []
        tokens, end = self._tokens, len(self._tokens)
        following = [at for match, at in candidates if match >= best - config.match_slack]
        draft: list[int] = []
        for offset in range(min(limit, 2 * best)):
            votes = Counter(tokens[at + offset] for at in following if at + offset < end)
            if not votes:
                break
            token, count = votes.most_common(1)[0]
            if count < config.agreement * len(following):
                break
            draft.append(token)
            following = [at for at in following if at + offset < end and tokens[at + offset] == token]
        if len(following) == 1:  # one place alone continues the context: a copy of it
            self._source = following[0]
        return draft if len(draft) >= config.draft_min else []

    def _candidates(self) -> list[tuple[int, int]]:
        """(match length, position after the occurrence) for the latest 64 occurrences of the
        context's last n-gram."""
        tokens, end, n = self._tokens, len(self._tokens), self._config.ngram_min
        # Index every n-gram that ends before the current end (the suffix itself must not
        # match its own occurrence).
        for position in range(max(self._indexed, n), end):
            self._index[tuple(tokens[position - n : position])].append(position)
        self._indexed = max(self._indexed, end)
        if end < n:
            return []
        match_max = self._config.match_max
        candidates = []
        for at in self._index.get(tuple(tokens[end - n :]), ())[-64:]:
            match = n
            while match < match_max and at - match > 0 and tokens[at - match - 1] == tokens[end - match - 1]:
                match += 1
            candidates.append((match, at))
        return candidates

    def verified(self, drafted: int, accepted: int) -> None:
        self.length.verified(drafted, accepted)

    def answer(self) -> list[int]:
        """The tokens accepted since the prompt."""
        return self._tokens[self._answer_start:]


class AnswerMemory:
    """The latest answers of each cache namespace, up to `tokens` tokens each, for the
    namespaces used last (`namespaces` of them). Kept per namespace, as the prompt cache is: a
    draft from another account's answer would be accepted, and so timed, on its words."""

    def __init__(self, tokens: int, namespaces: int = 256) -> None:
        self._tokens = tokens
        self._namespaces = namespaces
        self._answers: OrderedDict[str, deque[list[int]]] = OrderedDict()

    def remember(self, namespace: str, answer: list[int]) -> None:
        if self._tokens <= 0 or not answer:
            return
        answers = self._answers.setdefault(namespace, deque())
        self._answers.move_to_end(namespace)
        answers.append(answer[-self._tokens:])
        held = sum(map(len, answers))
        while held > self._tokens:
            held -= len(answers.popleft())
        while len(self._answers) > self._namespaces:
            self._answers.popitem(last=False)

    def recall(self, namespace: str) -> list[int]:
        """The namespace's remembered answers, oldest first, end to end."""
        return [token for answer in self._answers.get(namespace, ()) for token in answer]


class NgramDrafting:
    """The n-gram Drafter: one NgramDrafter per slot, over its request's context and its
    namespace's latest answers. Rows go to the drafts actually proposed, so a slot whose context
    has no match takes none."""

    def __init__(self, config: SpeculationConfig) -> None:
        self._config = config
        self._drafters: dict[int, NgramDrafter] = {}
        self._namespaces: dict[int, str] = {}  # the cache namespace of each slot's request
        self._memory = AnswerMemory(config.answer_memory)

    def start(self, seq_id: int, prompt: list[int], namespace: str = "") -> None:
        self._drafters[seq_id] = NgramDrafter(self._config, prompt, self._memory.recall(namespace))
        self._namespaces[seq_id] = namespace

    def accept(self, seq_id: int, tokens: list[int]) -> None:
        self._drafters[seq_id].accept(tokens)

    def finished(self, seq_id: int) -> None:
        if (drafter := self._drafters.pop(seq_id, None)) is not None:
            self._memory.remember(self._namespaces.pop(seq_id), drafter.answer())

    def propose(self, turns: list[DraftTurn], rows: int) -> dict[int, list[int]]:
        drafts: dict[int, list[int]] = {}
        for turn in turns:
            limit = min(rows, turn.room)
            if limit >= self._config.draft_min and (draft := self._drafters[turn.seq_id].propose(limit)):
                drafts[turn.seq_id] = draft
                rows -= len(draft)
        return drafts

    def verified(self, seq_id: int, drafted: int, accepted: int) -> None:
        self._drafters[seq_id].verified(drafted, accepted)

    def close(self) -> None:
        self._drafters.clear()
        self._namespaces.clear()
