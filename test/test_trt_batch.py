"""TensorRT with graphs.batch_slots = B > 1, everything up to the engine build, without a GPU: the batched
dynamic graph (graphs/batch_dynamic.py) written by `spec-edge build --export-only` with TensorRT and the
GPU probe made to fail; ONNX Runtime over that exact file with the device runner's row binding and cache
arithmetic (ort_batch_dynamic.py): each row of an (n, T) call over any subset of slots == the B=1 dynamic
graph's row for that slot's cache, other slots untouched, prefill into one slot, greedy decoding of
requests joining and leaving == each alone; hidden rows with a head configured; the engine specs,
profile shapes and manifest carry B; the plan counts B; the config refuses what is not built."""
from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from spec_edge.config import ConfigError, dump
from spec_edge.device import builder, commands, memory, profiles, specs
from spec_edge.device.manifest import ManifestError, check_engines, identity_config
from spec_edge.graphs import batch_dynamic, export, io_names
from spec_edge.graphs import model as model_mod
from spec_edge.heads import eagle3
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.batch_rows import RowCount
from spec_edge.runtime.backends.ort_batch_dynamic import OrtBatchDynamicRunner
from spec_edge.runtime.backends.ort_dynamic import OrtDynamicRunner
from spec_edge.runtime.backends.trt_batch import cache_store
from spec_edge.runtime.sampling import greedy_accept
from spec_edge.runtime.tokenizer import Tokenizer
from tiny import PROMPTS, head_inputs, plain

SLOTS = 3
AUX = (0, 1, 2)


def quiet(_message):
    pass


def no_tensorrt():
    raise AssertionError("export-only must not import TensorRT or probe the GPU")


def export_only(cfg, tmp_path_factory):
    """`spec-edge build PROFILE --export-only` with TensorRT and the GPU probe made to fail; the export manifest."""
    path = tmp_path_factory.mktemp("profile") / f"{cfg.runtime.profile}.yaml"
    path.write_text(dump(cfg))
    mp = pytest.MonkeyPatch()
    mp.setattr(builder, "import_tensorrt", no_tensorrt)
    mp.setattr(builder, "gpu_identity", no_tensorrt)
    mp.setattr(memory, "read_device_memory", lambda: None)
    try:
        assert commands.build_main([str(path), "--export-only"]) == 0
    finally:
        mp.undo()
    root = export.artifact_dir(cfg, "target").parent
    return SimpleNamespace(cfg=cfg, root=root, folder=batch_dynamic.folder(cfg),
                           manifest=json.loads((root / "manifest.json").read_text()))


def trt_cfg(tiny_cfg, tmp_path_factory, name, **extra):
    return tiny_cfg.replace(**{"runtime.backend": "tensorrt", "runtime.profile": name, "speculative.drafter": "ngram",
                               "runtime.engine_dir": str(tmp_path_factory.mktemp(name)), "graphs.batch_slots": SLOTS,
                               **extra})


@pytest.fixture(scope="module")
def batched(tiny_cfg, tmp_path_factory):
    return export_only(trt_cfg(tiny_cfg, tmp_path_factory, "tiny-trt-b3"), tmp_path_factory)


@pytest.fixture(scope="module")
def reference(batched):
    """ONNX Runtime over the B=1 dynamic graph of the same model and shapes (another engine folder)."""
    cfg = batched.cfg.replace(**{"graphs.batch_slots": 1, "runtime.engine_dir": batched.cfg.runtime.engine_dir + "/b1"})
    folder = export.export_model(cfg, "target", export.artifact_dir(cfg, "target"), quiet, dynamic=True)
    return OrtDynamicRunner(folder, decode_widths(cfg))


def decode_widths(cfg) -> list[int]:
    return sorted({1, *(k + 1 for k in cfg.graphs.k_values)})


