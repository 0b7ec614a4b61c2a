"""Streaming detokenizer: UTF-8 safe deltas, stop strings never shown, even split across tokens."""
from __future__ import annotations

import pytest

from spec_edge.runtime.tokenizer import StreamDecoder, Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_engine) -> Tokenizer:
    return tiny_engine.tokenizer


def test_multibyte_characters_never_split(tokenizer):
    text = "Ünïcödé 🤖 robot"
    ids = tokenizer.encode(text)
    decoder = StreamDecoder(tokenizer)
    deltas = [decoder.push([token]) for token in ids] + [decoder.finish()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_stop_string_split_across_tokens_is_held_back(tokenizer):
    text = "Move the arm. STOP here please"
    ids = tokenizer.encode(text)
    decoder = StreamDecoder(tokenizer, stop=("STOP",))
    shown = ""
    for token in ids:
        shown += decoder.push([token])
        assert "ST" not in shown or decoder.stopped
        if decoder.stopped:
            break
    shown += decoder.finish()
    assert decoder.stopped and shown == "Move the arm. "


def test_chat_template_renders_generation_prompt(tokenizer):
    text = tokenizer.render_chat([("system", "be brief"), ("user", "hi")])
    assert text.endswith("<|im_start|>assistant\n") and "be brief" in text
