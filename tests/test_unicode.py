"""Byte-exact text: tokens that end inside a UTF-8 character never leak U+FFFD into a stream."""

from __future__ import annotations

import pytest

CASES = [
    ("chat", "Translate 'good morning' into Japanese."),
    ("completion", "東京は日本の首都です。大阪は"),
    ("completion", "Les élèves français étudient à l'école. Ils "),
    ("completion", "I love pizza 🍕🍕🍕 and burgers 🍔"),
]


def stream_text(client, model, kind, prompt, max_tokens):
    if kind == "chat":
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True,
        )
        return [c.choices[0].delta.content or "" for c in chunks if c.choices]
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return [c.choices[0].text for c in chunks]


def full_text(client, model, kind, prompt, max_tokens):
    if kind == "chat":
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            logprobs=True,
        )
        token_bytes = [bytes(i.bytes) for i in r.choices[0].logprobs.content]
        split = any(b.decode("utf-8", "replace") != b.decode("utf-8", "ignore") for b in token_bytes)
        return r.choices[0].message.content, split
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0)
    # Legacy logprobs carry token text only: a token ending mid-character shows U+FFFD there.
    return r.choices[0].text, any("\ufffd" in token for token in r.choices[0].logprobs.tokens)


@pytest.mark.parametrize("kind, prompt", CASES)
@pytest.mark.parametrize("max_tokens", [23, 40])
def test_stream_is_byte_exact(client, model, kind, prompt, max_tokens):
    full, _ = full_text(client, model, kind, prompt, max_tokens)
    pieces = stream_text(client, model, kind, prompt, max_tokens)
    assert "".join(pieces) == full
    assert not any("\ufffd" in piece for piece in pieces)
    assert "\ufffd" not in full


def test_the_cases_really_produce_split_and_accented_characters(client, model):
    # Guards the test above: these prompts make the model emit tokens that end mid-character
    # (CJK, emoji) and accented Latin letters.
    japanese_chat, japanese_chat_split = full_text(client, model, *CASES[0], 40)
    japanese, japanese_split = full_text(client, model, *CASES[1], 40)
    french, _ = full_text(client, model, *CASES[2], 40)
    emoji, emoji_split = full_text(client, model, *CASES[3], 40)
    assert any("\u3040" <= ch <= "\u9fff" for ch in japanese_chat + japanese)
    assert any(ord(ch) >= 0x1F300 for ch in emoji)
    assert any(ch in "éèêàçôûë" for ch in french)
    assert japanese_chat_split and japanese_split and emoji_split