def test_export_only_writes_the_batched_graph_and_manifest(batched):
    m, cfg, chunk = batched.manifest, batched.cfg, batched.cfg.graphs.prefill_chunk
    assert m["batch_slots"] == SLOTS and m["config"]["graphs.batch_slots"] == SLOTS and set(m["engines"]) == {"target"}
    entry = m["engines"]["target"]
    widths = list(memory.target_widths(cfg.graphs))
    assert entry["onnx"] == f"target_dynamic_b{SLOTS}/dynamic.onnx" and entry["batch"] == SLOTS
    assert entry["widths"] == widths and entry["profiles"] == [str(w) for w in widths]
    assert entry["rows"] == {str(w): [1, 1, 1] if w == chunk else [1, SLOTS, SLOTS] for w in widths}
    for rel in [entry["onnx"], *entry["external"]]:
        assert (batched.root / rel).is_file(), rel
    assert not (batched.root / "target").exists()  # no B=1 graph, layer-skip or head is exported for B > 1
    for side in ("model.json", "tokenizer.json", "tokenizer_config.json"):
        assert (batched.folder / side).is_file()
    graph = onnx.load(str(batched.folder / "dynamic.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(graph.graph.input) + list(graph.graph.output)}
    n, t = dims[io_names.TOKENS]
    mcfg = export.read_model_config(batched.folder)
    assert isinstance(n, str) and isinstance(t, str) and n != t
    assert dims[io_names.k_cache(0)] == [n, mcfg.n_kv_heads, cfg.graphs.max_context, mcfg.head_dim]
    assert dims[io_names.LOGITS] == [n, t, mcfg.vocab_size] and dims[io_names.POSITION] == [n]
    assert dims[io_names.K_NEW] == [mcfg.n_layers, n, mcfg.n_kv_heads, t, mcfg.head_dim]


def fill(runner, seed):
    rng = np.random.default_rng(seed)
    runner.k_store[:] = rng.standard_normal(runner.k_store.shape)  # the spare rows too
    runner.v_store[:] = rng.standard_normal(runner.v_store.shape)
    return rng


@pytest.mark.parametrize("slots", [[0], [2], [1, 2], [2, 0], [0, 1, 2]])
def test_each_row_equals_the_b1_graph_on_its_slot(batched, reference, slots):
    """forward over a subset of slots at every decode width: each row == the B=1 dynamic graph over that
    slot's cache; only its rows [position, position + T) change, other slots and their rows stay."""
    runner = OrtBatchDynamicRunner(batched.folder, decode_widths(batched.cfg))
    rng = fill(runner, seed=sum(slots) + 10 * len(slots))
    size = runner.max_context
    for width in decode_widths(batched.cfg):
        k_before, v_before = runner.k_cache.copy(), runner.v_cache.copy()
        tokens = rng.integers(0, runner.vocab_size, (len(slots), width))
        positions = rng.integers(0, size - width + 1, len(slots))
        logits = runner.forward(slots, tokens, positions)
        assert logits.shape == (len(slots), width, runner.vocab_size)
        changed = np.zeros(k_before.shape, bool)
        for i, slot in enumerate(slots):
            reference.k_cache[:], reference.v_cache[:] = k_before[:, slot], v_before[:, slot]
            want = reference._run(width, tokens[i].tolist(), int(positions[i]), width)
            np.testing.assert_allclose(logits[i], want[io_names.LOGITS], atol=2e-4, rtol=1e-4)
            rows = slice(int(positions[i]), int(positions[i]) + width)
            np.testing.assert_allclose(runner.k_cache[:, slot, :, rows], want[io_names.K_NEW], atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(runner.v_cache[:, slot, :, rows], want[io_names.V_NEW], atol=2e-4, rtol=1e-4)
            changed[:, slot, :, rows] = True
        assert np.array_equal(runner.k_cache[~changed], k_before[~changed])
        assert np.array_equal(runner.v_cache[~changed], v_before[~changed])
        runner.k_cache[:], runner.v_cache[:] = k_before, v_before
        ids = runner.argmax(slots, tokens, positions)  # the same call again: its ids are the logits' argmax
        assert np.array_equal(ids, np.argmax(logits, axis=-1))
    assert runner.calls["idle_rows"] == len(decode_widths(batched.cfg)) * 2 * (max(slots) + 1 - len(slots))


def test_prefill_goes_into_one_slot_alone(batched, reference):
    runner = OrtBatchDynamicRunner(batched.folder, decode_widths(batched.cfg))
    ids = Tokenizer(batched.folder).encode(PROMPTS[3])
    assert len(ids) % runner.prefill_chunk and len(ids) > runner.prefill_chunk  # chunks, the last one padded
    got = runner.prefill(1, ids, 0)
    reference.k_cache[:], reference.v_cache[:] = 0.0, 0.0
    want = reference.prefill(ids, 0)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(runner.k_cache[:, 1, :, :len(ids)], reference.k_cache[:, :, :len(ids)], atol=2e-4)
    assert not runner.k_cache[:, [0, 2]].any() and not runner.k_cache[:, 1, :, len(ids):].any()
    assert not runner.v_cache[:, [0, 2]].any() and runner.calls["prefill"] == -(-len(ids) // runner.prefill_chunk)
    with pytest.raises(BackendError, match="1..16 tokens"):
        runner.prefill_chunk_at(0, ids, 0)


def test_greedy_requests_joining_and_leaving_equal_each_alone(batched, reference):
    """Four requests over three slots through forward / argmax as the batch loop calls them: steps and
    verifies (drafts from each request's own answer, corrupted at varying depths) in separate calls,
    idle rows while a slot is free, a late request reusing the slot the first one left."""
    runner = OrtBatchDynamicRunner(batched.folder, decode_widths(batched.cfg))
    tokenizer, k = Tokenizer(batched.folder), batched.cfg.speculative.k
    alone = SimpleNamespace(target=reference, eos_ids=tuple(export.read_model_config(batched.folder).eos_ids))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    budget, join_at = [8, 24, 24, 16], [0, 1, 2, 14]
    want = [plain(alone, ids, 40) for ids in prompts]
    slots, done, it = [None] * SLOTS, {}, 0
    while len(done) < len(prompts):
        for r in (r for r in range(len(prompts)) if join_at[r] == it):
            slot = slots.index(None)
            first = int(np.argmax(runner.prefill(slot, prompts[r], 0)))
            slots[slot] = SimpleNamespace(r=r, seq=prompts[r] + [first], pos=len(prompts[r]), out=[first])
        busy = [s for s in range(SLOTS) if slots[s] is not None]
        verify = [s for s in busy if (it + s) % 2 == 0]
        for group, width in (([s for s in busy if s not in verify], 1), (verify, k + 1)):
            if not group:
                continue
            drafts = {}
            for s in group:
                own = (want[slots[s].r] + [0] * 40)[len(slots[s].out):][:width - 1]
                drafts[s] = [t if j != it % k else 0 for j, t in enumerate(own)]
            ids = runner.argmax(group, [[slots[s].seq[-1]] + drafts[s] for s in group], [slots[s].pos for s in group])
            for i, s in enumerate(group):
                n_ok, nxt = greedy_accept(ids[i], drafts[s])
                chunk = drafts[s][:n_ok] + [nxt]
                slots[s].seq += chunk
                slots[s].pos += len(chunk)
                slots[s].out += chunk
        for s in busy:
            if len(slots[s].out) >= budget[slots[s].r]:
                done[slots[s].r], slots[s] = slots[s].out, None
        it += 1
    for r, out in done.items():
        eos = [i for i, t in enumerate(out) if t in alone.eos_ids]
        assert out[:eos[0] if eos else budget[r]][:budget[r]] == want[r][:budget[r]], f"request {r}"
    assert runner.calls["idle_rows"] > 0


def test_batch_loop_over_the_device_runners_contract(batched, reference):
    """runtime/batch.py's BatchLoop itself (what the node runs on TensorRT) over ONNX Runtime with the device
    runner's rows and cache arithmetic: four ngram / plain requests over three slots, joins mid-stream, a
    late repeat of request 3 reusing its slot's prefix, each == the B=1 dynamic graph's target-only answer."""
    from spec_edge.runtime import batch
    from spec_edge.runtime.drafters.ngram import NgramDrafter

    runner = OrtBatchDynamicRunner(batched.folder, decode_widths(batched.cfg))
    tokenizer, k = Tokenizer(batched.folder), batched.cfg.speculative.k
    alone = SimpleNamespace(target=reference, eos_ids=tuple(export.read_model_config(batched.folder).eos_ids))
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode(PROMPTS[3])]
    budgets = [12, 24, 20, 16, 12]
    requests = [batch.SlotRequest(prompt_ids=ids, max_new_tokens=n, eos_ids=alone.eos_ids,
                                  drafter=NgramDrafter() if i % 2 == 0 else None)
                for i, (ids, n) in enumerate(zip(prompts, budgets))]
    results = batch.generate_all(runner, requests, k, join_at=[0, 1, 3, 9, 80], reuse=True)
    for i, (ids, finish, stats) in enumerate(results):
        assert ids == plain(alone, prompts[i], budgets[i]), f"request {i} ({finish})"
    assert results[-1][2].prompt_tokens_reused == len(prompts[-1]) - 1  # request 3's slot, its prefix kept


def test_hidden_rows_and_shared_table_with_a_head(tiny_cfg, tiny_models, tmp_path_factory):
    """With speculative.eagle3_head set the batched graph takes embed_table and returns (n, T, 3H) hidden
    rows, written into each called slot's rows like the cache: == the torch model's."""
    target_cfg, state, draft_ids = head_inputs(tiny_models["target"], seed=0, draft_vocab=200)
    hcfg = eagle3.head_config_for(target_cfg, 200, AUX)
    head_state = eagle3.init_state(hcfg, state, draft_ids, seed=0)
    head = eagle3.save_head(tmp_path_factory.mktemp("head") / "h", hcfg, head_state, draft_ids, dtype="float32")
    cfg = trt_cfg(tiny_cfg, tmp_path_factory, "tiny-trt-b3-head", **{"speculative.eagle3_head": str(head)})
    done = export_only(cfg, tmp_path_factory)
    assert done.manifest["embed_table"]["file"] == f"target_dynamic_b{SLOTS}/weights.bin"
    runner = OrtBatchDynamicRunner(done.folder, decode_widths(done.cfg))
    assert runner.embed_table is not None and runner.hidden.shape == (SLOTS, done.cfg.graphs.max_context, 3 * 64)
    rng = fill(runner, seed=3)
    module = model_mod.build(target_cfg, state, hidden_layers=AUX)
    slots, width = [2, 0], 5
    k_before, v_before = torch.from_numpy(runner.k_cache.copy()), torch.from_numpy(runner.v_cache.copy())
    tokens, positions = rng.integers(0, runner.vocab_size, (2, width)), [9, 30]
    logits = runner.forward(slots, tokens, positions)
    for i, slot in enumerate(slots):
        with torch.no_grad():
            want, _, _, hid = module(torch.from_numpy(tokens[i:i + 1]), torch.tensor([positions[i]]),
                                     k_before[:, slot], v_before[:, slot])
        np.testing.assert_allclose(logits[i], want.numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(runner.hidden_states(slot, positions[i], positions[i] + width), hid.numpy(),
                                   atol=2e-4, rtol=1e-4)
    assert not runner.hidden[1].any()


def test_specs_and_profile_shapes_carry_the_rows(batched):
    (spec,) = specs.engine_specs(batched.cfg, {"target": batched.folder})
    assert spec.rows == memory.target_rows(batched.cfg.graphs) and spec.dynamic and spec.role == "target"
    s, d, hkv = batched.cfg.graphs.max_context, 16, 2
    assert specs.profile_input_shapes(spec, 5, io_names.TOKENS, (-1, -1)) == ((1, 5), (SLOTS, 5), (SLOTS, 5))
    assert specs.profile_input_shapes(spec, 16, io_names.TOKENS, (-1, -1)) == ((1, 16),) * 3  # the chunk alone
    assert specs.profile_input_shapes(spec, 1, io_names.POSITION, (-1,)) == ((1,), (SLOTS,), (SLOTS,))
    assert specs.profile_input_shapes(spec, 1, io_names.k_cache(0), (-1, hkv, s, d))[2] == (SLOTS, hkv, s, d)
    assert specs.profile_input_shapes(spec, 1, io_names.EMBED_TABLE, (320, 64)) == ((320, 64),) * 3
    with pytest.raises(specs.BuildError, match="tokens \\(n, T\\)"):
        specs.profile_input_shapes(spec, 1, io_names.k_cache(0), (-1, hkv, -1, d))
    unbatched = specs.EngineSpec("t", "target", spec.onnx, (1, 5), {1: "step", 5: "verify"}, True)
    assert specs.profile_input_shapes(unbatched, 5, io_names.TOKENS, (1, -1)) == ((1, 5),) * 3


def test_build_records_b_and_the_runtime_check_refuses_other_slots(batched, monkeypatch):
    """builder.build over the real export, TensorRT's build replaced by bytes: the manifest carries B and
    the rows; check_engines refuses the engines for a B=1 config of the same profile."""
    seen = []

    def fake_build_engine(spec, out_path, **kw):
        seen.append(spec)
        out_path.write_bytes(b"engine")
        return {"build_seconds": 0.0, "profiles": {str(w): i for i, w in enumerate(spec.widths)}, "context_memory": 1}

    monkeypatch.setattr(builder, "import_tensorrt", lambda: SimpleNamespace(__version__="10.13.3.9"))
    monkeypatch.setattr(builder, "gpu_identity", lambda: {"name": "NVIDIA Thor", "compute_capability": "11.0"})
    monkeypatch.setattr(builder, "build_engine", fake_build_engine)
    monkeypatch.setattr(memory, "read_device_memory", lambda: None)
    manifest = builder.build(batched.cfg, progress=quiet)
    assert [s.rows for s in seen] == [memory.target_rows(batched.cfg.graphs)]
    entry = manifest["engines"]["target"]
    assert manifest["batch_slots"] == SLOTS and entry["batch"] == SLOTS and entry["rows"]["1"] == [1, SLOTS, SLOTS]
    assert check_engines(batched.cfg)["engines"]["target"]["batch"] == SLOTS
    with pytest.raises(ManifestError, match="graphs.batch_slots: engines have 3, config says None"):
        check_engines(batched.cfg.replace(**{"graphs.batch_slots": 1}))
    assert identity_config(batched.cfg.replace(**{"graphs.batch_slots": 1}))["graphs.batch_slots"] is None


def test_plan_counts_the_slots(batched):
    cfg = batched.cfg
    one = dict(profiles.plan_for_config(cfg.replace(**{"graphs.batch_slots": 1}), None).lines)
    three = dict(profiles.plan_for_config(cfg, None).lines)
    target, s, dtype = profiles.model_config(cfg.model.target), cfg.graphs.max_context, cfg.graphs.dtype
    assert three[f"target KV ({SLOTS} x {s} positions)"] == SLOTS * one[f"target KV ({s} positions)"]
    widths, chunk = decode_widths(cfg), cfg.graphs.prefill_chunk
    assert three["engine I/O buffers (logits, k_new, v_new)"] == max(
        SLOTS * memory.io_bytes(target, max(widths), dtype), memory.io_bytes(target, chunk, dtype))
    assert three["activations (shared scratch, estimate)"] == max(
        [SLOTS * memory.activation_bytes(target, s, w, dtype) for w in widths]
        + [memory.activation_bytes(target, s, chunk, dtype)])
    assert three["target weights (1 engine)"] == one["target weights (1 engine)"]


def test_thor_batch_profile_plans_without_weights(capsys):
    assert commands.plan_main(["thor_llama31_8b_batch4", "--config-only"]) == 0
    out = capsys.readouterr().out
    assert "target KV (4 x 8192 positions)" in out and "4.00 GiB" in out


def test_config_refuses_what_is_not_built(tiny_cfg):
    base = {"runtime.backend": "tensorrt", "graphs.batch_slots": SLOTS}
    for drafter in ("draft", "layerskip", "eagle3", "hybrid"):
        with pytest.raises(ConfigError, match=f"per-slot {drafter} engines are not built yet"):
            tiny_cfg.replace(**base, **{"speculative.drafter": drafter, "speculative.eagle3_head": "/h"})
    for drafter in ("none", "ngram"):
        assert tiny_cfg.replace(**base, **{"speculative.drafter": drafter}).graphs.batch_slots == SLOTS


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="shows the refusal of a machine without "
                    "TensorRT; scripts/device_check_batch.sh runs the batched engine on the device")
def test_batch_engine_on_tensorrt_makes_the_device_runner(batched):
    """BatchEngine.from_config on runtime.backend tensorrt goes to TensorRTBatchRunner, which needs TensorRT
    and CUDA (here: the refusal of a machine without them)."""
    from spec_edge.runtime.batch_engine import BatchEngine

    with pytest.raises((BackendError, specs.BuildError), match="TensorRT|CUDA"):
        BatchEngine.from_config(batched.cfg, progress=quiet)


def test_row_count_grows_at_once_and_shrinks_late():
    rows = RowCount(4, shrink_after=3)
    assert [rows.rows_for(n) for n in (2, 4, 1, 1, 4, 1, 1, 1, 2)] == [2, 4, 4, 4, 4, 4, 4, 1, 2]
    with pytest.raises(BackendError, match="1..4"):
        rows.rows_for(5)


def test_cache_store_layout():
    store, cache, spare_step = cache_store(torch, 2, 3, 2, 32, 16, 5, torch.float32, device="cpu")
    assert cache.shape == (2, 3, 2, 32, 16) and spare_step == 5
    assert (store.shape[1] - 3 * 2 * 32) * 16 * 4 % 256 == 0 and store.shape[1] - 3 * 2 * 32 >= 2 * 5
    cache[1, 2, 1, 31] = 7.0  # the view is the store: the last row of the last region of layer 1
    assert store[1, 3 * 2 * 32 - 1].eq(7.0).all() and cache[1, 2].is_contiguous()
    with pytest.raises(BackendError, match="multiple of 256"):
        cache_store(torch, 1, 2, 1, 20, 3, 4, torch.float32, device="cpu")
