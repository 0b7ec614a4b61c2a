"""One export plan with a row count per graph (plan.graph_plan) on a tiny random model: growing
graphs.batch_slots adds only the graphs of m > 1 rows (made from step_1 by the fused-attention pass,
no torch export), the rows=1 graphs and the stored weights stay as they are, and the runner's m-row
calls equal its one-row calls bit for bit. One runner for every slot count: one slot has no scratch
region, and the exported (unfused) attention runs one-row calls."""
from __future__ import annotations

import json

import numpy as np
import pytest

from speculated import assert_speculated

from spec_edge.artifacts import ensure_packed, model_graphs
from spec_edge.config import Config
from spec_edge.graphs import plan
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.onnxruntime import packed_dir
from spec_edge.runtime.backends.ort_runner import OrtRunner, b1_runner
from tiny import run_alone


def files(folder):
    return {path.name: path.stat().st_mtime_ns for path in folder.iterdir() if path.suffix in (".onnx", ".bin")}


def test_growing_batch_slots_adds_only_the_rows_graphs(tiny_models, tmp_path):
    cfg = Config().replace(**{
        "model.target": str(tiny_models["target"]), "graphs.weights": "fp32", "graphs.batch_slots": 1,
        "graphs.max_context": 64, "graphs.prefill_chunk": 8,
        "graphs.k_values": [3], "speculative.k": 3, "graphs.layer_skip_layers": 1, "speculative.drafter": "ngram",
        "runtime.engine_dir": str(tmp_path / "e"), "runtime.profile": "grow"})
    quiet = lambda message: None  # noqa: E731
    fused = model_graphs(cfg, "target", quiet)
    exported, packed = plan.artifact_dir(cfg, "target"), packed_dir(fused)
    plan1 = plan.graph_plan(cfg, "target")
    assert {spec["rows"] for spec in plan1.values()} == {1}
    before = {folder: files(folder) for folder in (exported, fused, packed)}
    sizes = {folder: (folder / "weights.bin").stat().st_size for folder in (exported, fused, packed)}

    grown = cfg.replace(**{"graphs.batch_slots": 3})
    rows = {stem: spec for stem, spec in plan.graph_plan(grown, "target").items() if spec["rows"] > 1}
    assert sorted(rows) == ["rows2_step_1", "rows2_verify_4", "rows3_step_1", "rows3_verify_4"]
    assert model_graphs(grown, "target", quiet) == fused
    assert files(exported) == before[exported]  # no torch export: the B=1 graphs are not made again
    assert json.loads((exported / "manifest.json").read_text())["made"][1:] == []
    for folder in (fused, packed):
        after = files(folder)
        assert set(after) - set(before[folder]) == {f"{stem}.onnx" for stem in rows}
        assert {name: after[name] for name in before[folder] if name != "weights.bin"} == \
            {name: mtime for name, mtime in before[folder].items() if name != "weights.bin"}  # not rewritten
    assert (fused / "weights.bin").stat().st_size == sizes[fused]  # every weight of the new graphs already stored
    assert (packed / "weights.bin").stat().st_size < 1.1 * sizes[packed]
    messages = []  # going back to B=1 finds every graph there: nothing runs
    assert model_graphs(cfg, "target", messages.append) == fused and messages == []

    batched, single = OrtRunner(fused, slots=3), b1_runner(fused)
    assert batched.row_counts == (2, 3) and single.widths == {1, 4}
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, single.vocab_size, n)) for n in (5, 11, 20)]
    for slot, ids in enumerate(prompts):
        batched.prefill(slot, ids, 0)
    tokens = rng.integers(3, single.vocab_size, (3, 4))
    logits = batched.forward((0, 1, 2), tokens, [len(p) for p in prompts]).copy()  # the 3-row graph
    for j, ids in enumerate(prompts):
        single.prefill(ids, 0)
        np.testing.assert_array_equal(logits[j], single.forward(list(tokens[j]), len(ids)))


