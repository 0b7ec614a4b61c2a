"""The request fields that change the target's distribution (min_p, repetition / presence / frequency
penalties, logit_bias, ignore_eos) and logprobs, on tiny random-weight models through real ONNX Runtime
graphs: each row is processed with its own history (sampling.processed_logits), so greedy speculative ==
greedy target-only token for token with each option on (prompt lookup and the draft model, B=1 and in a
busy batch), logprobs are the same numbers with speculation on or off (the refusals: test_requests.py),
and the CLI carries the flags and `logprobs` in --json."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from spec_edge import cli, config as cfgmod
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.ort_runner import b1_runner
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.sampling import SamplingParams, probabilities, processed_logits, token_logprobs
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from tiny import run_alone, run_together

PROMPTS = ["The robot picks up the red box and places it on the shelf. The robot picks up the",
           "Move the arm to the left, move the arm to the right, move the arm",
           "def add(a, b):", "Navigate to the kitchen and report the battery level."]
MAX_NEW = 40


def test_each_row_sees_its_own_history():
    """Row i of a window counts the drafts before it; the repetition penalty counts the prompt, presence and
    frequency only the output; the bias is added; suppressed ids are -inf."""
    logits = np.tile(np.array([2.0, -1.0, 0.5, 1.0, 3.0]), (3, 1))  # (3, V=5)
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                            logit_bias=((3, 1.5),), suppressed=(4,))
    out = processed_logits(logits, params, prompt=[0], generated=[1, 1], window=[2, 2])
    # id 0: prompt only -> 2.0 / 2; id 1: output twice -> -1 * 2 - 0.5 - 0.5; id 2: 0, 1, 2 times in rows 0, 1, 2
    np.testing.assert_allclose(out[:, 0], [1.0, 1.0, 1.0])
    np.testing.assert_allclose(out[:, 1], [-3.0, -3.0, -3.0])
    np.testing.assert_allclose(out[:, 2], [0.5, 0.25 - 0.75, 0.25 - 1.0])
    np.testing.assert_allclose(out[:, 3], [2.5, 2.5, 2.5])
    assert np.all(out[:, 4] == -np.inf)
    assert processed_logits(logits, SamplingParams(), [0], [1]) is logits  # nothing asked: untouched


def test_min_p_keeps_ids_near_the_top():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    probs = probabilities(logits, SamplingParams(temperature=1.0, min_p=0.5))  # keeps p >= 0.25
    np.testing.assert_allclose(probs[0], [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])
    assert np.count_nonzero(probabilities(logits, SamplingParams(temperature=1.0, min_p=1.0))) == 1


def ids_of(engine, text):
    return engine.tokenizer.encode(text)


def run(engine, prompt_ids, params, drafter=None, k=0, eos_ids=None):
    return run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=list(prompt_ids), max_new_tokens=MAX_NEW, eos_ids=engine.eos_ids if eos_ids is None else eos_ids,
        sampling=params, drafter=drafter, k=k if drafter is not None else 0))


def option_params(engine, name):
    """(params, eos_ids) of one option, chosen so that it changes the greedy output of PROMPTS[0]."""
    plain = run(engine, ids_of(engine, PROMPTS[0]), SamplingParams())[0]
    if name == "penalties":  # a favoured token repeats until the penalties outweigh its bias: prompt lookup
        # drafts the repeats, and the row where the output moves on must count the drafts before it
        return PENALTIES(plain[0]), engine.eos_ids
    if name == "logit_bias":  # forbid the plain output's 3rd token, favour its 6th
        return SamplingParams(logit_bias=((plain[2], -100.0), (plain[5], 2.0))), engine.eos_ids
    if name == "ignore_eos":  # a token the plain output emits plays EOS: ignored, it is never chosen
        return SamplingParams(suppressed=(plain[4],)), (plain[4],)
    raise ValueError(name)


OPTIONS = ("penalties", "logit_bias", "ignore_eos")


def PENALTIES(favoured: int, logprobs: int = 0) -> SamplingParams:
    return SamplingParams(logit_bias=((favoured, 300.0),), repetition_penalty=1.5, presence_penalty=10.0,
                          frequency_penalty=30.0, logprobs=logprobs)


def with_lookup(params: SamplingParams, favoured: int) -> SamplingParams:
    """params with the penalties' favoured token on top, so prompt lookup drafts its repeats (accepted) under
    the option too (a random target never repeats itself)."""
    lookup = PENALTIES(favoured)
    if lookup.logit_bias[0] in params.logit_bias:  # the penalties option itself
        return params
    return dataclasses.replace(params, logit_bias=params.logit_bias + lookup.logit_bias,
                               repetition_penalty=lookup.repetition_penalty, presence_penalty=lookup.presence_penalty,
                               frequency_penalty=lookup.frequency_penalty)


@pytest.mark.parametrize("option", OPTIONS)
def test_greedy_speculative_equals_target_only_with_each_option(tiny_engine, option):
    """Each option alone with layer skip drafting, and with the favoured token on top (with_lookup) with prompt
    lookup and the draft model drafting: every (prompt, drafter) case accepts drafts."""
    params, eos_ids = option_params(tiny_engine, option)
    favoured = option_params(tiny_engine, "penalties")[0].logit_bias[0][0]
    changed = False
    lookup = with_lookup(params, favoured)
    for text in PROMPTS:
        prompt_ids = ids_of(tiny_engine, text)
        target_only = {params: run(tiny_engine, prompt_ids, params, eos_ids=eos_ids)}
        if lookup != params:
            target_only[lookup] = run(tiny_engine, prompt_ids, lookup, eos_ids=eos_ids)
        default = run(tiny_engine, prompt_ids, SamplingParams(), eos_ids=tiny_engine.eos_ids)
        changed |= target_only[params][0] != default[0]
        for name, drafted in (("layerskip", params), ("ngram", lookup), ("draft", lookup)):
            want, finish, _ = target_only[drafted]
            if option == "ignore_eos":
                assert finish == "length" and eos_ids[0] not in want
            drafter = NgramDrafter() if name == "ngram" else tiny_engine.drafter(name)
            spec, spec_finish, stats = run(tiny_engine, prompt_ids, drafted, drafter, 4, eos_ids)
            assert (spec, spec_finish) == (want, finish), (option, name, text)
            assert_speculated(stats, what=f"{option} {name} {text[:12]!r}")
            if name == "ngram":  # repeats drafted, the move-on rejected
                assert 0 < stats.accepted < stats.drafted, stats
    assert changed  # the option really changes the output (the test can fail)


def test_busy_batch_with_options_equals_target_only(tiny_cfg, tiny_engine):
    """Four slots, requests with the options (and plain ones) joining mid-stream beside each other, ngram
    and draft-model drafters: each == its B=1 target-only output, logprobs allclose."""
    from spec_edge.artifacts import model_graphs
    from spec_edge.runtime.backends.ort_runner import OrtRunner
    from test_batch import K, batch_cfg

    cfg = batch_cfg(tiny_cfg)
    runner = OrtRunner(model_graphs(cfg, "target", progress=lambda message: None), slots=cfg.graphs.batch_slots)
    draft_dir = tiny_engine.drafter("draft").runner.runner.graph_dir
    penalties, _ = option_params(tiny_engine, "penalties")
    bias, _ = option_params(tiny_engine, "logit_bias")
    ignore, eos = option_params(tiny_engine, "ignore_eos")
    favoured = penalties.logit_bias[0][0]
    cases = [(PROMPTS[0], penalties, tiny_engine.eos_ids, "ngram"),
             (PROMPTS[1], with_lookup(bias, favoured), tiny_engine.eos_ids, "draft"),
             (PROMPTS[2], SamplingParams(), tiny_engine.eos_ids, None), (PROMPTS[3], with_lookup(ignore, favoured), eos, "ngram"),
             (PROMPTS[1], PENALTIES(favoured, logprobs=3), tiny_engine.eos_ids, "ngram"),
             (PROMPTS[0], with_lookup(SamplingParams(min_p=0.05, logprobs=3), favoured), tiny_engine.eos_ids, "draft")]
    requests = [speculative.SlotRequest(
        prompt_ids=ids_of(tiny_engine, text), max_new_tokens=MAX_NEW, eos_ids=eos_ids, sampling=params,
        drafter={"ngram": NgramDrafter(), "draft": ModelDrafter(b1_runner(draft_dir), name="draft"),
                 None: None}[name], k=K if name else 0) for text, params, eos_ids, name in cases]
    together = run_together(runner, requests, join_at=[0, 0, 2, 0, 4, 6])
    for (text, params, eos_ids, name), (ids, finish, stats) in zip(cases, together):
        alone, alone_finish, alone_stats = run(tiny_engine, ids_of(tiny_engine, text), params, eos_ids=eos_ids)
        assert (ids, finish) == (alone, alone_finish), text
        if name is not None:
            assert_speculated(stats, what=f"{name} {params}")
        assert len(stats.logprobs) == (len(ids) if params.logprobs else 0) == len(alone_stats.logprobs)
        for got, want in zip(stats.logprobs, alone_stats.logprobs):
            assert got.token_id == want.token_id and got.top_ids == want.top_ids
            np.testing.assert_allclose(got.top_logprobs, want.top_logprobs, atol=1e-4)


def test_logprobs_equal_with_speculation_on_or_off(tiny_engine):
    """The same numbers from target-only, prompt lookup and the draft model (atol 1e-4: the verify graph's
    rows vs the step graph's), and they are the log-softmax of the processed logits."""
    favoured = option_params(tiny_engine, "penalties")[0].logit_bias[0][0]
    params = PENALTIES(favoured)
    base = dict(prompt=PROMPTS[0], max_new_tokens=24, logprobs=4, chat=False, logit_bias=params.logit_bias,
                repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty)
    plain = run_one(tiny_engine, GenerateRequest(**base, speculate=False))
    assert len(plain.logprobs) == len(plain.token_ids) == 24
    for entry in plain.logprobs:  # greedy: the chosen token is the row's most likely one
        assert entry.top_ids[0] == entry.token_id and entry.logprob == entry.top_logprobs[0]
        assert len(entry.top_ids) == 4 and list(entry.top_logprobs) == sorted(entry.top_logprobs, reverse=True)
    for drafter in ("ngram", "draft"):
        spec = run_one(tiny_engine, GenerateRequest(**base, drafter=drafter, k=4))
        assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(plain.logprobs)
        assert_speculated(spec.stats, what=drafter)
        for got, want in zip(spec.logprobs, plain.logprobs):
            assert (got.token_id, got.top_ids) == (want.token_id, want.top_ids)
            np.testing.assert_allclose([got.logprob, *got.top_logprobs], [want.logprob, *want.top_logprobs],
                                       atol=1e-4)
    # the first token's numbers, computed here from the prefill logits
    prompt_ids = tiny_engine.tokenizer.encode(PROMPTS[0])
    logits = b1_runner(tiny_engine.graph_dir).prefill(prompt_ids, 0)[None]
    (first,) = token_logprobs(processed_logits(logits, params, prompt_ids, []), [plain.token_ids[0]], 4)
    np.testing.assert_allclose(first.top_logprobs, plain.logprobs[0].top_logprobs, atol=1e-5)
    assert "logprobs" in plain.as_dict() and "logprobs" not in run_one(tiny_engine, 
        GenerateRequest(prompt="hi", max_new_tokens=2)).as_dict()


def test_cli_generate_flags_and_json(tiny_cfg, tiny_engine, tmp_path, capsys):
    """The flags reach the request: --ignore-eos runs to the length, --logprobs fills --json's logprobs, and
    the answer equals the same request through the engine."""
    profile = tmp_path / "tiny.yaml"
    profile.write_text(cfgmod.dump(tiny_cfg))
    argv = ["generate", "--config", str(profile), "--prompt", PROMPTS[1], "--raw", "--max-new-tokens", "12",
            "--drafter", "ngram", "--k", "4", "--repetition-penalty", "1.2", "--presence-penalty", "0.3",
            "--frequency-penalty", "0.1", "--logit-bias", "5:-100", "--logit-bias", "7:1.5", "--min-p", "0.05",
            "--ignore-eos", "--logprobs", "2", "--json"]
    assert cli.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    want = run_one(tiny_engine, GenerateRequest(
        prompt=PROMPTS[1], chat=False, max_new_tokens=12, drafter="ngram", k=4, repetition_penalty=1.2,
        presence_penalty=0.3, frequency_penalty=0.1, logit_bias=((5, -100.0), (7, 1.5)), min_p=0.05,
        ignore_eos=True, logprobs=2))
    assert result["token_ids"] == want.token_ids and result["finish_reason"] == "length"
    assert [entry["token_id"] for entry in result["logprobs"]] == want.token_ids
    assert all(len(entry["top_ids"]) == 2 for entry in result["logprobs"]) and 5 not in result["token_ids"]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--prompt", "hi", "--logit-bias", "five:1"])
    assert "--logit-bias takes TOKEN_ID:BIAS" in capsys.readouterr().err
    assert cli.main(argv[:-1]) == 2  # --logprobs without --json would print nothing of them
    assert "--logprobs is reported in --json's `logprobs` key: add --json" in capsys.readouterr().err


def test_cli_k_is_a_request_field(tiny_cfg, tiny_engine, tmp_path, capsys):
    """`spec-edge generate --k K` is the request's k as every door's: a k the graphs lack is refused (exit 2) with
    the words HTTP and ROS answer (the scheduler's Outcome) and the command that builds it, exporting nothing."""
    import logging

    from spec_edge.runtime.scheduler import Job, Scheduler

    profile = tmp_path / "tiny.yaml"
    profile.write_text(cfgmod.dump(tiny_cfg))
    engines = cfgmod.load(str(profile)).runtime.engine_dir
    before = sorted(str(p) for p in Path(engines).rglob("*"))
    assert 5 not in tiny_cfg.graphs.k_values
    assert cli.main(["generate", "--config", str(profile), "--prompt", "hi", "--k", "5", "--json"]) == 2
    err = capsys.readouterr().err
    job = Job(request=GenerateRequest(prompt="hi", k=5))
    scheduler = Scheduler(tiny_engine, tiny_engine.cfg, logging.getLogger("test"), thread=False)
    assert not scheduler.submit(job) and job.outcome.refusal == "invalid"
    assert err.splitlines()[-1] == f"spec-edge: error: {job.outcome.message}"
    assert "`spec-edge export --k-values 1 3 4 5 7`" in err
    assert sorted(str(p) for p in Path(engines).rglob("*")) == before  # no graph made
