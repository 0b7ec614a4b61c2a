"""Guided decoding on real ONNX Runtime graphs of tiny random models: constrained speculative
output == constrained target-only output token for token (every drafter, with and without
grammar-forced drafts), the constrained sampling distribution is the target's restricted and
renormalised one, eos outputs match the grammar, refusals carry the parser's message. Every exactness case
proves it speculated (speculated.assert_speculated): the grammars are chosen so each drafter's own drafts
get through (FREE admits what a random model drafts, ACTION's repeated words feed prompt lookup)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.runtime import speculative
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.sampling import Sampler, SamplingParams
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from test_prefix_reuse import profiles  # noqa: F401 (a fixture: the tiny heads' settings, made once)
from test_speculative import WrongDrafter, truncated_draft_runner
from tiny import assert_sampling_follows_target, engine_with, run_alone

ACTION = r"(pick|place|move) the (red|blue|green) (box|cup|arm)( slowly| fast)?\."
COMMAND = json.dumps({
    "type": "object", "additionalProperties": False, "required": ["action", "object", "speed"],
    "properties": {"action": {"enum": ["pick", "place", "move"]},
                   "object": {"type": "string", "maxLength": 6},
                   "speed": {"type": "integer", "minimum": 0, "maximum": 99}}})
FREE = r"[^\n]{1,24}"  # any one line: the unconstrained drafts of a random model mostly get through
GRAMMARS = [("regex", ACTION), ("regex", FREE), ("json_schema", COMMAND)]
PROMPTS = ["Move the arm to the left", "The robot picks up the red box and places it on the shelf."]


def constrained(engine, prompt_ids, drafter, k, kind, text, forced=False, max_new=60, **kw):
    return run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids, drafter=drafter, k=k,
        constraint=engine.grammars.constraint(kind, text), forced_drafts=forced, **kw))


def make_drafter(engine, self_runner, name):
    return {"ngram": lambda: NgramDrafter(),
            "draft": lambda: ModelDrafter(truncated_draft_runner(engine)),
            "layerskip": lambda: engine.drafter("layerskip"), "self": lambda: ModelDrafter(self_runner, name="self"),
            "wrong": lambda: WrongDrafter(self_runner), "none": lambda: None}[name]()


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    from spec_edge.runtime.backends.ort_runner import b1_runner

    return b1_runner(tiny_engine.graph_dir)


CASES = [(name, forced) for name in ("none", "ngram", "draft", "layerskip", "self", "wrong") for forced in (False, True)
         if name != "none" or forced]  # no drafter and no forced drafts is target-only decoding


def grammars_for(name: str, forced: bool) -> list[tuple[str, str]]:
    """The grammars under which this case speculates: FREE forces nothing; prompt lookup drafts ACTION's and
    COMMAND's repeated words but never a random model's free text; ACTION admits none of a random model's
    own drafts (each is cut to nothing: target-only decoding, so no exactness case)."""
    if forced:
        return [g for g in GRAMMARS if g[1] != FREE] if name in ("none", "ngram") else GRAMMARS
    if name in ("eagle3", "peagle"):  # the fitted heads draft the target's free text: COMMAND cuts every draft
        return [g for g in GRAMMARS if g[1] == FREE]
    return [g for g in GRAMMARS if g[1] != FREE] if name == "ngram" else [g for g in GRAMMARS if g[1] != ACTION]


@pytest.mark.parametrize("name,forced", CASES, ids=[f"{n}-{'forced' if f else 'drafted'}" for n, f in CASES])
def test_greedy_constrained_speculative_equals_constrained_plain(tiny_engine, self_runner, name, forced):
    for kind, text in grammars_for(name, forced):
        for prompt in PROMPTS:
            prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=prompt))
            plain, plain_finish, plain_stats = constrained(tiny_engine, prompt_ids, None, 0, kind, text)
            assert plain_stats.verify_calls == 0 and plain_finish == "eos"
            for k in (3, 7):
                spec, finish, stats = constrained(tiny_engine, prompt_ids, make_drafter(tiny_engine, self_runner, name),
                                                  k, kind, text, forced=forced)
                assert (spec, finish) == (plain, plain_finish), (name, k, forced, kind, spec, plain)
                assert stats.accepted <= stats.drafted <= stats.verify_calls * k
                # the always-wrong drafter is never accepted but by chance; forced drafts always are
                assert_speculated(stats, accepted=name != "wrong" or (forced and text != FREE),
                                  what=f"{name} forced={forced} {kind} {text[:12]!r} {prompt[:12]!r} k={k}")
                if forced and text != FREE:  # every grammar-forced token is accepted: the masked target must choose it
                    assert stats.forced > 0
                if name == "self" and not forced:
                    assert stats.cut > 0  # the unconstrained self-drafter strays: its drafts were cut


@pytest.fixture(scope="module")
def head_engines(tiny_cfg, profiles):  # noqa: F811
    """drafter -> an engine over the tiny heads' profile (one per profile)."""
    made = {}

    def get(drafter):
        settings = {**profiles[drafter], "serve.reuse_prefix": False}
        if settings["runtime.profile"] not in made:
            made[settings["runtime.profile"]] = engine_with(tiny_cfg, settings)
        return made[settings["runtime.profile"]]
    return get


