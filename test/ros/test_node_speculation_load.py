"""serve.speculate_max_queue through the node: requests that start behind a deep queue run target-only
and say so in their stats; their text is the solo (speculative) answer; a request started alone speculates."""
from __future__ import annotations

import pytest

from rosutil import engine_request, run_client, test_params

PROMPTS = [f"Repeat exactly: robot {name} moves to the {place}. Robot {name} moves to the {place}."
           for name, place in (("A", "door"), ("B", "kitchen"), ("C", "window"), ("D", "table"), ("E", "lab"))]
MAX_NEW = 16


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(test_params(**{"serve.speculate_max_queue": 1}))


def test_deep_queue_switches_speculation_off(server, module_env, reference_engine):
    assert reference_engine.cfg.serve.speculate_max_queue == 0  # the oracle always speculates
    solo = [reference_engine.generate(engine_request(prompt=p, max_new_tokens=MAX_NEW)) for p in PROMPTS]
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
        if stats["queued_at_start"] > 1:
            assert stats["drafter"] == "none" and stats["drafted"] == 0, stats
            assert f"{stats['queued_at_start']} requests queued" in stats["speculation_off_reason"]
            assert "serve.speculate_max_queue=1" in stats["speculation_off_reason"]
            off.append(answer)
        else:
            assert stats["drafter"] == drafter and stats["speculation_off_reason"] == "", stats
            on.append(answer)
    # the burst queues behind the first request; the last one served starts with nobody behind it
    assert off, [a["stats"]["queued_at_start"] for a in answers]
    assert on, [a["stats"]["queued_at_start"] for a in answers]

    alone, = run_client(module_env, {"mode": "call", "requests": [{"prompt": PROMPTS[0], "max_new_tokens": MAX_NEW}]})
    assert alone["stats"]["queued_at_start"] == 1 and alone["stats"]["drafter"] == drafter
    assert alone["text"] == solo[0].text

    status, = run_client(module_env, {"mode": "diagnostics"})
    values = status["values"]
    assert values["speculate_max_queue"] == "1"
    assert int(values["speculation_off"]) == len(off)
    assert values["last_drafter"] == drafter and values["last_speculation_off_reason"] == ""
