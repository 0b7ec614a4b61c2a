"""serve.speculate_k_by_load, Edge-LLM's load policy (speculation_policy.py: the k per load, its config checks, its
reasons in words; the Edge-LLM engine under it: test_edgellm_runtime.py), refused on ONNX Runtime, where
speculative.k auto is the one way k is chosen; the reasons a request ran below its k under auto."""
from __future__ import annotations

import pytest

from spec_edge import speculation_policy as policy
from spec_edge.config import Config, ConfigError, from_params
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from test_request_fields import PENALTIES


def drafted_fields(engine, prompt: str) -> dict:
    """Request fields under which both tiny drafters' drafts are accepted on prompt: the target-only output's
    first token favoured with penalties (test_request_fields.PENALTIES): prompt lookup drafts its repeats, the
    random draft model agrees with them now and then."""
    favoured = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=1, speculate=False)).token_ids[0]
    params = PENALTIES(favoured)
    return dict(prompt=prompt, max_new_tokens=24, logit_bias=params.logit_bias,
                repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty)


def test_k_at_load():
    table = [4, 3, 1, 0]
    assert [policy.k_at(table, n, 4) for n in range(1, 7)] == [4, 3, 1, 0, 0, 0]  # the last entry holds
    assert [policy.k_at(table, n, 3) for n in (1, 2, 3)] == [3, 3, 1]  # a cap on the request's own k
    assert policy.k_at([], 50, 4) == 4 and policy.k_at(table, 1, 0) == 0  # [] = always k; k 0 stays 0
    assert policy.from_max_queue(0, 4) == [] and policy.from_max_queue(2, 4) == [4, 4, 0]
    assert policy.describe([4, 4, 2, 0]) == "load k=4 at 1-2, k=2 at 3, none from 4"


def test_reason():
    from spec_edge.runtime.stats import Stats

    def stats(k, by_k, off=0):
        return Stats(k=k, verify_calls_by_k=by_k, policy_off_steps=off)

    assert policy.reason(stats(4, [0, 0, 0, 5]), [4]) == ""  # every verify call at its k
    assert policy.reason(stats(0, [], 0), [4, 0]) == ""  # it did not ask to speculate
    off = policy.reason(stats(4, [0, 0, 0, 0], 9), [4, 2, 0])
    assert "speculate_k_by_load=[4, 2, 0]" in off and "9 plain steps without speculation" in off and "asked k=4" in off
    fewer = policy.reason(stats(4, [0, 3, 0, 2]), [4, 2, 0])
    assert "3 verify calls at k=2" in fewer and "2 verify calls at k=4" in fewer


EDGE = {"runtime.backend": "tensorrt", "graphs.weights": "fp32", "graphs.dtype": "float16", "speculative.drafter": "none"}


@pytest.mark.parametrize("params,message", [
    ({**EDGE, "serve.speculate_k_by_load": [4, 3]}, r"\[1\] = 3 \(load 2\) has no verify graph"),
    ({**EDGE, "serve.speculate_k_by_load": [4, -1]}, r"\[1\] = -1"),
    ({**EDGE, "serve.speculate_k_by_load": [4] * 10, "graphs.batch_slots": 1},
     r"10 entries, one per load, .* graphs.batch_slots=1 \+ serve.queue_limit=8: drop the last 1"),
    ({**EDGE, "serve.speculate_k_by_load": [4] * 13, "graphs.batch_slots": 4}, r"batch_slots=4 \+ serve.queue_limit=8"),
    ({"serve.speculate_k_by_load": [4, 0]}, r"is for runtime.backend tensorrt .* speculative.k: auto chooses"),
    ({"serve.speculate_max_queue": 2}, r"speculate_max_queue is gone.*serve.speculate_k_by_load: \[4, 4, 0\]"),
    ({"serve.speculate_max_queue": 0}, r"speculate_max_queue: 0 is serve.speculate_k_by_load: \[\]"),
])
def test_config_refuses(params, message):
    with pytest.raises(ConfigError, match=message):
        from_params(params)


def test_config_accepts():
    cfg = from_params({**EDGE, "graphs.k_values": [2, 4], "serve.speculate_k_by_load": [4, 4, 2, 0, 0, 0, 0, 0]})
    assert cfg.serve.speculate_k_by_load == (4, 4, 2, 0, 0, 0, 0, 0)
    assert from_params({**EDGE, "graphs.k_values": [4, 7], "serve.speculate_k_by_load": [7, 4]})
    assert Config().serve.speculate_k_by_load == ()


def test_default_never_switches_off(tiny_engine):
    assert tiny_engine.cfg.serve.speculate_k_by_load == ()
    result = run_one(tiny_engine, GenerateRequest(prompt="Move the arm", max_new_tokens=4, drafter="ngram"), queued=8)
    assert result.stats.drafter == "ngram" and result.stats.k == 4 and result.speculation_off_reason == ""


def test_reason_under_auto():
    from spec_edge.runtime.k_choice import KChoice
    from spec_edge.runtime.stats import Stats

    choice = KChoice((2, 4))
    choice.probes, choice.why = 3, "plain decoding expected fastest (...)"
    text = policy.reason(Stats(k=4, verify_calls_by_k=[0, 2, 0, 1], auto_off_steps=40), [], choice)
    assert text.startswith("speculative.k auto (up to k=4): 2 verify calls at k=2, 1 verify calls at k=4, 40 plain "
                           "steps where plain decoding was expected faster (3 probes); last choice: plain decoding")
    assert policy.reason(Stats(k=4, verify_calls_by_k=[0, 0, 0, 9]), [], choice) == ""  # always at its k
