"""serve.speculate_k_by_load through the node: with [4, 0] a request's iterations while others wait behind it
(load >= 2: requests in the engine, occupied slot + queue) are plain steps, and its stats say so; its text is
the solo (speculative) answer; a request alone speculates at k=4 and counts its verify calls by k; /diagnostics
carries the table. (Smaller k than speculative.k: the
tiny-model tests, test/test_speculation_load.py and test/test_batch.py, as the default graphs have k=4 only.)"""
from __future__ import annotations

import pytest

from rosutil import engine_request, run_client, test_params
from spec_edge.runtime.scheduler import run_one

pytestmark = pytest.mark.real_model("fp32")

PROMPTS = [f"Repeat exactly: robot {name} moves to the {place}. Robot {name} moves to the {place}."
           for name, place in (("A", "door"), ("B", "kitchen"), ("C", "window"), ("D", "table"), ("E", "lab"))]
MAX_NEW = 16


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(test_params(**{"serve.speculate_k_by_load": [4, 0]}))


def test_deep_queue_switches_speculation_off(server, module_env, reference_engine):
    assert reference_engine.cfg.serve.speculate_k_by_load == ()  # the oracle always speculates
    solo = [run_one(reference_engine, engine_request(prompt=p, max_new_tokens=MAX_NEW)) for p in PROMPTS]
    drafter = reference_engine.cfg.speculative.drafter
    assert drafter != "none" and all(s.stats.drafter == drafter for s in solo)

    answers = run_client(module_env, {"mode": "burst",
                                      "requests": [{"prompt": p, "max_new_tokens": MAX_NEW} for p in PROMPTS]})
    off, on = [], []
    for prompt, answer, want in zip(PROMPTS, answers, solo):
        assert answer is not None and answer["success"], answer
        stats = answer["stats"]
        assert answer["text"] == want.text, prompt
        assert answer["num_tokens"] == len(want.token_ids), prompt
        assert stats["queued_at_start"] >= 1
        assert stats["drafter"] == drafter and stats["k"] == 4 and len(stats["verify_calls_by_k"]) == 4, stats
        assert stats["verify_calls_by_k"][:3] == [0, 0, 0]  # every verify call at k=4 (the table: k=4 or none)
        if stats["policy_off_steps"]:  # it stepped while others waited
            assert "serve.speculate_k_by_load=[4, 0]" in stats["speculation_off_reason"]
            assert f"{stats['policy_off_steps']} plain steps without speculation" in stats["speculation_off_reason"]
            off.append(answer)
        else:
            assert stats["speculation_off_reason"] == "", stats
            on.append(answer)
    # the burst queues behind the first request, which steps without drafts while they wait; the last one
    # served runs with nobody behind it
    assert off, [a["stats"]["queued_at_start"] for a in answers]
    assert on or any(a["stats"]["verify_calls_by_k"][3] for a in off), [a["stats"] for a in answers]

    alone, = run_client(module_env, {"mode": "call", "requests": [{"prompt": PROMPTS[0], "max_new_tokens": MAX_NEW}]})
    assert alone["stats"]["queued_at_start"] == 1 and alone["stats"]["drafter"] == drafter
    assert alone["stats"]["verify_calls_by_k"] == [0, 0, 0, solo[0].stats.verify_calls]
    assert alone["text"] == solo[0].text

    status, = run_client(module_env, {"mode": "diagnostics"})
    values = status["values"]
    assert values["speculate_k_by_load"] == "[4, 0]" and values["speculation_policy"] == "load k=4 at 1, none from 2"
    assert "speculate_max_queue" not in values
    assert int(values["speculation_off"]) == len(off)
    assert values["last_drafter"] == drafter and values["last_speculation_off_reason"] == ""
