"""Unit tests of the text pipeline: byte-exact incremental UTF-8 decoding and stop matching."""

from __future__ import annotations

import random

from fastrun_cpp.engine.text import IncrementalDetokenizer, StopMatcher


def test_multibyte_characters_split_across_tokens_are_held_back():
    data = "Zürich 東京 🎉!".encode()
    # Every byte its own "token": the worst case for a streaming decoder.
    token_bytes = [bytes([b]) for b in data]
    decoder = IncrementalDetokenizer(token_bytes)
    pieces = [decoder.push(i) for i in range(len(token_bytes))] + [decoder.flush()]
    assert "".join(pieces) == "Zürich 東京 🎉!"
    assert all("\ufffd" not in piece for piece in pieces)


def test_unfinished_character_at_the_end_is_dropped_and_invalid_bytes_replaced():
    decoder = IncrementalDetokenizer([b"ok", b"\xe6\x9d", b"\xff"])
    assert decoder.push(0) == "ok"
    assert decoder.push(1) == ""
    assert decoder.flush() == ""
    assert decoder.push(2) == "\ufffd"


def run_matcher(stops, pieces):
    matcher = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        out.append(text)
        if stopped:
            return "".join(out), True, out
    out.append(matcher.flush())
    return "".join(out), False, out


def test_stop_split_across_pieces_never_leaks():
    text, stopped, pieces = run_matcher(["STOP"], ["Hello S", "T", "OP world"])
    assert (text, stopped) == ("Hello ", True)
    assert all("S" not in p for p in pieces)


def test_partial_stop_that_does_not_complete_is_released():
    text, stopped, _ = run_matcher(["STOP"], ["a ST", "AR is born"])
    assert (text, stopped) == ("a STAR is born", False)


def test_earliest_of_several_stops_wins():
    text, stopped, _ = run_matcher(["world", "lo w"], ["hello world"])
    assert (text, stopped) == ("hel", True)


def reference_cut(stops, pieces):
    """Generation stops at the first piece after which a stop string is in the text; the
    answer is the text before the earliest stop string found then."""
    seen = ""
    for piece in pieces:
        seen += piece
        hits = [seen.find(s) for s in stops if s in seen]
        if hits:
            return seen[: min(hits)], True
    return seen, False


def test_random_splits_agree_with_a_plain_search():
    rng = random.Random(0)
    alphabet = "ab ✓"
    for _ in range(500):
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts = sorted(rng.sample(range(len(full) + 1), k=min(len(full) + 1, rng.randint(0, 6))))
        pieces = [full[a:b] for a, b in zip([0, *cuts], [*cuts, len(full)])]
        expected, expected_stop = reference_cut(stops, pieces)
        text, stopped, _ = run_matcher(stops, pieces)
        assert (text, stopped) == (expected, expected_stop), (full, stops, pieces)
        # Text is held back only while it could still begin a stop string: never more than the
        # longest stop string less one character, so a stream is never delayed for longer.
        matcher, seen, sent = StopMatcher(stops), "", ""
        for piece in pieces:
            released, stopped_now = matcher.push(piece)
            seen, sent = seen + piece, sent + released
            assert expected.startswith(sent)
            if stopped_now:
                break
            assert len(seen) - len(sent) <= max(map(len, stops)) - 1, (stops, pieces, seen, sent)
