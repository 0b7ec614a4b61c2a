"""Speculative sampling keeps the target's distribution: chi-square tests with fixed seeds.

Threshold: the statistic must stay below the chi-square 0.999 quantile for its degrees of freedom
(Wilson-Hilferty approximation), so a correct implementation fails about once in a thousand seeds,
and these seeds are fixed. A wrong residual (e.g. resampling from p_target instead of
max(0, p - q)), a wrong acceptance ratio or a bonus token drawn from the wrong row moves the statistic
far past it: test_mutations.py runs these tests with each of those rules broken in the product.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.runtime.backends.ort_runner import b1_runner
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.sampling import Sampler, SamplingParams, probabilities, speculative_accept
from spec_edge.runtime.scheduler import run_one
from tiny import assert_sampling_follows_target, chi2_critical, chi2_statistic


def test_acceptance_rule_preserves_p_target():
    rng = np.random.default_rng(0)
    vocab, n = 6, 20000
    p_target = rng.dirichlet(np.ones(vocab), size=2)    # (k+1, V), k=1
    q_draft = rng.dirichlet(np.ones(vocab) * 0.5, size=1)  # (k, V)
    first = {}
    for _ in range(n):
        draft = int(rng.choice(vocab, p=q_draft[0]))
        n_accepted, token = speculative_accept(p_target, q_draft, [draft], rng)
        out = draft if n_accepted == 1 else token
        first[out] = first.get(out, 0) + 1
    stat, df = chi2_statistic(first, dict(enumerate(p_target[0])), n)
    assert stat < chi2_critical(df), (stat, df)


def test_one_hot_draft_preserves_p_target():
    rng = np.random.default_rng(1)
    vocab, n = 5, 20000
    p_target = rng.dirichlet(np.ones(vocab), size=2)
    counts = {}
    for _ in range(n):
        n_accepted, token = speculative_accept(p_target, None, [2], rng)  # always proposes token 2
        out = 2 if n_accepted == 1 else token
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi2_statistic(counts, dict(enumerate(p_target[0])), n)
    assert stat < chi2_critical(df), (stat, df)


def test_every_draft_accepted_draws_the_bonus_from_row_k():
    """q == p: every draft is accepted (p_x / q_x = 1), and the bonus token follows the last row p_target[k]."""
    rng = np.random.default_rng(2)
    vocab, n, k = 6, 20000, 2
    p_target = rng.dirichlet(np.ones(vocab), size=k + 1)  # (k+1, V): three different rows
    counts = {}
    for _ in range(n):
        drafts = [int(rng.choice(vocab, p=p_target[i])) for i in range(k)]
        n_accepted, token = speculative_accept(p_target, p_target[:k], drafts, rng)
        assert n_accepted == k
        counts[token] = counts.get(token, 0) + 1
    stat, df = chi2_statistic(counts, dict(enumerate(p_target[k])), n)
    assert stat < chi2_critical(df), (stat, df)


class GreedySelfDrafter(ModelDrafter):
    """Deterministic drafts (the target's own argmax): the one-hot q path of the loop."""

    def propose(self, seq, k, sampler):
        greedy = Sampler(SamplingParams())
        draft = super().propose(seq, k, greedy)
        return None if draft is None else Draft(tokens=draft.tokens, q_draft=None)


class TemperedSelfDrafter(ModelDrafter):
    """The target drafting for itself at a lower temperature (T=0.6, top-k 2) than the request's (T=2.5):
    q overlaps p but is sharper, so its top token is often rejected and the residual max(0, p - q) puts the
    correction on the others (resampling from p instead moves a quarter of that mass back to the top token).
    Its draws come from the request's own random stream."""

    def __init__(self, runner):
        super().__init__(runner, name="tempered-self")
        self.params = SamplingParams(temperature=0.6, top_k=2)

    def propose(self, seq, k, sampler):
        own = Sampler(self.params)
        own.rng = sampler.rng
        return super().propose(seq, k, own)


DRAFTERS = {  # name -> (drafter over the tiny engine, must it get drafts accepted, the request's sampling)
    "draft": (lambda engine: engine.drafter("draft"), False, None),  # another model: q far from p (rejections)
    "self": (lambda engine: ModelDrafter(b1_runner(engine.graph_dir)), True, None),  # q == p: accepts + bonus
    "tempered-self": (lambda engine: TemperedSelfDrafter(b1_runner(engine.graph_dir)), True,  # the residual
                      SamplingParams(temperature=2.5, top_k=2)),
    "greedy-self": (lambda engine: GreedySelfDrafter(b1_runner(engine.graph_dir)), True, None),  # one-hot q
}


@pytest.mark.parametrize("drafter_name", list(DRAFTERS))
def test_generated_tokens_follow_target_distribution(tiny_engine, drafter_name, n=1200):
    """Exact distribution of the first five sampled tokens (32 cells at top_k=2, k=3: a fully accepted
    window's bonus token is among them), computed from the target's own graphs, vs n seeded runs of
    speculative sampling through the real loop and ONNX Runtime (test_mutations.LOOP runs it with fewer)."""
    make, must_accept, params = DRAFTERS[drafter_name]
    assert_sampling_follows_target(tiny_engine, make(tiny_engine), must_accept=must_accept, params=params, n=n)


@pytest.mark.parametrize("drafter_name", ["draft", "greedy-self"])
def test_processed_distribution_is_kept(tiny_engine, drafter_name):
    """With min_p, the three penalties and a logit bias on, the first three sampled tokens (k=1: the bonus token
    of an accepted draft among them) follow the processed
    target distribution (each row processed with its own history, drafts included) exactly."""
    third = int(np.argsort(-b1_runner(tiny_engine.graph_dir).prefill(
        front_of(tiny_engine).prompt_ids(GenerateRequest(prompt="Move the arm")), 0))[2])
    # 33 cells (14 expected >= 5 times): min_p cuts some of top_k's 5, the bias lifts the third
    params = SamplingParams(temperature=2.0, top_k=5, min_p=0.06, repetition_penalty=1.1, presence_penalty=0.5,
                            frequency_penalty=0.7, logit_bias=((third, 1.0),))
    drafter = {"draft": lambda: tiny_engine.drafter("draft"),
               "greedy-self": lambda: GreedySelfDrafter(b1_runner(tiny_engine.graph_dir))}[drafter_name]()
    assert_sampling_follows_target(tiny_engine, drafter, must_accept=drafter_name != "draft", n=800, params=params,
                                   k=1, length=3)  # k + 2 tokens: the bonus of an accepted draft among them


def test_seed_makes_sampling_reproducible(tiny_engine):
    request = GenerateRequest(prompt="Move the arm", temperature=0.8, top_p=0.9, seed=7, max_new_tokens=20)
    first = run_one(tiny_engine, request)
    assert run_one(tiny_engine, request).token_ids == first.token_ids


def test_top_p_and_top_k_restrict_support():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.count_nonzero(probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))) == 2
    assert np.count_nonzero(probabilities(logits, SamplingParams(temperature=1.0, top_k=3))) == 3
    assert np.allclose(probabilities(logits, SamplingParams(temperature=1.0))[0], [0.5, 0.3, 0.15, 0.05])


def test_temperature_divides_the_logits():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    want = np.sqrt([0.5, 0.3, 0.15, 0.05])  # softmax(log p / 2) is proportional to sqrt(p)
    np.testing.assert_allclose(probabilities(logits, SamplingParams(temperature=2.0))[0], want / want.sum())
