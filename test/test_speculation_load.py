"""serve.speculate_max_queue: above that many queued requests a request runs target-only, same output."""
from __future__ import annotations

from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest, speculation_off_reason


def test_rule():
    # 0 = never switch off, however deep the queue
    assert speculation_off_reason("ngram", 50, 0) == ""
    # queued counts the request itself: 1 = it is alone
    assert speculation_off_reason("ngram", 1, 1) == ""
    assert speculation_off_reason("ngram", 2, 2) == ""
    reason = speculation_off_reason("ngram", 3, 2)
    assert "3 requests queued" in reason and "serve.speculate_max_queue=2" in reason and "ngram" in reason
    # a request that would not speculate anyway is not "switched off"
    assert speculation_off_reason("none", 9, 1) == ""


def test_engine_runs_target_only_above_the_limit(tiny_engine):
    engine = Engine(tiny_engine.cfg.replace(**{"serve.speculate_max_queue": 1}), tiny_engine.target,
                    tiny_engine.tokenizer, tiny_engine.graph_dir, progress=lambda message: None)
    request = GenerateRequest(prompt="Move the arm to the left and back", max_new_tokens=12, drafter="ngram", k=4)
    alone = engine.generate(request, queued=1)
    assert alone.stats.drafter == "ngram" and alone.speculation_off_reason == "" and alone.queued_at_start == 1
    loaded = engine.generate(request, queued=3)
    assert loaded.stats.drafter == "none" and loaded.stats.drafted == 0 and loaded.stats.k == 0
    assert loaded.queued_at_start == 3
    assert "serve.speculate_max_queue=1" in loaded.speculation_off_reason
    assert loaded.token_ids == alone.token_ids and loaded.text == alone.text
    plain = engine.generate(GenerateRequest(prompt=request.prompt, max_new_tokens=12, speculate=False), queued=3)
    assert plain.speculation_off_reason == ""  # it did not ask to speculate


def test_default_never_switches_off(tiny_engine):
    assert tiny_engine.cfg.serve.speculate_max_queue == 0
    result = tiny_engine.generate(GenerateRequest(prompt="Move the arm", max_new_tokens=4, drafter="ngram"), queued=8)
    assert result.stats.drafter == "ngram" and result.speculation_off_reason == ""
