"""The k choice: expected tokens per verify, the cost model, the picked k, the queue-depth rule."""
from __future__ import annotations

import pytest

from spec_edge.tools import tune


def test_geometric_expected_tokens():
    assert tune.expected_tokens_geometric(0.0, 4) == pytest.approx(1.0)
    assert tune.expected_tokens_geometric(1.0, 4) == pytest.approx(5.0)
    assert tune.expected_tokens_geometric(0.75, 4) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**4)


def test_measured_positions_and_extrapolation():
    p = [0.8, 0.6, 0.45]
    assert tune.expected_tokens(p, 2) == pytest.approx(2.4)
    assert tune.expected_tokens(p, 3) == pytest.approx(2.85)
    # beyond the measured positions: the last conditional rate 0.45 / 0.6 = 0.75 continues
    assert tune.expected_tokens(p, 4) == pytest.approx(2.85 + 0.45 * 0.75)
    assert tune.expected_tokens([], 3) == pytest.approx(1.0)


def test_verify_cost_interpolates_linearly():
    costs = {2: 30.0, 4: 40.0}
    assert tune.verify_cost(costs, 4) == 40.0
    assert tune.verify_cost(costs, 3) == pytest.approx(35.0)
    assert tune.verify_cost(costs, 6) == pytest.approx(50.0)
    assert tune.verify_cost({4: 37.0}, 7) == 37.0


def test_best_k_balances_acceptance_and_cost():
    # step 25 ms, verify grows 3 ms per extra token; acceptance 0.9 per position: deep k pays
    verify = {k: 31.0 + 3.0 * k for k in range(1, 9)}
    high = tune.k_curve(25.0, verify, [0.9 ** i for i in range(1, 9)], list(range(1, 9)))
    assert high.best_k >= 6
    # acceptance 0.3: the first draft barely pays, longer drafts cost more than they bring
    low = tune.k_curve(25.0, verify, [0.3 ** i for i in range(1, 9)], list(range(1, 9)))
    assert low.best_k in (0, 1)
    # acceptance 0: never speculate
    none = tune.k_curve(25.0, verify, [0.0] * 8, list(range(1, 9)))
    assert none.best_k == 0 and none.speedup[0] == pytest.approx(1.0)


def test_plain_steps_share_dilutes_the_gain():
    verify = {4: 37.0}
    only = tune.k_curve(25.0, verify, [0.9, 0.8, 0.7, 0.6], [4], n_verify=10, n_step=0)
    mixed = tune.k_curve(25.0, verify, [0.9, 0.8, 0.7, 0.6], [4], n_verify=10, n_step=90)
    assert only.speedup[1] > mixed.speedup[1] > 1.0


def test_draft_cost_moves_k_down():
    verify = {k: 31.0 + 3.0 * k for k in range(1, 9)}
    p = [0.8 ** i for i in range(1, 9)]
    free = tune.k_curve(25.0, verify, p, list(range(1, 9)), draft_ms=0.0)
    dear = tune.k_curve(25.0, verify, p, list(range(1, 9)), draft_ms=8.0)
    assert dear.best_k < free.best_k


def test_speculate_max_queue():
    assert tune.speculate_max_queue({1: (30, 60), 2: (40, 70), 4: (45, 50)}) == 0   # always pays
    assert tune.speculate_max_queue({1: (30, 60), 2: (40, 45), 4: (45, 40), 8: (46, 38)}) == 2
    assert tune.speculate_max_queue({1: (30, 25)}) == 1


def test_queue_rule_says_why():
    value, why = tune.queue_rule({1: (30.0, 60.0)})
    assert value == 0 and "one request at a time" in why and "never" in why
    value, why = tune.queue_rule({1: (30.0, 25.0)})
    assert value == 1 and "alone" in why
    value, why = tune.queue_rule({1: (30, 60), 2: (40, 45), 4: (45, 40)})
    assert value == 2 and "at 4 requests" in why


def _tune(tiny_cfg, tmp_path, *extra):
    import argparse

    from spec_edge import config as cfgmod

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Repeat: the arm moves left, the arm moves right, the arm moves left\nName a colour\n")
    parser = argparse.ArgumentParser()
    tune.add_args(parser)
    out = tmp_path / "tuned.yaml"
    args = parser.parse_args(["--prompts", str(prompts), "--drafter", "ngram", "--ks", "1", "3",
                              "--max-new-tokens", "8", "--rounds", "2", "--out", str(out),
                              "--plot", str(tmp_path / "curve.png"), *extra])
    assert tune.main(tiny_cfg, args, progress=lambda message: None) == 0
    return cfgmod.load(out), out.read_text()


def test_tune_writes_speculate_max_queue(tiny_cfg, tmp_path, capsys):
    # from this run's one-request curve: never switch off when the chosen k beats plain, else 1
    tuned, text = _tune(tiny_cfg, tmp_path)
    printed = capsys.readouterr().out
    want = 0 if tuned.speculative.drafter != "none" else 1
    assert tuned.serve.speculate_max_queue == want
    assert f"serve.speculate_max_queue = {want}:" in printed
    assert f"#| serve.speculate_max_queue = {want}:" in text


def test_tune_takes_speculate_max_queue_from_concurrency_results(tiny_cfg, tmp_path, capsys):
    import json

    rows = [{"clients": n, "plain_total_tok_s": p, "spec_total_tok_s": s}
            for n, p, s in ((1, 30.0, 60.0), (2, 40.0, 45.0), (4, 45.0, 40.0))]
    results = tmp_path / "concurrency.json"
    results.write_text(json.dumps({"rows": rows}))
    tuned, _ = _tune(tiny_cfg, tmp_path, "--concurrency-json", str(results))
    assert tuned.serve.speculate_max_queue == 2
    assert "serve.speculate_max_queue = 2: speculation stopped paying at 4" in capsys.readouterr().out
