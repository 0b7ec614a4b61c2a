"""serve.speculate_k_by_load: the k per load (speculation_policy.py), its config checks, and the engine
under it: a smaller k or target-only as the load (occupied slots + queued) grows, the same greedy output."""
from __future__ import annotations

import pytest

from spec_edge import speculation_policy as policy
from spec_edge.config import Config, ConfigError, from_params
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from test_request_fields import PENALTIES

PROMPT = "Move the arm to the left and back, the arm to the left and back"


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


@pytest.mark.parametrize("params,message", [
    ({"serve.speculate_k_by_load": [4, 3]}, r"\[1\] = 3 \(load 2\) has no verify graph"),
    ({"serve.speculate_k_by_load": [4, -1]}, r"\[1\] = -1"),
    ({"serve.speculate_k_by_load": [4] * 10, "graphs.batch_slots": 1},
     r"10 entries, one per load, .* graphs.batch_slots=1 \+ serve.queue_limit=8: drop the last 1"),
    ({"serve.speculate_k_by_load": [4] * 13, "graphs.batch_slots": 4}, r"batch_slots=4 \+ serve.queue_limit=8"),
    ({"serve.speculate_max_queue": 2}, r"speculate_max_queue is gone.*serve.speculate_k_by_load: \[4, 4, 0\]"),
    ({"serve.speculate_max_queue": 0}, r"speculate_max_queue: 0 is serve.speculate_k_by_load: \[\]"),
])
def test_config_refuses(params, message):
    with pytest.raises(ConfigError, match=message):
        from_params(params)


def test_config_accepts():
    cfg = Config().replace(**{"graphs.k_values": [2, 4], "serve.speculate_k_by_load": [4, 4, 2, 0, 0, 0, 0, 0]})
    assert cfg.serve.speculate_k_by_load == (4, 4, 2, 0, 0, 0, 0, 0)
    # an entry above speculative.k applies to requests that ask for that k (any batch_slots)
    assert Config().replace(**{"graphs.k_values": [4, 7], "serve.speculate_k_by_load": [7, 4]})
    assert Config().replace(**{"graphs.k_values": [2, 4], "speculative.k": 2, "graphs.batch_slots": 4,
                               "serve.speculate_k_by_load": [4, 2]})
    assert Config().serve.speculate_k_by_load == ()


def _engine(tiny_engine, table) -> Engine:
    return Engine(tiny_engine.cfg.replace(**{"serve.speculate_k_by_load": table}), tiny_engine.runner,
                  tiny_engine.targets, tiny_engine.tokenizer, tiny_engine.graph_dir, progress=lambda message: None)


@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_every_k_the_policy_picks_gives_the_same_greedy_output(tiny_engine, drafter):
    engine = _engine(tiny_engine, [4, 3, 1, 0])  # tiny k_values [1, 3, 4, 7]
    fields = drafted_fields(tiny_engine, PROMPT)
    request = GenerateRequest(**fields, drafter=drafter, k=4)
    plain = run_one(engine, GenerateRequest(**fields, speculate=False))
    for queued, k in ((1, 4), (2, 3), (3, 1), (4, 0), (9, 0)):  # the load stays `queued` for the whole run
        result = run_one(engine, request, queued=queued)
        stats = result.stats
        assert result.token_ids == plain.token_ids and result.text == plain.text, (queued, k)
        assert result.queued_at_start == queued and stats.k == 4 and stats.drafter == drafter
        assert len(stats.verify_calls_by_k) == len(stats.accepted_at) == 4
        assert sum(stats.verify_calls_by_k) == stats.verify_calls  # all at the policy's k
        if k:
            assert stats.verify_calls_by_k[k - 1] == stats.verify_calls and stats.policy_off_steps == 0
            assert_speculated(stats, what=f"{drafter} queued={queued} k={k}")
        else:
            assert stats.verify_calls == 0 and stats.policy_off_steps == stats.step_calls > 0
        assert stats.drafted <= k * stats.verify_calls
        if k == 4 or not (stats.verify_calls or stats.policy_off_steps):  # nothing ran below its k
            assert result.speculation_off_reason == ""
        else:
            want = "plain steps without speculation" if k == 0 else f"verify calls at k={k}"
            assert want in result.speculation_off_reason and "asked k=4" in result.speculation_off_reason


def test_a_smaller_asked_k_is_not_raised(tiny_engine):
    engine = _engine(tiny_engine, [4, 3])
    result = run_one(engine, GenerateRequest(prompt="Move the arm", max_new_tokens=8, drafter="ngram", k=1), queued=2)
    assert result.stats.k == 1 and result.speculation_off_reason == ""
    plain = run_one(engine, GenerateRequest(prompt="Move the arm", max_new_tokens=8, speculate=False), queued=2)
    assert plain.speculation_off_reason == ""  # it did not ask to speculate


def test_default_never_switches_off(tiny_engine):
    assert tiny_engine.cfg.serve.speculate_k_by_load == ()
    result = run_one(tiny_engine, GenerateRequest(prompt="Move the arm", max_new_tokens=4, drafter="ngram"), queued=8)
    assert result.stats.drafter == "ngram" and result.stats.k == 4 and result.speculation_off_reason == ""


def test_the_load_policy_caps_auto(tiny_engine):
    """speculative.k auto under a table: each iteration's k is the choice's, at most the table's at the load."""
    from spec_edge.runtime import k_choice

    engine = Engine(tiny_engine.cfg.replace(**{"serve.speculate_k_by_load": [7, 3, 0], "speculative.k": "auto"}),
                    tiny_engine.runner, tiny_engine.targets, tiny_engine.tokenizer, tiny_engine.graph_dir,
                    progress=lambda message: None)
    engine.loop.costs = k_choice.measure_costs(engine.runner)  # as Engine.from_config does for auto
    fields = drafted_fields(tiny_engine, PROMPT)
    request = GenerateRequest(**fields, drafter="ngram")  # free drafts, mostly accepted: auto speculates
    plain = run_one(engine, GenerateRequest(**fields, speculate=False))
    for queued, cap in ((1, 7), (2, 3), (3, 0)):
        engine._k_last.pop("ngram", None)  # each load starts at the largest k, not where the last request left
        result = run_one(engine, request, queued=queued)
        stats = result.stats
        assert result.token_ids == plain.token_ids and stats.k == 7  # auto: up to the largest exported k
        assert sum(stats.verify_calls_by_k[cap:]) == 0, (queued, stats.verify_calls_by_k)
        if cap:
            assert_speculated(stats, what=f"queued={queued} cap={cap}")
        if cap == 0:
            assert stats.policy_off_steps == stats.step_calls and stats.auto_off_steps == 0
            assert "by load" in result.speculation_off_reason


def test_reason_under_auto():
    from spec_edge.runtime.k_choice import KChoice
    from spec_edge.runtime.stats import Stats

    choice = KChoice((2, 4))
    choice.probes, choice.why = 3, "plain decoding expected fastest (...)"
    text = policy.reason(Stats(k=4, verify_calls_by_k=[0, 2, 0, 1], auto_off_steps=40), [], choice)
    assert text.startswith("speculative.k auto (up to k=4): 2 verify calls at k=2, 1 verify calls at k=4, 40 plain "
                           "steps where plain decoding was expected faster (3 probes); last choice: plain decoding")
    assert policy.reason(Stats(k=4, verify_calls_by_k=[0, 0, 0, 9]), [], choice) == ""  # always at its k
