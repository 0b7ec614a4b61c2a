"""Per-slot drafters in the batched node (graphs.batch_slots > 1) on tiny random models and random heads:
every request through the Engine's batched loop, beside other slots busy with other prompts and drafters and
joining mid-stream, answers exactly what it answers alone through the B=1 Engine (token for token, and
the same drafts: the same drafted / accepted counts), for draft, eagle3, hybrid, medusa and peagle,
greedy and seeded sampling; the batched graphs return the B=1 graphs' hidden states bit for bit per
slot; a slot's drafter records what its caches hold for the slot's next request; layerskip per slot too."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from test_batch import PROMPTS
from tiny import Collect

from spec_edge.runtime.serving import front_of
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.scheduler import run_one

K, SLOTS = 3, 3
HEAD_DRAFTERS = ("draft", "eagle3", "hybrid", "medusa", "peagle")


@pytest.fixture(scope="module")
def heads_cfg(tiny_cfg, tiny_models):
    """The tiny profile with an EAGLE-3, a P-EAGLE and Medusa heads configured (random weights), k=3,
    no prefix reuse (every request cold, so the B=1 answer is the request's own)."""
    from test_eagle3 import make_head as make_eagle3
    from test_medusa import make_heads as make_medusa
    from test_peagle import make_head as make_peagle

    root, target = tiny_models["root"], tiny_models["target"]
    return tiny_cfg.replace(**{
        "runtime.profile": "tiny-slot-drafters", "graphs.k_values": [K], "speculative.k": K,
        "speculative.drafter": "eagle3", "serve.reuse_prefix": False,
        "speculative.eagle3_head": str(make_eagle3(root / "slot_eagle3", target, scale=20.0)[0]),
        "speculative.peagle_head": str(make_peagle(root / "slot_peagle", target)[0]),
        "speculative.medusa_head": str(make_medusa(root / "slot_medusa", target)[0])})


@pytest.fixture(scope="module")
def engines(heads_cfg):
    """(the Engine over 3 slots, the B=1 Engine) of the same profile."""
    from spec_edge import artifacts

    quiet = lambda message: None  # noqa: E731
    return (artifacts.engine(heads_cfg.replace(**{"graphs.batch_slots": SLOTS}), quiet),
            artifacts.engine(heads_cfg, quiet))


def run_batched(engine, requests, join_at, loop=None):
    """The requests through the engine's loop, request i joining at iteration join_at[i] (or once a slot is
    free after it); their GenerateResults."""
    loop = loop or engine.loop
    sinks, waiting = [Collect() for _ in requests], sorted(range(len(requests)), key=lambda i: join_at[i])
    while waiting or loop.occupied:
        while waiting and join_at[waiting[0]] <= loop.iterations and loop.free:
            i = waiting.pop(0)
            loop.add(engine.start(front_of(engine).prepare(requests[i]), sinks[i]))
        loop.iterate()
    return [sink.result for sink in sinks]


def same(batched, alone) -> None:
    assert (batched.token_ids, batched.finish_reason) == (alone.token_ids, alone.finish_reason)
    for field in ("drafter", "drafted", "accepted", "verify_calls", "step_calls", "accepted_at"):
        assert getattr(batched.stats, field) == getattr(alone.stats, field), field


@pytest.fixture
def proposals(monkeypatch):
    """Every draft the model drafters propose, into the dict proposals[0] points to: (drafter, the sequence
    so far) -> (draft tokens, q rows or None). The random heads' drafts are rarely accepted, so the
    drafts themselves are compared, not only what the target kept."""
    from spec_edge.runtime.drafters.draft_model import ModelDrafter
    from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
    from spec_edge.runtime.drafters.medusa import MedusaDrafter
    from spec_edge.runtime.drafters.peagle import PEagleDrafter

    into = [{}]
    for cls in (ModelDrafter, Eagle3Drafter, MedusaDrafter, PEagleDrafter):
        def propose(self, seq, k, sampler, original=cls.propose):
            draft = original(self, seq, k, sampler)
            into[0][(self.name, tuple(seq))] = None if draft is None else (draft.tokens, draft.q_draft)
            return draft
        monkeypatch.setattr(cls, "propose", propose)
    return into


def same_drafts(batched: dict, alone: dict) -> None:
    assert batched.keys() == alone.keys()
    for key, draft in batched.items():
        other = alone[key]
        assert (draft is None) == (other is None), key[0]
        if draft is not None:
            assert draft[0] == other[0], key[0]
            assert (draft[1] is None and other[1] is None) or np.array_equal(draft[1], other[1]), key[0]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95}], ids=["greedy", "seeded"])
