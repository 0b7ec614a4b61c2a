"""Speculative sampling keeps the target's distribution: chi-square tests with fixed seeds.

Threshold: the statistic must stay below the chi-square 0.999 quantile for its degrees of freedom
(Wilson-Hilferty approximation), so a correct implementation fails about once in a thousand seeds,
and these seeds are fixed. A wrong residual (e.g. resampling from p_target instead of
max(0, p - q)) or a wrong acceptance ratio moves the statistic far past it.
"""
from __future__ import annotations

import numpy as np
import pytest

from spec_edge import speculative
from spec_edge.backends.onnxruntime import OrtRunner
from spec_edge.drafters.draft_model import ModelDrafter
from spec_edge.engine import GenerateRequest
from spec_edge.sampling import SamplingParams, probabilities, speculative_accept
from spec_edge.speculative import Draft


def chi2_critical(df: int, z: float = 3.09) -> float:
    """0.999 quantile of chi-square(df), Wilson-Hilferty."""
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic against exact probabilities; cells expected < 5 are pooled."""
    big = [cell for cell, p in probs.items() if p * n >= 5]
    stat = sum((counts.get(cell, 0) - probs[cell] * n) ** 2 / (probs[cell] * n) for cell in big)
    rest_p = 1 - sum(probs[cell] for cell in big)
    rest_count = n - sum(counts.get(cell, 0) for cell in big)
    cells = len(big)
    if rest_p * n >= 1:
        stat += (rest_count - rest_p * n) ** 2 / (rest_p * n)
        cells += 1
    else:
        assert rest_count <= max(2, 5 * rest_p * n), "samples fell on cells of ~zero probability"
    return stat, cells - 1


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


def test_residual_matters():
    """The test above can fail: resampling from p_target itself (a classic bug) is detected."""
    rng = np.random.default_rng(0)
    vocab, n = 6, 20000
    p_target = rng.dirichlet(np.ones(vocab), size=2)
    q_draft = rng.dirichlet(np.ones(vocab) * 0.5, size=1)
    counts = {}
    for _ in range(n):
        draft = int(rng.choice(vocab, p=q_draft[0]))
        accept = rng.random() * q_draft[0, draft] < p_target[0, draft]
        out = draft if accept else int(rng.choice(vocab, p=p_target[0]))  # wrong: not the residual
        counts[out] = counts.get(out, 0) + 1
    stat, df = chi2_statistic(counts, dict(enumerate(p_target[0])), n)
    assert stat > chi2_critical(df)


class GreedySelfDrafter(ModelDrafter):
    """Deterministic drafts (the target's own argmax): the one-hot q path of the loop."""

    def propose(self, seq, k, sampler):
        greedy = speculative.Sampler(SamplingParams())
        draft = super().propose(seq, k, greedy)
        return None if draft is None else Draft(tokens=draft.tokens, q_draft=None)


@pytest.mark.parametrize("drafter_name", ["draft", "self", "greedy-self"])
def test_generated_tokens_follow_target_distribution(tiny_engine, drafter_name):
    """Exact distribution of the first three sampled tokens (27 cells at top_k=3), computed from the
    target's own graphs, vs speculative sampling through the real loop and ONNX Runtime."""
    params = SamplingParams(temperature=1.0, top_k=3)
    runner = OrtRunner(tiny_engine.graph_dir)
    prompt_ids = tiny_engine.prompt_ids(GenerateRequest(prompt="Move the arm"))
    pos = len(prompt_ids)
    p1 = probabilities(runner.prefill(prompt_ids, 0)[None], params)[0]
    exact = {}
    for t1 in np.flatnonzero(p1):
        p2 = probabilities(runner.forward([int(t1)], pos), params)[0]
        for t2 in np.flatnonzero(p2):
            p3 = probabilities(runner.forward([int(t2)], pos + 1), params)[0]
            for t3 in np.flatnonzero(p3):
                exact[(int(t1), int(t2), int(t3))] = p1[t1] * p2[t2] * p3[t3]
    assert abs(sum(exact.values()) - 1) < 1e-6
    # draft: another model, q != p (mostly rejections: the residual path); self: q == p (accepts);
    # greedy-self: deterministic drafts, the one-hot q path
    drafter = {"draft": lambda: tiny_engine._drafter("draft"),
               "self": lambda: ModelDrafter(OrtRunner(tiny_engine.graph_dir)),
               "greedy-self": lambda: GreedySelfDrafter(OrtRunner(tiny_engine.graph_dir))}[drafter_name]()
    n = 1200
    counts: dict = {}
    accepted = drafted = 0
    for seed in range(n):
        ids, _, stats = speculative.generate(tiny_engine.target, prompt_ids, max_new_tokens=3, eos_ids=(),
                                             sampling=params, seed=seed, drafter=drafter, k=3)
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        accepted += stats.accepted
        drafted += stats.drafted
    assert drafted > 0  # speculation really happened
    if drafter_name != "draft":
        assert accepted > 0
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df, sorted(counts.items(), key=lambda kv: -kv[1])[:5])


def test_seed_makes_sampling_reproducible(tiny_engine):
    request = GenerateRequest(prompt="Move the arm", temperature=0.8, top_p=0.9, seed=7, max_new_tokens=20)
    first = tiny_engine.generate(request)
    assert tiny_engine.generate(request).token_ids == first.token_ids


def test_top_p_and_top_k_restrict_support():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]]))
    assert np.count_nonzero(probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))) == 2
    assert np.count_nonzero(probabilities(logits, SamplingParams(temperature=1.0, top_k=3))) == 3
    assert np.allclose(probabilities(logits, SamplingParams(temperature=1.0))[0], [0.5, 0.3, 0.15, 0.05])
