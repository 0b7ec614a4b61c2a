"""Batched graphs (graphs.batch_slots > 1) and the in-flight batching loop on tiny random models,
through real ONNX Runtime graphs: ONNX == torch per slot, a row independent of the other rows, an
idle slot's cache left alone, and every request's output == its solo output token for token."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError
from spec_edge.graphs import batch_export, model as model_mod
from spec_edge.runtime import batch, speculative
from spec_edge.runtime.backends.ort_batch import BatchRunner
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.sampling import SamplingParams

SLOTS, K = 3, 3
PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the"]


@pytest.fixture(scope="module", params=["fused", "graph"])
def batch_runner(request, tiny_cfg):
    cfg = tiny_cfg.replace(**{"graphs.batch_slots": SLOTS, "graphs.k_values": [K], "speculative.k": K,
                              "graphs.ort_attention": request.param})
    return BatchRunner(batch_export.batch_graphs(cfg, progress=lambda message: None))


@pytest.fixture(scope="module")
def torch_target(tiny_models):
    from spec_edge.graphs import weights

    model_cfg, state, _ = weights.load(str(tiny_models["target"]))
    return model_mod.build(model_cfg, state)


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def filled(runner, engine, prompts) -> list[int]:
    """Prefill each slot with its prompt; returns the positions."""
    ids = [prompt_ids(engine, p) for p in prompts]
    for slot, p in enumerate(ids):
        runner.prefill(slot, p, 0)
    return [len(p) for p in ids]


def test_onnx_equals_torch_per_slot(batch_runner, tiny_engine, torch_target):
    """Each slot of a (B, T) call == the torch B=1 forward over that slot's own cache region."""
    positions = filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])
    rng = np.random.default_rng(0)
    for width in (1, K + 1):
        tokens = rng.integers(3, tiny_engine.model_cfg.vocab_size, (SLOTS, width))
        k_before, v_before = batch_runner.k_cache.copy(), batch_runner.v_cache.copy()
        logits = batch_runner.forward(tokens, positions, [True] * SLOTS).copy()
        for slot in range(SLOTS):
            with torch.no_grad():
                ref, _, _ = torch_target(torch.from_numpy(tokens[slot:slot + 1]), torch.tensor([positions[slot]]),
                                         torch.from_numpy(k_before[:, slot]), torch.from_numpy(v_before[:, slot]))
            np.testing.assert_allclose(logits[slot], ref.numpy(), rtol=5e-5, atol=5e-5 * np.abs(ref.numpy()).max())
        filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])  # undo the call's rows


def test_row_does_not_depend_on_other_rows(batch_runner, tiny_engine):
    """Slot 0's logits with all slots filled with other prompts and tokens == with slot 1 idle == alone
    (one active slot runs the B=1 graph bound to its region)."""
    rng = np.random.default_rng(1)
    for width in (1, K + 1):
        tokens = rng.integers(3, tiny_engine.model_cfg.vocab_size, (SLOTS, width))
        rows = []
        for active in ([True] * SLOTS, [True, False, True], [True, False, False]):
            positions = filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])
            rows.append(batch_runner.forward(tokens, positions, active)[0].copy())
        for row in rows[1:]:
            assert np.abs(rows[0] - row).max() <= 1e-5 * np.abs(row).max(), np.abs(rows[0] - row).max()


def test_idle_slot_cache_untouched(batch_runner, tiny_engine):
    """Calls that leave slot 1 idle do not change what slot 1 computes next (its rows < position)."""
    positions = filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])
    token = np.full((SLOTS, 1), 7, np.int64)
    before = batch_runner.forward(token, positions, [True] * SLOTS)[1].copy()
    filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])
    for width in (1, K + 1, 1):
        batch_runner.forward(np.full((SLOTS, width), 9, np.int64), positions, [True, False, True])
    after = batch_runner.forward(token, positions, [True] * SLOTS)[1].copy()
    np.testing.assert_array_equal(before, after)


