"""Guided decoding on real ONNX Runtime graphs of tiny random models: constrained speculative
output == constrained target-only output token for token (every drafter, with and without
grammar-forced drafts), the constrained sampling distribution is the target's restricted and
renormalised one, eos outputs match the grammar, refusals carry the parser's message."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from spec_edge.runtime import speculative
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.sampling import SamplingParams, probabilities
from test_prefix_reuse import profiles  # noqa: F401 (a fixture: the tiny heads' settings, made once)
from test_speculative import WrongDrafter
from tiny import chi2_critical, chi2_statistic, engine_with

ACTION = r"(pick|place|move) the (red|blue|green) (box|cup|arm)( slowly| fast)?\."
COMMAND = json.dumps({
    "type": "object", "additionalProperties": False, "required": ["action", "object", "speed"],
    "properties": {"action": {"enum": ["pick", "place", "move"]},
                   "object": {"type": "string", "maxLength": 6},
                   "speed": {"type": "integer", "minimum": 0, "maximum": 99}}})
GRAMMARS = [("regex", ACTION), ("json_schema", COMMAND)]
PROMPTS = ["Move the arm to the left", "The robot picks up the red box and places it on the shelf."]


def constrained(engine, prompt_ids, drafter, k, kind, text, forced=False, max_new=60, **kw):
    return speculative.generate(engine.runner, speculative.SlotRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids, drafter=drafter, k=k,
        constraint=engine.grammars.constraint(kind, text), forced_drafts=forced, **kw))


def make_drafter(engine, self_runner, name):
    return {"ngram": lambda: NgramDrafter(), "draft": lambda: engine.drafter("draft"),
            "layerskip": lambda: engine.drafter("layerskip"), "self": lambda: ModelDrafter(self_runner, name="self"),
            "wrong": lambda: WrongDrafter(self_runner), "none": lambda: None}[name]()


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    from spec_edge.runtime.backends.ort_runner import b1_runner

    return b1_runner(tiny_engine.graph_dir)


@pytest.mark.parametrize("kind,text", GRAMMARS, ids=["regex", "json_schema"])
@pytest.mark.parametrize("name", ["none", "ngram", "draft", "layerskip", "self", "wrong"])
def test_greedy_constrained_speculative_equals_constrained_plain(tiny_engine, self_runner, name, kind, text):
    for prompt in PROMPTS:
        prompt_ids = tiny_engine.prompt_ids(GenerateRequest(prompt=prompt))
        plain, plain_finish, plain_stats = constrained(tiny_engine, prompt_ids, None, 0, kind, text)
        assert plain_stats.verify_calls == 0 and plain_finish == "eos"
        for k in (3, 7):
            for forced in (False, True):
                if name == "none" and not forced:
                    continue
                spec, finish, stats = constrained(tiny_engine, prompt_ids, make_drafter(tiny_engine, self_runner, name),
                                                  k, kind, text, forced=forced)
                assert (spec, finish) == (plain, plain_finish), (name, k, forced, spec, plain)
                assert stats.accepted <= stats.drafted <= stats.verify_calls * k
                if forced:  # every grammar-forced token is accepted: the masked target must choose it
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
    """The drafters over the target's hidden states, through Engine.generate: the same constrained
    answer as target-only (speculate false), with and without grammar-forced drafts."""
    engine = head_engines(name)
    for kind, text in GRAMMARS:
        for prompt in PROMPTS:
            fields = {"prompt": prompt, "max_new_tokens": 60, kind: text}
            plain = engine.generate(GenerateRequest(speculate=False, **fields))
            assert plain.stats.verify_calls == 0 and plain.finish_reason == "eos"
            for forced in (False, True):
                spec = engine.generate(GenerateRequest(drafter=name, k=3, forced_drafts=forced, **fields))
                assert (spec.token_ids, spec.finish_reason) == (plain.token_ids, plain.finish_reason), (name, forced)
                assert spec.stats.drafted + spec.stats.cut > 0  # it did draft (the random heads' drafts are often cut)


def test_eos_outputs_match_the_grammar(tiny_engine):
    """On finish eos the text matches: the regex in full, the JSON against the schema (enum, maxLength,
    range, no extra keys)."""
    for prompt in PROMPTS:
        for drafter in ("draft", "ngram"):
            got = tiny_engine.generate(GenerateRequest(prompt=prompt, regex=ACTION, drafter=drafter, max_new_tokens=60))
            assert got.finish_reason == "eos" and re.fullmatch(ACTION, got.text), got.text
            got = tiny_engine.generate(GenerateRequest(prompt=prompt, json_schema=COMMAND, drafter=drafter,
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
    plain = tiny_engine.generate(GenerateRequest(**{**request.__dict__, "forced_drafts": False}))
    forced = tiny_engine.generate(request)
    assert forced.token_ids == plain.token_ids and forced.finish_reason == "eos"
    s = forced.stats
    assert s.forced > 0 and s.accepted == s.drafted == s.forced and s.verify_calls > 0
    assert s.verify_calls + s.step_calls < plain.stats.step_calls
    off = tiny_engine.generate(GenerateRequest(**{**request.__dict__, "speculate": False}))
    assert off.token_ids == plain.token_ids and off.stats.verify_calls == 0  # speculate=false: no forced drafts


def test_grammar_that_cannot_complete_ends_with_length(tiny_engine):
    got = tiny_engine.generate(GenerateRequest(prompt=PROMPTS[0], json_schema=COMMAND, max_new_tokens=4))
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
        tiny_engine.validate(GenerateRequest(prompt="hi", **fields))
    assert "\n" not in str(err.value)
    got = tiny_engine.generate(GenerateRequest(prompt="hi", grammar='root ::= "yes" | "no"', max_new_tokens=8))
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
    three tokens vs 600 seeded runs, chi-square below its 0.999 quantile (T=2: the drafter's top-3
    often holds a forbidden token)."""
    from spec_edge.runtime.backends.ort_runner import b1_runner

    regex = r"[a-z ]{1,12}\."
    params = SamplingParams(temperature=2.0, top_k=3)  # the drafter's top-3 is often forbidden
    runner = b1_runner(tiny_engine.graph_dir)
    prompt_ids = tiny_engine.prompt_ids(GenerateRequest(prompt="Move the arm"))
    pos = len(prompt_ids)
    ref = tiny_engine.grammars.constraint("regex", regex)

    def p_after(logits, path):
        allowed = ref.masks(list(path))[-1:]  # (1, V): the ids allowed after path
        return probabilities(np.where(allowed, logits[None], -np.inf), params)[0]

    p1 = p_after(runner.prefill(prompt_ids, 0), [])
    exact = {}
    for t1 in np.flatnonzero(p1):
        p2 = p_after(runner.forward([int(t1)], pos)[0], [t1])
        for t2 in np.flatnonzero(p2):
            p3 = p_after(runner.forward([int(t2)], pos + 1)[0], [t1, t2])
            for t3 in np.flatnonzero(p3):
                exact[(int(t1), int(t2), int(t3))] = p1[t1] * p2[t2] * p3[t3]
    assert abs(sum(exact.values()) - 1) < 1e-6 and len(exact) > 4
    counts: dict = {}
    drafted = cut = accepted = 0
    n = 600
    drafter = ModelDrafter(b1_runner(tiny_engine.graph_dir), name="self")  # samples from the unmasked target
    for seed in range(n):
        ids, _, stats = speculative.generate(tiny_engine.runner, speculative.SlotRequest(
            prompt_ids=prompt_ids, max_new_tokens=3, eos_ids=(), sampling=params, seed=seed, drafter=drafter, k=3,
            constraint=tiny_engine.grammars.constraint("regex", regex)))
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        drafted, cut, accepted = drafted + stats.drafted, cut + stats.cut, accepted + stats.accepted
    assert drafted > 0 and cut > 0 and accepted > 0  # speculation, cut drafts and accepted drafts all happened
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df, sorted(counts.items(), key=lambda kv: -kv[1])[:5])