@pytest.mark.parametrize("name", ["eagle3", "peagle", "medusa", "hybrid"])
def test_head_drafters_constrained_equal_constrained_plain(head_engines, name):
    """The drafters over the target's hidden states, through run_one: the same constrained
    answer as target-only (speculate false), with and without grammar-forced drafts."""
    engine = head_engines(name)
    for forced in (False, True):
        for kind, text in grammars_for(name, forced):
            for prompt in PROMPTS:
                fields = {"prompt": prompt, "max_new_tokens": 60, kind: text}
                plain = run_one(engine, GenerateRequest(speculate=False, **fields))
                assert plain.stats.verify_calls == 0 and plain.finish_reason == "eos"
                spec = run_one(engine, GenerateRequest(drafter=name, k=3, forced_drafts=forced, **fields))
                assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, plain.finish_reason), (name, forced)
                # the fitted heads know the target's unconstrained answers (tiny.FIT_TEXTS): under FREE their own
                # drafts are accepted for PROMPTS[0]; for PROMPTS[1] the constrained answer leaves the fitted one
                # (measured: 12 verify calls, 0 accepted) and COMMAND's JSON is not in the fit; forced drafts always are
                assert_speculated(spec.stats, accepted=(forced and text != FREE) or (
                                      not forced and text == FREE and prompt == PROMPTS[0]),
                                  what=f"{name} forced={forced} {kind} {text[:12]!r} {prompt[:12]!r}")


def test_eos_outputs_match_the_grammar(tiny_engine):
    """On finish eos the text matches: the regex in full, the JSON against the schema (enum, maxLength,
    range, no extra keys)."""
    for prompt in PROMPTS:
        for drafter in ("draft", "ngram"):
            got = run_one(tiny_engine, GenerateRequest(prompt=prompt, regex=ACTION, drafter=drafter, max_new_tokens=60))
            assert got.finish_reason == "eos" and re.fullmatch(ACTION, got.text), got.text
            got = run_one(tiny_engine, GenerateRequest(prompt=prompt, json_schema=COMMAND, drafter=drafter,
                                                       max_new_tokens=60))
            assert got.finish_reason == "eos" and got.message == "", got
            value = json.loads(got.text)
            assert set(value) == {"action", "object", "speed"} and value["action"] in ("pick", "place", "move")
            assert isinstance(value["object"], str) and len(value["object"]) <= 6
            assert isinstance(value["speed"], int) and 0 <= value["speed"] <= 99


def test_forced_tokens_are_free_drafts(tiny_engine):
    """With no drafter at all, the grammar's forced tokens (the JSON keys and punctuation) are verified
    k at a time, all accepted: fewer target calls, the same output."""
    request = GenerateRequest(prompt=PROMPTS[0], json_schema=COMMAND, drafter="none", max_new_tokens=60, k=4)
    plain = run_one(tiny_engine, GenerateRequest(**{**request.__dict__, "forced_drafts": False}))
    forced = run_one(tiny_engine, request)
    assert forced.token_ids == plain.token_ids and forced.finish_reason == "eos"
    s = forced.stats
    assert s.forced > 0 and s.accepted == s.drafted == s.forced and s.verify_calls > 0
    assert s.verify_calls + s.step_calls < plain.stats.step_calls
    off = run_one(tiny_engine, GenerateRequest(**{**request.__dict__, "speculate": False}))
    assert off.token_ids == plain.token_ids and off.stats.verify_calls == 0  # speculate=false: no forced drafts


def test_grammar_that_cannot_complete_ends_with_length(tiny_engine):
    got = run_one(tiny_engine, GenerateRequest(prompt=PROMPTS[0], json_schema=COMMAND, max_new_tokens=4))
    assert got.finish_reason == "length" and len(got.token_ids) == 4
    assert "not complete under the json_schema" in got.message and "max_new_tokens" in got.message


@pytest.mark.parametrize("fields,message", [
    ({"json_schema": '{"type": "frob"}'}, "json_schema is invalid: "),
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"regex": "a(b"}, "regex is invalid: "),
    ({"grammar": "start: x"}, "grammar is invalid: at 1(8): unknown name"),
    ({"grammar": 'root ::= "yes" | "no'}, "grammar does not parse"),
    ({"regex": "a", "json_schema": "{}"}, "at most one of json_schema, grammar, regex"),
])
def test_invalid_grammar_is_refused(tiny_engine, fields, message):
    with pytest.raises(RequestError, match=re.escape(message)) as err:
        front_of(tiny_engine).prepare(GenerateRequest(prompt="hi", **fields))
    assert "\n" not in str(err.value)
    got = run_one(tiny_engine, GenerateRequest(prompt="hi", grammar='root ::= "yes" | "no"', max_new_tokens=8))
    assert got.finish_reason == "eos" and got.text in ("yes", "no")  # the engine keeps serving