def solo(runner, engine, request_args, k):
    """The request alone in the batched loop."""
    return batch.generate_all(runner, [batch.SlotRequest(**request_args())], k)[0]


def make_requests(engine, runner, drafter_names, max_news, sampling=SamplingParams(), seeds=None):
    """Factories (a drafter keeps state: each run gets a fresh one) for one request per prompt."""
    from spec_edge.runtime.backends.onnxruntime import OrtRunner

    def drafter(name):
        if name == "ngram":
            return NgramDrafter()
        if name == "draft":  # a separate model with its own cache: one runner per request
            return ModelDrafter(OrtRunner(engine.drafter("draft").runner.graph_dir), name="draft")
        return None

    factories = []
    for i, (text, name, max_new) in enumerate(zip(PROMPTS, drafter_names, max_news)):
        def args(text=text, name=name, max_new=max_new, i=i):
            return dict(prompt_ids=prompt_ids(engine, text), max_new_tokens=max_new, eos_ids=engine.eos_ids,
                        sampling=sampling, seed=None if seeds is None else seeds[i], drafter=drafter(name))
        factories.append(args)
    return factories


@pytest.mark.parametrize("mixed", batch.MIXED)
def test_each_output_equals_its_solo_output(batch_runner, tiny_engine, mixed):
    """Four requests (mixed drafters and lengths) over three slots, one joining mid-stream and one
    reusing a freed slot: each == the same request alone, and greedy == B=1 target-only."""
    factories = make_requests(tiny_engine, batch_runner, ["ngram", "draft", None, "ngram"], [40, 12, 30, 25])
    together = batch.generate_all(batch_runner, [batch.SlotRequest(**f()) for f in factories], K,
                                  join_at=[0, 0, 5, 0], mixed=mixed)
    for f, (ids, finish, stats) in zip(factories, together):
        alone_ids, alone_finish, _ = solo(batch_runner, tiny_engine, f, K)
        assert (ids, finish) == (alone_ids, alone_finish)
        plain, plain_finish, _ = speculative.generate(tiny_engine.target, f()["prompt_ids"],
                                                      max_new_tokens=f()["max_new_tokens"], eos_ids=tiny_engine.eos_ids)
        assert (ids, finish) == (plain, plain_finish)
    assert sum(stats.verify_calls for _, _, stats in together) > 0  # the drafters did speculate