def test_layer_skip_per_slot_equals_b1(tiny_cfg, tiny_engine):
    """OrtRunner.layer_skip(n): each slot's layer-skip call on its own region == a one-slot runner's
    layer-skip call bit for bit, and it writes only that slot's first n layers."""
    from test_batch import SLOTS, batch_cfg

    single = tiny_engine.target
    batched = OrtRunner(model_graphs(batch_cfg(tiny_cfg), "target", lambda message: None), slots=SLOTS)
    skip, single_skip = batched.layer_skip(2), single.layer_skip(2)
    assert batched.layer_skip(2) is skip and skip.widths == {1}
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(3, single.vocab_size, n)) for n in (7, 13)]
    for slot, ids in enumerate(prompts):
        batched.prefill(slot, ids, 0)
    other = batched.k_cache[:, 1].copy()
    got = skip.forward([0], np.asarray([[5]]), [len(prompts[0])]).copy()
    assert np.array_equal(batched.k_cache[:, 1], other)
    assert not np.array_equal(batched.k_cache[:2, 0, :, len(prompts[0])], 0 * batched.k_cache[:2, 0, :, 0])
    single.prefill(prompts[0], 0)
    np.testing.assert_array_equal(got[0], single_skip.forward([5], len(prompts[0])))
    single.held = ()


def test_one_slot_has_no_scratch_region(tiny_engine):
    """A B=1 runner's cache is one region, (L, 1, Hkv, S + C, D) with fused attention: the bytes of one
    model cache, no scratch region (only graphs of m > 1 rows pad into one)."""
    runner, cfg = tiny_engine.runner, tiny_engine.model_cfg
    rows = tiny_engine.cfg.graphs.max_context + tiny_engine.cfg.graphs.prefill_chunk
    assert runner.batch == 1 and runner.row_counts == () and runner.scratch is None
    assert runner.k_cache.shape == runner.v_cache.shape == (cfg.n_layers, 1, cfg.n_kv_heads, rows, cfg.head_dim)


def test_exported_attention_runs_one_row_calls(tiny_cfg, tiny_engine):
    """graphs.ort_attention: graph (the exported folders, k_new / v_new copied into the slot's region):
    greedy speculative == target-only token for token at one slot; a draft model's folder runs one-row
    calls on any slot, each touching only its own region; a target with graphs of several rows is refused."""
    from spec_edge.runtime.drafters.draft_model import ModelDrafter
    from spec_edge.runtime.drafters.ngram import NgramDrafter

    cfg = tiny_cfg.replace(**{"graphs.ort_attention": "graph"})
    folder = model_graphs(cfg, "target", lambda message: None)  # the exported folder the fused one is made from
    assert folder == plan.artifact_dir(tiny_cfg, "target") != tiny_engine.graph_dir
    assert json.loads((folder / "manifest.json").read_text()).get("attention") != "fused"
    runner, model_cfg = OrtRunner(folder, slots=1), plan.read_model_config(folder)
    assert runner.k_cache.shape == (model_cfg.n_layers, 1, model_cfg.n_kv_heads, cfg.graphs.max_context,
                                    model_cfg.head_dim)
    rng = np.random.default_rng(4)
    prompt = [int(t) for t in rng.integers(3, model_cfg.vocab_size, 21)]  # prefill chunks 16 + 5 (padded)
    plain, _, _ = run_alone(runner, speculative.SlotRequest(prompt_ids=prompt, max_new_tokens=30, eos_ids=()))
    self_drafter = ModelDrafter(b1_runner(folder), name="self")
    for drafter in (NgramDrafter(), self_drafter):
        spec, _, stats = run_alone(runner, speculative.SlotRequest(
            prompt_ids=prompt, max_new_tokens=30, eos_ids=(), drafter=drafter, k=3))
        assert spec == plain, drafter.name
        assert_speculated(stats, accepted=False, what=drafter.name)
    assert stats.acceptance_rate > 0.9  # the target drafting for itself

    draft_dir = plan.artifact_dir(cfg, "draft")  # exported by tiny_engine (speculative.drafter: draft)
    ensure_packed(draft_dir, progress=lambda message: None)  # the build packs the fused copy the engine runs
    drafts, single = OrtRunner(draft_dir, slots=2), b1_runner(draft_dir)
    drafts.prefill(0, prompt, 0)
    drafts.prefill(1, prompt[:9], 0)
    other = drafts.k_cache[:, 0].copy()
    got = drafts.forward([1], np.asarray([[5]]), [9]).copy()  # (1, 1, V)
    assert np.array_equal(drafts.k_cache[:, 0], other)
    single.prefill(prompt[:9], 0)
    np.testing.assert_array_equal(got[0], single.forward([5], 9))
    with pytest.raises(BackendError, match="graphs.ort_attention: fused"):
        OrtRunner(folder, slots=2)