def test_compiled_grammars_are_cached(tiny_engine):
    first = tiny_engine.grammars.compile("regex", ACTION)
    assert tiny_engine.grammars.compile("regex", ACTION) is first
    a, b = (tiny_engine.grammars.constraint("regex", ACTION) for _ in range(2))
    a.consume(tiny_engine.tokenizer.encode("pick"))
    assert a.matcher is not b.matcher and b.admitted(tiny_engine.tokenizer.encode("move")) > 0


def test_constrained_sampling_follows_the_constrained_target(tiny_engine):
    """Speculative sampling under a grammar (the unconstrained target drafting for itself: sampled
    drafts, cut where they stray, their q rows masked and renormalised) keeps the target's
    distribution restricted to the grammar and renormalised: the exact distribution of the first
    five tokens (k=3: an accepted window's bonus token among them) vs 800 seeded runs, chi-square below its
    0.999 quantile (T=2: the drafter's top-2 often holds a forbidden token)."""
    from spec_edge.runtime.backends.ort_runner import b1_runner

    drafter = ModelDrafter(b1_runner(tiny_engine.graph_dir), name="self")  # samples from the unmasked target
    runs = assert_sampling_follows_target(tiny_engine, drafter, must_accept=True, n=800, k=3, length=5,
                                          params=SamplingParams(temperature=2.0, top_k=2),
                                          constraint=("regex", r"[a-z ]{1,12}\."))
    assert sum(stats.cut for stats in runs) > 0  # drafts were cut, too


def test_verify_masks_and_renormalises_the_draft_q(tiny_engine):
    """The loop's verify rule under a grammar (speculative.accept_rows, a real grammar state): a drafted token a
    whose drafter row q put half its mass on a forbidden id is judged against q restricted to the grammar and
    renormalised (q(a) = 1), so it is accepted with p(a) / 1 = 1/2; judged against the raw q(a) = 1/2 it would
    always be accepted and a would be emitted too often (the constrained chi-square test's grammar seldom
    meets such a row)."""
    constraint = tiny_engine.grammars.constraint("regex", ACTION)
    allowed = np.flatnonzero(constraint.masks([])[0])
    a, b = int(allowed[0]), int(allowed[1])
    forbidden = int(np.flatnonzero(~constraint.masks([])[0])[0])
    vocab = tiny_engine.target.vocab_size
    logits = np.zeros((2, vocab), np.float32)  # row 0: p(a) = p(b) = 1/2 once masked (top_k=2); row 1: the bonus
    logits[0, [a, b]] = 5.0
    q = np.zeros((1, vocab))
    q[0, [a, forbidden]] = 0.5
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2), seed=0)
    n = 4000
    accepted = sum(speculative.accept_rows(logits, Draft(tokens=[a], q_draft=q), constraint, sampler,
                                           [a])[0] for _ in range(n))
    assert abs(accepted / n - 0.5) < 0.04, accepted / n


def test_guided_bench_on_tiny(tiny_cfg, tmp_path):
    """spec-edge bench --guided end to end: every guided row valid, the ids identical across drafters
    and variants (exit 0), the forced variant proposing the schema's keys."""
    import argparse

    from spec_edge.tools import guided_bench

    prompts = tmp_path / "schemas.jsonl"
    prompts.write_text(json.dumps({"id": "cmd", "kind": "pick-and-place", "prompt": PROMPTS[0],
                                   "schema": json.loads(COMMAND)}) + "\n")
    out = tmp_path / "guided.json"
    args = argparse.Namespace(prompts=str(prompts), full=False, repeats=1, drafters=["ngram", "draft"], ks=[4],
                              max_new_tokens=60, json_out=str(out))
    assert guided_bench.main(tiny_cfg, args, lambda message: None) == 0
    rows = {(r["drafter"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 9 and all(rows[(d, v)]["validity"] == 1.0 for d in ("none", "ngram", "draft")
                                  for v in ("guided", "guided+forced"))
    assert rows[("none", "guided+forced")]["forced"] > 0 and rows[("none", "guided+forced")]["acceptance"] == 1.0


def test_schema_check_catches_what_matters():
    from spec_edge.tools.schema_check import valid_json

    schema = json.loads(COMMAND)
    assert valid_json('{"action": "pick", "object": "box", "speed": 3}', schema) == (True, "")
    for text in ('{"action": "pick", "object": "box"}', '{"action": "run", "object": "box", "speed": 3}',
                 '{"action": "pick", "object": "a long box", "speed": 3}', '{"action": "pick", "object": "box", '
                 '"speed": 3.5}', '{"action": "pick", "object": "box", "speed": 3, "x": 1}', '{"action": "pick"'):
        assert valid_json(text, schema)[0] is False, text
    with pytest.raises(ValueError, match="pattern"):
        valid_json('"a"', {"type": "string", "pattern": "a"})