def test_sampling_stream_is_the_seeds_own(batch_runner, tiny_engine):
    """With sampling each request's tokens depend on its seed only, not on what shares the batch."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    factories = make_requests(tiny_engine, batch_runner, ["ngram", None, "draft"], [20, 20, 20], sampling, [11, 12, 13])
    together = batch.generate_all(batch_runner, [batch.SlotRequest(**f()) for f in factories], K, join_at=[0, 2, 0])
    for f, (ids, _, _) in zip(factories, together):
        assert ids == solo(batch_runner, tiny_engine, f, K)[0]
    other_seed = make_requests(tiny_engine, batch_runner, ["ngram"], [20], sampling, [99])[0]
    assert solo(batch_runner, tiny_engine, other_seed, K)[0] != together[0][0]


def test_cancel_and_speculation_policy(batch_runner, tiny_engine):
    """A cancelled request leaves at the next iteration boundary and its slot is reused; with
    more occupied slots than speculate_max_active no draft is verified, and greedy output stays the same."""
    factories = make_requests(tiny_engine, batch_runner, ["ngram", "ngram", "ngram"], [40, 40, 40])
    loop = batch.BatchLoop(batch_runner, K, speculate_max_active=1)
    done = {}
    requests = [batch.SlotRequest(**f()) for f in factories]
    for i, request in enumerate(requests):
        request.on_done = lambda ids, finish, stats, i=i: done.setdefault(i, (ids, finish, stats))
    requests[0].cancel = lambda: "cancelled" if loop.iterations > 4 else None
    loop.add(requests[0])
    loop.add(requests[1])
    while 0 not in done:
        loop.iterate()
    assert loop.calls["verify"] == 0 and done[0][1] == "cancelled" and 0 < len(done[0][0]) < 40
    assert loop.add(requests[2]) == 0  # the freed slot
    loop.run()
    for i in (1, 2):
        assert done[i][0] == solo(batch_runner, tiny_engine, factories[i], K)[0]


def test_batch_slots_config(tiny_cfg):
    with pytest.raises(ConfigError, match="batch_slots"):
        tiny_cfg.replace(**{"graphs.batch_slots": 0})
    with pytest.raises(ConfigError, match="batched graphs need B >= 2"):
        batch_export.export_batch(tiny_cfg)
    assert batch_export.batch_dir(tiny_cfg.replace(**{"graphs.batch_slots": 4})).name == "target_b4"


@pytest.fixture(scope="module")
def q4_runners(tiny_cfg, tiny_engine, tmp_path_factory):
    """(batched, B=1) tiny graphs carried to 4-bit MatMulNBits with int8 activations (graphs.weights q4)."""
    from spec_edge.graphs import quantize
    from spec_edge.runtime.backends.onnxruntime import OrtRunner
    from test_quantize import _fresh_blocks

    cfg = tiny_cfg.replace(**{"graphs.batch_slots": SLOTS, "graphs.k_values": [K], "speculative.k": K})
    root = tmp_path_factory.mktemp("q4b")
    for name, src in (("batched", batch_export.batch_graphs(cfg, progress=lambda m: None)),
                      ("single", tiny_engine.graph_dir)):
        quantize.convert_folder(src, root / name, _fresh_blocks, accuracy_level=quantize.ACCURACY_LEVELS["q4"],
                                stamp="tiny", source="tiny blocks", progress=lambda m: None)
    return BatchRunner(root / "batched"), OrtRunner(root / "single")


def test_q4_batched_equals_b1_q4(q4_runners, tiny_engine):
    """q4 (int8 activations, where a row's numerics depend on the call's shape): batched steps run as
    two-row calls, so every request in the batch == the B=1 q4 graphs' own target-only output."""
    batched, single = q4_runners
    assert batched.step_width == 2
    factories = make_requests(tiny_engine, batched, ["ngram", None, "ngram", None], [30, 30, 20, 25])
    together = batch.generate_all(batched, [batch.SlotRequest(**f()) for f in factories], K, join_at=[0, 0, 3, 0])
    for f, (ids, finish, _) in zip(factories, together):
        plain = speculative.generate(single, f()["prompt_ids"], max_new_tokens=f()["max_new_tokens"],
                                     eos_ids=tiny_engine.eos_ids)
        assert (ids, finish) == plain[:2]


def test_tune_occupancy_rates(batch_runner):
    """`spec-edge tune` for the batched node: costs per occupancy 1..B measured on the runner, and the
    expected totals n / c_step(n) and n * tokens per call / c_verify(n)."""
    from spec_edge.tools import tune, tune_batch

    costs = tune_batch.occupancy_costs(batch_runner, K, rounds=2, position=20)
    assert sorted(costs) == list(range(1, SLOTS + 1)) and all(s > 0 and v > 0 for s, v in costs.values())
    tokens = (3 * tune.expected_tokens([0.5, 0.25, 0.125], 3) + 1) / 4  # per slot per call: 3 verifies, 1 silent step
    assert tokens == pytest.approx((3 * (1 + 0.5 + 0.25 + 0.125) + 1) / 4)
    rates = tune_batch.occupancy_rates({1: (10.0, 12.0), 2: (20.0, 40.0)}, tokens)
    assert rates[1] == pytest.approx((100.0, 1000 * tokens / 12)) and rates[2] == pytest.approx((100.0, 50 * tokens))
    assert tune.speculate_max_queue(rates) == 1  # speculation pays alone, not with two slots occupied
