"""The k choice: expected tokens per verify, the cost model per occupancy, the picked k, the k per load."""
from __future__ import annotations

import pytest

from spec_edge.device import projection
from spec_edge.tools import tune


def test_geometric_expected_tokens():  # one acceptance rate at every position (device/projection.py)
    assert projection.expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert projection.expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert projection.expected_tokens(0.75, 4) == pytest.approx(1 + 0.75 + 0.75**2 + 0.75**3 + 0.75**4)


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


def test_table_from_totals():
    # k where the measured speculative total was at least plain's, else 0; between depths the one below
    per_depth = {1: (30, 60), 2: (40, 45), 4: (45, 40), 8: (46, 48)}
    assert tune.table_from_totals(per_depth, 4, 8) == [4, 4, 4, 0, 0, 0, 0, 4]
    assert tune.table_from_totals({1: (30, 25)}, 4, 3) == [0, 0, 0]
    assert tune.table_from_totals({2: (30, 35)}, 2, 2) == [2, 2]  # below every depth: the shallowest


def test_rate_model_per_occupancy():
    # c(j, w) = 10 ms + 2 ms per row and token: a fixed part (the weights) and a part per row
    costs = {(j, w): 10.0 + 2.0 * j * w for j in range(1, 9) for w in (1, 3, 5)}
    p = [0.8, 0.6, 0.45, 0.3]
    # every slot drafts (v = 1): one verify call of n rows
    e4 = tune.expected_tokens(p, 4)
    assert tune.rate(costs, 4, 4, 1, p, 1.0) == pytest.approx(1000 * 4 * e4 / costs[(4, 5)])
    assert tune.rate(costs, 4, 0, 1, p, 0.3) == pytest.approx(1000 * 4 / costs[(4, 1)])
    # no slot drafts (v = 0): plain steps only, whatever k
    assert tune.rate(costs, 3, 4, 1, p, 0.0) == pytest.approx(tune.rate(costs, 3, 0, 1, p, 0.0))
    # one slot, half its iterations draft: (E + 1) / 2 tokens per (c_v + c_s) / 2 ms
    assert tune.rate(costs, 1, 2, 1, p, 0.5) == pytest.approx(
        1000 * (tune.expected_tokens(p, 2) + 1) / (costs[(1, 3)] + costs[(1, 1)]))
    # a draft call of 3 ms: every drafting slot pays k of them
    assert tune.rate(costs, 2, 2, 1, p, 1.0, draft_ms=3.0) == pytest.approx(
        1000 * 2 * tune.expected_tokens(p, 2) / (costs[(2, 3)] + 2 * 2 * 3.0))
    # rows get dearer with the width: k steps back as the slots fill, to none
    table, rates = tune.k_table(costs, range(1, 9), [2, 4], 1, p, 0.9)
    assert table == [4, 2, 2, 2, 2, 2, 0, 0]
    assert all(rates[n][table[n - 1]] == max(rates[n].values()) for n in range(1, 9))


def test_one_request_curve_is_the_one_slot_rate():
    verify = {k: 31.0 + 3.0 * k for k in (2, 4)}
    p = [0.8, 0.6, 0.45, 0.3]
    curve = tune.k_curve(25.0, verify, p, [2, 3, 4], draft_ms=1.5, n_verify=30, n_step=10)
    costs = {(1, 1): 25.0, (1, 3): 37.0, (1, 4): 40.0, (1, 5): 43.0}  # verify[4]: the line through k = 2, 4
    assert curve.tokens_per_s == pytest.approx([tune.rate(costs, 1, k, 1, p, 0.75, 1.5) for k in (0, 2, 3, 4)])


def test_load_n_runs_min_n_slots():
    assert tune.table_for_loads([4, 2, 0], 6) == [4, 2, 0, 0, 0, 0]
    assert tune.table_for_loads([3], 8) == [3] * 8  # one slot: the queue changes neither rate
    assert tune.table_for_loads([4, 2, 2, 0], 2) == [4, 2]


def _tune(tiny_cfg, tmp_path, *extra, ks=("1", "3")):
    import argparse

    from spec_edge import config as cfgmod

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Repeat: the arm moves left, the arm moves right, the arm moves left\nName a colour\n")
    parser = argparse.ArgumentParser()
    tune.add_args(parser)
    out = tmp_path / "tuned.yaml"
    args = parser.parse_args(["--prompts", str(prompts), "--drafter", "ngram", "--ks", *ks,
                              "--max-new-tokens", "8", "--rounds", "2", "--out", str(out),
                              "--plot", str(tmp_path / "curve.png"), *extra])
    assert tune.main(tiny_cfg, args, progress=lambda message: None) == 0
    return cfgmod.load(out), out.read_text()


def test_tune_writes_the_one_slot_table(tiny_cfg, tmp_path, capsys):
    # one slot serves one request at a time: every load takes the one-request curve's best k
    tuned, text = _tune(tiny_cfg, tmp_path)
    printed = capsys.readouterr().out
    best = tuned.speculative.k if tuned.speculative.drafter != "none" else 0
    want = [best] * (tiny_cfg.graphs.batch_slots + tiny_cfg.serve.queue_limit)  # one entry per load
    assert list(tuned.serve.speculate_k_by_load) == want
    assert f"serve.speculate_k_by_load = {want}" in printed and "load n runs min(n, 1) occupied slot(s)" in printed
    assert f"#| serve.speculate_k_by_load = {want}" in text


def test_tune_takes_the_table_from_concurrency_results(tiny_cfg, tmp_path, capsys):
    import json

    rows = [{"clients": n, "plain_total_tok_s": p, "spec_total_tok_s": s}
            for n, p, s in ((1, 30.0, 60.0), (2, 40.0, 45.0), (4, 45.0, 40.0))]
    results = tmp_path / "concurrency.json"
    results.write_text(json.dumps({"rows": rows, "k": 3}))
    tuned, _ = _tune(tiny_cfg, tmp_path, "--concurrency-json", str(results))
    assert list(tuned.serve.speculate_k_by_load) == [3, 3, 3] + [0] * 6 and tuned.speculative.k == 3
    assert "k=3 where speculation was at least as fast as plain" in capsys.readouterr().out


def test_tune_writes_the_batched_table(tiny_cfg, tmp_path, capsys):
    # 4 slots (test_batch's folder: exported once per session): one entry per load (occupied slots +
    # queued) from the measured (j rows, width) costs; a load past the slots runs all 4 of them
    from test_batch import batch_cfg

    cfg = batch_cfg(tiny_cfg)
    tuned, text = _tune(cfg, tmp_path, ks=("3",))
    table = list(tuned.serve.speculate_k_by_load)
    assert len(table) == 4 + cfg.serve.queue_limit and all(k in (0, 3) for k in table)
    assert table[4:] == [table[3]] * cfg.serve.queue_limit
    assert tuned.speculative.k == max(table) or tuned.speculative.drafter == "none"
    printed = capsys.readouterr().out
    assert "per requests in the engine: occupied slots + queued (graphs.batch_slots=4" in printed and "chosen k" in printed
    assert "#|   slots   step ms" in text