@pytest.mark.parametrize("mask_q", [True, False])
def test_cut_draft_with_masked_q_preserves_p(mask_q):
    """The rule behind the loop, one position: a sampled draft x ~ q is cut when the grammar forbids
    it (then the target's token is drawn from the masked p), else verified against the masked p with
    q masked and renormalised the same way: the output follows the masked p. Verifying against the
    unmasked q instead is detected (the test can fail)."""
    from spec_edge.runtime.grammar import mask_probs
    from spec_edge.runtime.sampling import sample, speculative_accept

    rng = np.random.default_rng(3)
    vocab, n = 6, 20000
    allowed = np.array([[True, True, True, True, False, False]] * 2)  # (k+1, V), k=1
    logits = rng.normal(size=(2, vocab))
    p = probabilities(np.where(allowed, logits, -np.inf), SamplingParams(temperature=1.0))
    q = rng.dirichlet(np.ones(vocab) * 0.5, size=1)  # the drafter's own row: mass on forbidden ids too
    q[0, 4:] += 0.5
    q /= q.sum()
    counts: dict = {}
    for _ in range(n):
        draft = int(rng.choice(vocab, p=q[0]))
        if not allowed[0, draft]:  # cut: no draft left, the target's masked row decides
            out = sample(p[0], rng)
        else:
            q_used = mask_probs(q, allowed[:1]) if mask_q else q
            n_accepted, token = speculative_accept(p, q_used, [draft], rng)
            out = draft if n_accepted == 1 else token
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi2_statistic(counts, {i: p[0, i] for i in range(4)}, n)
    assert (stat < chi2_critical(df)) == mask_q, (stat, df)


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
