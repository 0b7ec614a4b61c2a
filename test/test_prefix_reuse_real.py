"""Prefix reuse on the embedded default (fused-attention fp32 graphs, one slot; two): a dialog
over two system prompts, each turn answered with the cache the previous turn left (the suffix
prefilled from another position, so other chunk bounds) and cold, token for token; a difference is
accepted only at a near-tie of the cold run (near_ties.py: top-2 margin < 0.05)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from near_ties import assert_same_but_near_ties
from tiny import serve_together, warm

from spec_edge.runtime.serving import front_of
from spec_edge.config import Config
from spec_edge import artifacts
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model("fp32", "fp32-b2")
SYSTEMS = ["You control RB-7, a mobile robot with a 6-axis arm and a gripper (payload 2 kg). Tools: move_base(x, y), "
           "move_arm(x, y, z), open_gripper(width), close_gripper(force), read_battery(), dock(). Never move the "
           "arm while a person is within one metre. Answer briefly.",
           "You are a warehouse assistant. Shelves A1 to A4 hold medical supplies, B1 to B4 cleaning supplies. "
           "Reply with one line."]
TURNS = ["Which tool checks the battery?", "Pick up the gauze from shelf A2.", "Now drive to the dock."]


@pytest.fixture(scope="module")
def engine():
    cfg = Config().replace(**{"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32",
                              "graphs.batch_slots": 1})
    return artifacts.engine(cfg, progress=lambda m: print(m, file=sys.stderr))


def answer(engine, reuse: bool, request: GenerateRequest):
    engine.loop.reuse = reuse  # serve.reuse_prefix, as the loop holds it
    return run_one(engine, request)


@pytest.mark.parametrize("system", SYSTEMS)
def test_dialog_reused_equals_cold(engine, system):
    history = (("system", system),)
    engine.loop.reuse = True
    warm(engine, system)  # the first turn reuses the system prompt too
    for turn in TURNS:
        request = GenerateRequest(messages=history + (("user", turn),), max_new_tokens=16)
        reused = answer(engine, True, request)
        cold = answer(engine, False, request)
        assert cold.stats.prompt_tokens_reused == 0
        assert reused.stats.prompt_tokens_reused > len(engine.tokenizer.encode(system))
        prompt = front_of(engine).prompt_ids(request)
        try:
            assert_same_but_near_ties(reused.token_ids, cold.token_ids, engine.target, prompt)
        finally:
            engine.target.held = ()  # the rule's reference prefill rewrote the cache
        history = request.messages + (("assistant", cold.text),)
        answer(engine, True, request)  # the next turn reuses a reused run's rows, not the cold run's


@pytest.fixture(scope="module")
def batch_engine():
    """The batched engine (graphs.batch_slots 2: per-slot prefix reuse) over the same fp32 graphs."""
    cfg = Config().replace(**{"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32",
                              "graphs.batch_slots": 2})
    return artifacts.engine(cfg, progress=lambda m: print(m, file=sys.stderr))


def test_batched_dialogs_reused_equal_cold(engine, batch_engine):
    """Two dialogs at once through the batched engine, each turn of each in the slot holding its
    history (the system prompt warmed into both slots first): every answer == the cold B=1 answer
    (whose rows the batched graphs equal bit for bit) but at a near tie of the cold run."""
    histories = [(("system", system),) for system in SYSTEMS]
    warm(batch_engine, SYSTEMS[0])
    for t, turn in enumerate(TURNS):
        requests = [GenerateRequest(messages=history + (("user", turn),), max_new_tokens=16) for history in histories]
        results = serve_together(batch_engine, requests)
        for i, request in enumerate(requests):
            # dialog i's history lives in slot i (the warmed prefix: the tie goes to slot 0)
            prompt = front_of(batch_engine).prompt_ids(request)
            assert batch_engine.runner.held[i][:len(prompt)] == tuple(prompt)
            if t > 0 or i == 0:
                assert results[i].stats.prompt_tokens_reused > len(engine.tokenizer.encode(SYSTEMS[i]))
            cold = answer(engine, False, request)
            try:
                assert_same_but_near_ties(results[i].token_ids, cold.token_ids, engine.target,
                                          front_of(engine).prompt_ids(request))
            finally:
                engine.target.held = ()  # the rule's reference prefill rewrote the cache
            histories[i] = request.messages + (("assistant", results[i].text),)


def test_near_tie_rule_fails_on_a_real_difference():
    """The rule above must be able to fail: a divergence where the reference is sure."""
    import numpy as np

    class Sure:
        def prefill(self, tokens, position):
            row = np.zeros(8, np.float32)
            row[3] = 5.0  # margin 5
            return row

    class Tied(Sure):
        def prefill(self, tokens, position):
            row = super().prefill(tokens, position)
            row[4] = 4.99  # margin 0.01
            return row

    assert_same_but_near_ties([1, 2, 3], [1, 2, 3], Sure(), [0])
    assert_same_but_near_ties([1, 2, 4, 7], [1, 2, 3, 3], Tied(), [0])
    with pytest.raises(AssertionError, match="token 2 .* margin is 5.000"):
        assert_same_but_near_ties([1, 2, 4], [1, 2, 3], Sure(), [0])
