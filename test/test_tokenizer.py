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


def test_answer_cut_inside_a_character_drops_its_start(tokenizer):
    """D1: a request that ends (max_new_tokens) after half an emoji: the text ends on the last whole
    character, no delta carries U+FFFD, the ids keep every token."""
    ids = tokenizer.encode("ok 🤖")
    emoji = tokenizer.encode("🤖")
    assert len(emoji) > 1  # the tiny vocabulary spells it byte by byte
    cut = ids[:len(ids) - 1]  # the last byte of the emoji never came
    decoder = StreamDecoder(tokenizer)
    deltas = [decoder.push([token]) for token in cut] + [decoder.finish()]
    assert "".join(deltas) == decoder.text == "ok "
    assert not any("\ufffd" in delta for delta in deltas)
    assert decoder.ids == cut


def test_a_real_replacement_character_is_text(tokenizer):
    """U+FFFD the tokens really spell (bytes EF BF BD) is shown as soon as it is whole, and kept at the end."""
    text = "a \ufffd"
    ids = tokenizer.encode(text)
    decoder = StreamDecoder(tokenizer)
    deltas = [decoder.push([token]) for token in ids]
    assert "".join(deltas) == text  # shown before finish: a whole character is not held back
    assert decoder.finish() == "" and decoder.text == text


def test_broken_bytes_in_the_middle_stay_replaced(tokenizer):
    """A lead byte followed by a non-continuation byte can never complete: its U+FFFD is shown, and the
    text of every prefix is a prefix of the next."""
    lead = tokenizer.token_id("\u00e2")  # byte 0xE2 in the byte-level alphabet (starts a 3-byte character)
    ids = [lead] + tokenizer.encode("ab")
    decoder = StreamDecoder(tokenizer)
    first = decoder.push(ids[:1])
    assert first == ""  # may still complete
    rest = decoder.push(ids[1:]) + decoder.finish()
    assert first + rest == tokenizer.decode(ids) == "\ufffdab"