def test_each_drafter_in_a_busy_batch_equals_the_b1_engine(engines, proposals, sampling):
    """Seven requests over three slots: each head drafter and the draft model beside prompt lookup and
    target-only requests, joining at different iterations (some waiting for a slot to free), so calls
    run one to three rows and slots are reused by other drafters: each result == the same request alone
    through the B=1 Engine, with the same drafts (tokens and q rows)."""
    batched, alone = engines
    names = ["eagle3", "draft", "hybrid", "medusa", "none", "peagle", "ngram"]
    requests = [GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=[24, 18, 30, 20, 12, 26, 16][i],
                                drafter=name, speculate=name != "none", k=K, seed=40 + i, **sampling)
                for i, name in enumerate(names)]
    calls = dict(batched.loop.runner.calls)
    together = run_batched(batched, requests, join_at=[0, 0, 2, 5, 6, 9, 12])
    used = {rows for (width, rows), count in batched.loop.runner.calls.items() if count > calls.get((width, rows), 0)}
    assert used >= {1, 2, 3}, used
    drafted, proposals[0] = proposals[0], {}
    for name, request, result in zip(names, requests, together):
        same(result, run_one(alone, request))
        if name in HEAD_DRAFTERS:
            assert result.stats.drafted > 0, name
    same_drafts(drafted, proposals[0])


def test_batched_hidden_states_equal_b1_rows(engines):
    """The batched graphs' hidden states, per slot, over every subset at the step and verify widths ==
    the B=1 graphs' rows bit for bit (what the heads read), and no other slot's rows change."""
    batched, alone = engines
    runner, single = batched.loop.runner, alone.target
    ids = [alone.tokenizer.encode(text) for text in PROMPTS[:SLOTS]]
    rng = np.random.default_rng(3)
    for n in range(1, SLOTS + 1):
        for slots, width in itertools.product(itertools.combinations(range(SLOTS), n), (1, K + 1)):
            for slot in range(SLOTS):
                runner.prefill(slot, ids[slot], 0)
            before = runner.hidden.copy()
            tokens = rng.integers(3, alone.model_cfg.vocab_size, (n, width))
            runner.forward(slots, tokens, [len(ids[slot]) for slot in slots])
            for j, slot in enumerate(slots):
                at = len(ids[slot])
                single.prefill(ids[slot], 0)
                np.testing.assert_array_equal(runner.hidden_states(slot, 0, at), single.hidden_states(0, at))
                single.forward(list(tokens[j]), at)
                np.testing.assert_array_equal(runner.hidden_states(slot, at, at + width),
                                              single.hidden_states(at, at + width), err_msg=f"{slots} {width}")
            for slot in set(range(SLOTS)) - set(slots):
                assert np.array_equal(runner.hidden[slot], before[slot])
    runner.held, single.held = [()] * SLOTS, ()  # their caches were rewritten here


def test_slot_records_are_reused_on_the_same_slot(engines):
    """With prefix reuse each slot's drafter records what its draft-model / head cache region holds as the
    request leaves; the next request with that prompt takes the same slot, starts from the record and
    still answers the B=1 Engine's greedy answer."""
    from spec_edge.runtime.speculative import BatchLoop

    batched, alone = engines
    loop = BatchLoop(batched.loop.runner, reuse=True)
    loop.clear()
    views = batched._drafters
    for name in ("draft", "eagle3", "peagle"):
        request = GenerateRequest(prompt=PROMPTS[3], max_new_tokens=16, drafter=name, k=K)
        (first,), (again,) = run_batched(batched, [request], [0], loop), run_batched(batched, [request], [0], loop)
        answer = run_one(alone, request).token_ids
        assert first.token_ids == again.token_ids == answer, name
        assert again.stats.prompt_tokens_reused > 0 and again.stats.drafted > 0
        slot = max(range(SLOTS), key=lambda b: len(loop.runner.held[b]))
        record = (views.draft[slot] if name == "draft" else views._heads[name][slot]).held
        assert len(record) > len(first.token_ids)  # the prompt and the answer's rows, as it left
    loop.clear()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "top_p": 0.95}], ids=["greedy", "seeded"])
def test_layerskip_in_a_busy_batch_equals_the_b1_engine(engines, sampling):
    """layerskip per slot (the target's first n layers over the slot's own cache region, one graph shared by
    the slots): beside prompt-lookup and target-only requests, joining at different iterations, each result ==
    the same request alone through the B=1 Engine (same drafted / accepted counts)."""
    batched, alone = engines
    names = ["layerskip", "ngram", "layerskip", "none", "layerskip"]
    requests = [GenerateRequest(prompt=PROMPTS[i % len(PROMPTS)], max_new_tokens=[20, 14, 24, 10, 16][i],
                                drafter=name, speculate=name != "none", k=K, seed=60 + i, **sampling)
                for i, name in enumerate(names)]
    together = run_batched(batched, requests, join_at=[0, 0, 1, 3, 6])
    for name, request, result in zip(names, requests, together):
        same(result, run_one(alone, request))
        if name == "layerskip":
            assert result.stats.drafted > 0
