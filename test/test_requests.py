"""Bad input gets a clear error (never a traceback or a hang) and the engine keeps serving."""
from __future__ import annotations

import pytest

from spec_edge.config import ConfigError
from spec_edge.runtime.drafting import check_same_tokenizer
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.runtime.scheduler import run_one

BAD = [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt="   \n"), "prompt is empty"),
    (dict(prompt="robot " * 400), "context holds 128"),
    (dict(prompt="hi", max_new_tokens=0), r"max_new_tokens must be in \[1, 127\]"),
    (dict(prompt="hi", max_new_tokens=10**9), r"max_new_tokens must be in \[1, 127\]"),
    (dict(prompt="hi", k=5), r"k=5 has no verify graph .* k in \[1, 3, 4, 7\]"),
    (dict(prompt="hi", k=99), "k=99 has no verify graph"),
    (dict(prompt="hi", temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(prompt="hi", temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(prompt="hi", temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(prompt="hi", top_p=float("nan")), r"top_p must be in \(0, 1\]"),
    (dict(prompt="hi", top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(prompt="hi", top_p=2.0), r"top_p must be in \(0, 1\]"),
    (dict(prompt="hi", top_k=-3), "top_k must be >= 0"),
    (dict(prompt="hi", drafter="medusa9"), "unknown drafter 'medusa9'"),
    (dict(prompt="bad \x07 bell"), "control character U\\+0007"),
    (dict(prompt="bad \udcff byte"), r"prompt is not valid UTF-8 \(an undecodable byte at character 4\)"),
    (dict(messages=(("user", "hi"), ("assistant", "ok\udcff"))), r"messages\[1\] \(assistant\) is not valid UTF-8 "
                                                                 r"\(an undecodable byte at character 2\)"),
    (dict(prompt="cut \x00 here"), "control character U\\+0000 at character 4"),  # NUL: refused where it is seen
    (dict(prompt="hi", seed=-5), r"seed must be >= 0 \(reproducible sampling\) or -1 \(nondeterministic\), got -5"),
    (dict(prompt="hi", stop=("\x00",)), "stop string contains control character"),
    (dict(messages=(("robot", "hi"),)), "messages\\[0\\] has role 'robot': use one of system, user, assistant"),
    (dict(messages=(("user", "hi"), ("User", "again"))), "messages\\[1\\] has role 'User'"),
    (dict(prompt="hi", max_new_tokens=127), r"prompt \(\d+ tokens\) \+ max_new_tokens \(127\) = \d+ exceed the "
                                            r"context of 128 tokens: ask for at most \d+ new tokens"),
    (dict(prompt="hi", min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(prompt="hi", repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(prompt="hi", presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(prompt="hi", frequency_penalty=float("inf")), "frequency_penalty must be a finite number"),
    (dict(prompt="hi", logprobs=21), r"logprobs must be in \[0, 20\]"),
    (dict(prompt="hi", logit_bias=((10 ** 6, 1.0),)), r"token id 1000000, outside the vocabulary \[0, 320\)"),
    (dict(prompt="hi", logit_bias=((3, float("inf")),)), "logit_bias for token 3 must be a finite number"),
    (dict(prompt="hi", ignore_eos=True, regex="(yes|no)"), "ignore_eos cannot be combined with json_schema"),
]


@pytest.mark.parametrize("fields,message", BAD)
def test_bad_request_is_refused_clearly(tiny_engine, fields, message):
    with pytest.raises(RequestError, match=message):
        run_one(tiny_engine, GenerateRequest(**fields))
    good = run_one(tiny_engine, GenerateRequest(prompt="Move the arm", max_new_tokens=5, drafter="ngram"))
    assert good.finish_reason in ("length", "eos") and good.token_ids


def test_replacement_character_is_text(tiny_engine):
    """U+FFFD is a character: a prompt holding it is answered, and so is an assistant turn holding it (an
    answer holds U+FFFD where the model wrote bytes that are not UTF-8; the node test sends one back)."""
    assert run_one(tiny_engine, GenerateRequest(prompt="ok \ufffd", max_new_tokens=5)).token_ids
    turns = (("user", "ok \ufffd"), ("assistant", "fine \ufffd"), ("user", "and \ufffd again"))
    assert run_one(tiny_engine, GenerateRequest(messages=turns, max_new_tokens=5)).token_ids
    assert run_one(tiny_engine, GenerateRequest(prompt="hi", seed=-1, temperature=0.8, max_new_tokens=3)).token_ids


def test_draft_model_with_another_tokenizer_is_refused(tiny_engine, tmp_path):
    from tiny import train_tokenizer

    other = train_tokenizer(vocab_size=300)
    other.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="another tokenizer"):
        check_same_tokenizer(Tokenizer(tmp_path), tiny_engine.tokenizer, "other-draft")


def test_cancel_ends_between_steps(tiny_engine):
    calls = []

    def cancel():
        calls.append(1)
        return "cancelled" if len(calls) > 3 else None

    result = run_one(tiny_engine, GenerateRequest(prompt="Move the arm", max_new_tokens=60), cancel=cancel)
    assert result.finish_reason == "cancelled" and 0 < len(result.token_ids) < 60
