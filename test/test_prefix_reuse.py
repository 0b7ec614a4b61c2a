"""Prefix reuse across requests (serve.reuse_prefix): a request whose prompt shares a prefix with what
the previous request left in the resident caches prefills only the rest, and answers exactly what a
cold engine answers, for every drafter (their own caches follow the same rule): a prompt sharing
nothing, one sharing all but its last token, a growing dialog, after a cancelled and after a failed
request."""
from __future__ import annotations

import pytest
from test_eagle3 import make_head as make_eagle3_head
from test_medusa import make_heads as make_medusa_heads
from test_peagle import make_head as make_peagle_head
from tiny import engine_with, run_alone, warm

from spec_edge.runtime.serving import front_of
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.base import common_prefix
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.scheduler import run_one

SYSTEM = "The robot picks up the red box and places it on the shelf."
DRAFTERS = ["none", "ngram", "draft", "layerskip", "eagle3", "peagle", "medusa", "hybrid"]
K = 3


@pytest.fixture(scope="module")
def profiles(tiny_models):
    """Settings per drafter: the heads, folders and profiles test_eagle3 / test_peagle / test_medusa
    make, so the whole suite exports them once."""
    root, target = tiny_models["root"], tiny_models["target"]
    heads = {"runtime.profile": "tiny-eagle3", "speculative.drafter": "none",
             "speculative.eagle3_head": str(make_eagle3_head(root / "head_a", target, scale=20.0)[0]),
             "speculative.peagle_head": str(make_peagle_head(root / "peagle_a", target)[0])}
    medusa = {"runtime.profile": "tiny-medusa", "speculative.drafter": "none",
              "speculative.medusa_head": str(make_medusa_heads(root / "medusa_a", target)[0])}
    return {"medusa": medusa, "eagle3": heads, "peagle": heads, "hybrid": heads}


@pytest.fixture(scope="module")
def engines(tiny_cfg, profiles):
    """drafter -> (engine, the same graphs with serve.reuse_prefix off: every request prefills from 0)."""
    made = {}

    def get(drafter):
        settings = profiles.get(drafter, {})
        key = settings.get("runtime.profile", "tiny")
        if key not in made:
            made[key] = (engine_with(tiny_cfg, settings),
                         engine_with(tiny_cfg, {**settings, "serve.reuse_prefix": False}))
        return made[key]
    return get


def ask(engine, drafter, **fields):
    request = GenerateRequest(max_new_tokens=12, drafter=drafter, k=K, speculate=drafter != "none",
                              system_prompt=fields.pop("system_prompt", SYSTEM), **fields)
    return run_one(engine, request), front_of(engine).prompt_ids(request)


def same_as_cold(engine, cold, drafter, **fields):
    got, ids = ask(engine, drafter, **fields)
    want, _ = ask(cold, drafter, **fields)
    assert want.stats.prompt_tokens_reused == 0
    assert got.token_ids == want.token_ids, (drafter, fields, got.stats.prompt_tokens_reused)
    return got, ids


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_reused_requests_equal_cold_ones(engines, drafter):
    engine, cold = engines(drafter)
    first, first_ids = same_as_cold(engine, cold, drafter, prompt="Move the arm to the left")
    second, second_ids = same_as_cold(engine, cold, drafter, prompt="Navigate to the kitchen")
    assert second.stats.prompt_tokens_reused == common_prefix(first_ids, second_ids, len(second_ids)) > 10
    again, _ = same_as_cold(engine, cold, drafter, prompt="Navigate to the kitchen")
    assert again.stats.prompt_tokens_reused == len(second_ids) - 1  # all but the token whose logits it needs
    # a growing dialog (the tiny model's answers are byte soup: fixed replies keep it in its context)
    history, previous = (), second_ids
    for turn, reply in (("Report the battery", "Temperature sensors read 21.5 degrees"), ("Move the arm", "")):
        answer, ids = same_as_cold(engine, cold, drafter, messages=history + (("user", turn),))
        assert answer.stats.prompt_tokens_reused >= common_prefix(previous, ids, len(ids)) > 10
        history, previous = history + (("user", turn), ("assistant", reply)), ids
    raw, _ = same_as_cold(engine, cold, drafter, prompt="def add(a, b):", chat=False, system_prompt="")
    assert raw.stats.prompt_tokens_reused == 0  # shares no token with the dialog


@pytest.mark.parametrize("drafter", ["draft", "eagle3", "hybrid"])
def test_after_a_cancelled_and_a_failed_request(engines, drafter):
    engine, cold = engines(drafter)
    calls = []
    request = GenerateRequest(prompt="Move the arm to the left", system_prompt=SYSTEM, max_new_tokens=30,
                              drafter=drafter, k=K)
    cut = run_one(engine, request, cancel=lambda: "cancelled" if len(calls.append(1) or calls) > 3 else None)
    assert cut.finish_reason == "cancelled" and 0 < len(cut.token_ids) < 30
    after, _ = same_as_cold(engine, cold, drafter, prompt="Move the arm to the left")
    assert after.stats.prompt_tokens_reused > 10  # what the cancelled request left is kept

    def fail(delta, n_tokens):
        if n_tokens > 4:
            raise RuntimeError("the client went away")

    with pytest.raises(RuntimeError, match="went away"):
        run_one(engine, request, on_text=fail)
    assert engine.target.held == ()
    failed_after, _ = same_as_cold(engine, cold, drafter, prompt="Move the arm to the left")
    assert failed_after.stats.prompt_tokens_reused == 0  # a failed request leaves nothing to trust


def test_the_record_is_the_fed_sequence(tiny_engine):
    """After a request the target holds exactly prompt + answer but the last (pending, never fed) token;
    reuse=False prefills from 0 whatever the record says."""
    ids = tiny_engine.tokenizer.encode("Move the arm to the left")
    out, finish, stats = run_alone(tiny_engine.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=9, eos_ids=()))
    assert finish == "length" and tiny_engine.target.held == tuple(ids + out[:-1])
    _, _, again = run_alone(tiny_engine.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=9, eos_ids=()))
    assert again.prompt_tokens_reused == 0
    _, _, reused = run_alone(tiny_engine.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=9, eos_ids=()), reuse=True)
    assert reused.prompt_tokens_reused == len(ids) - 1


def test_warm_prefills_the_system_prompt(engines):
    engine, cold = engines("ngram")
    n = warm(engine, SYSTEM)
    ids = front_of(engine).prompt_ids(GenerateRequest(prompt="Report the battery", system_prompt=SYSTEM))
    assert engine.target.held == tuple(ids[:n]) and n > 10
    got, _ = same_as_cold(engine, cold, "ngram", prompt="Report the battery")
    assert got.stats.prompt_tokens_reused == n
