"""`spec-edge build --export-only` for a TensorRT profile with an EAGLE-3 head, on a tiny random model:
the exact ONNX files TensorRT would be given are written without CUDA or TensorRT, ONNX Runtime runs
them at every width the engines get a profile for (logits, new keys and hidden states == the torch
model; the head graph == the torch head, its in-graph d2t argmax == the host's), and eagle3 / hybrid
greedy output through those files == target-only greedy. Also: the config refuses a drafter the
backend cannot run, and the plan counts the head."""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError, from_params, load, to_params
from spec_edge.device import builder, commands, head_memory, memory, profiles
from spec_edge.graphs import export, hidden, io_names
from spec_edge.graphs import model as model_mod
from spec_edge.heads import eagle3, eagle3_export
from spec_edge.runtime.backends.ort_dynamic import OrtDynamicHead, OrtDynamicRunner, shared_embed_table
from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter
from spec_edge.runtime.drafters.hybrid import HybridDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.tokenizer import Tokenizer
from tiny import PROMPTS, TINY_K_VALUES, assert_greedy_equals_plain, head_inputs

AUX = (0, 1, 2)  # the tiny target has 4 layers


def no_tensorrt():
    raise AssertionError("export-only must not import TensorRT")


@pytest.fixture(scope="module")
def exported(tiny_models, tiny_cfg, tmp_path_factory):
    """export-only of a tiny eagle3 profile on backend tensorrt, TensorRT and the GPU probe made to fail."""
    target_cfg, state, draft_ids = head_inputs(tiny_models["target"], seed=0, draft_vocab=200)
    hcfg = eagle3.head_config_for(target_cfg, 200, AUX)
    head_state = eagle3.init_state(hcfg, state, draft_ids, seed=0)
    for name, tensor in head_state.items():  # as test_eagle3: a sharper random head drafts varied tokens
        if name.startswith("midlayer.") and tensor.dim() == 2:
            head_state[name] = tensor * 20.0
    head_dir = eagle3.save_head(tiny_models["root"] / "trt_head", hcfg, head_state, draft_ids, dtype="float32")
    cfg = tiny_cfg.replace(**{"runtime.backend": "tensorrt", "runtime.profile": "tiny-trt-eagle3",
                              "runtime.engine_dir": str(tmp_path_factory.mktemp("trt_engines")),
                              "speculative.drafter": "eagle3", "speculative.eagle3_head": str(head_dir)})
    mp = pytest.MonkeyPatch()
    mp.setattr(builder, "import_tensorrt", no_tensorrt)
    mp.setattr(builder, "gpu_identity", no_tensorrt)
    mp.setattr(memory, "read_device_memory", lambda: None)
    try:
        assert commands.build_main([_write_profile(cfg, tmp_path_factory), "--export-only"]) == 0
    finally:
        mp.undo()
    root = export.artifact_dir(cfg, "target").parent
    return SimpleNamespace(cfg=cfg, root=root, target=root / "target", head=root / "eagle3",
                           manifest=json.loads((root / "manifest.json").read_text()), state=state)


def _write_profile(cfg, tmp_path_factory):
    import yaml

    tree: dict = {}
    for key, value in to_params(cfg).items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    path = tmp_path_factory.mktemp("profile") / "tiny_trt_eagle3.yaml"
    path.write_text(yaml.safe_dump({"/**": {"ros__parameters": tree}}))
    return str(path)


def engine_widths(cfg) -> list[int]:
    return sorted(memory.target_widths(cfg.graphs))


def test_export_only_writes_every_graph_and_the_manifest(exported):
    m = exported.manifest
    assert set(m["engines"]) == {"target", "eagle3"}
    assert m["engines"]["target"]["onnx"] == "target/dynamic.onnx"
    assert m["engines"]["target"]["widths"] == engine_widths(exported.cfg)
    assert m["engines"]["eagle3"]["onnx"] == "eagle3/eagle3_dynamic.onnx"
    widths = head_memory.head_widths(exported.cfg.graphs)
    assert m["engines"]["eagle3"]["profiles"] == [str(w) for w in widths] + ["step"]
    assert (exported.target / "layerskip2_dynamic.onnx").is_file()  # the layer-skip graph is exported too
    spec = json.loads((exported.target / "manifest.json").read_text())["graphs"]["dynamic"]
    assert spec["hidden_layers"] == list(AUX) and spec["embed_input"]
    for entry in m["engines"].values():
        for rel in [entry["onnx"], *entry["external"]]:
            assert (exported.root / rel).is_file(), rel
    assert m["embed_table"]["file"] == "target/weights.bin"
    from spec_edge.graphs import shared_table  # the table TensorRT binds == the checkpoint's embedding
    torch.testing.assert_close(shared_table.table_tensor(exported.target), exported.state["model.embed_tokens.weight"])


def test_export_only_says_where(exported, capsys, monkeypatch):
    monkeypatch.setattr(builder, "import_tensorrt", no_tensorrt)
    monkeypatch.setattr(memory, "read_device_memory", lambda: None)
    builder.export_only(exported.cfg)  # up to date: nothing is exported again
    out = capsys.readouterr().out
    assert f"in {exported.root}" in out and "manifest" in out and "eagle3_dynamic.onnx" in out


def test_target_graph_matches_torch_at_every_engine_width(exported, tiny_models):
    """logits, k_new and the head's hidden states == the torch model at 1, each k+1 and C."""
    from spec_edge.graphs import weights

    mcfg, state, _ = weights.load(str(tiny_models["target"]))
    module = model_mod.build(mcfg, state, hidden_layers=AUX)
    runner = OrtDynamicRunner(exported.target, engine_widths(exported.cfg))
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = model_mod.empty_cache(mcfg, exported.cfg.graphs.max_context)
    k_cache.normal_(generator=gen)
    v_cache.normal_(generator=gen)
    position = 9
    for width in engine_widths(exported.cfg):
        runner.k_cache[:], runner.v_cache[:] = k_cache.numpy(), v_cache.numpy()
        tokens = torch.randint(0, mcfg.vocab_size, (1, width), generator=gen)
        call = runner._run(width, tokens[0].tolist(), position, width)
        with torch.no_grad():
            logits, k_new, _, hid = module(tokens, torch.tensor([position]), k_cache, v_cache)
        np.testing.assert_allclose(call[io_names.LOGITS], logits.numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(call[io_names.K_NEW], k_new.numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(call[io_names.HIDDEN], hid.numpy(), atol=2e-4, rtol=1e-4)


def test_head_graph_matches_torch_at_every_profile(exported):
    """Each ingest width and the draft step == the torch head; draft_token == d2t[argmax] on the host."""
    head = OrtDynamicHead(exported.head, shared_embed_table(exported.target))
    hcfg, c = head.cfg, head.cfg
    module = eagle3.build_module(hcfg, eagle3.load_head(exported.cfg.speculative.eagle3_head,
                                                        export.read_model_config(exported.target))[1])
    table = torch.from_numpy(np.array(head.embed_table))
    gen = torch.Generator().manual_seed(1)
    shape = head.k_cache.shape
    cache_k, cache_v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    position = 5
    for width in head.ingest_widths + ["step"]:
        w = 1 if width == "step" else width
        head.k_cache[:], head.v_cache[:] = cache_k.numpy(), cache_v.numpy()
        tokens = torch.randint(0, c.target_vocab_size, (1, w), generator=gen)
        if width == "step":
            own = torch.randn(1, c.hidden_size, generator=gen)
            logits, hid_out = head.step(int(tokens[0, 0]), own.numpy(), position)
            module.fused, hidden_in = False, own
        else:
            hidden_in = torch.randn(w, 3 * c.target_hidden_size, generator=gen)
            logits, hid_out = head.ingest(tokens[0].tolist(), hidden_in.numpy(), position)
            module.fused = True
        with torch.no_grad():
            want = module(tokens, hidden_in, torch.tensor([position]), torch.tensor([w - 1]), cache_k, cache_v, table)
        np.testing.assert_allclose(logits, want[0][0].numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(hid_out, want[3].numpy(), atol=2e-4, rtol=1e-4)
        np.testing.assert_allclose(head.k_cache[:, :, position:position + w], want[1].numpy(), atol=2e-4, rtol=1e-4)
        assert int(head.draft_token[0]) == int(head.draft_ids[int(np.argmax(logits))])


def dynamic_engine(exported):
    runner = OrtDynamicRunner(exported.target, [1] + [k + 1 for k in exported.cfg.graphs.k_values])
    head = OrtDynamicHead(exported.head, runner.embed_table)
    columns = hidden.hidden_columns(hidden.returned_hidden_layers(exported.target), head.cfg.aux_layers,
                                    runner.model_cfg.hidden_size)
    engine = SimpleNamespace(target=runner, tokenizer=Tokenizer(exported.target), eos_ids=runner.model_cfg.eos_ids)
    return engine, head, columns


@pytest.mark.parametrize("k", TINY_K_VALUES)
def test_eagle3_and_hybrid_greedy_through_the_dynamic_files_equal_plain(exported, k):
    engine, head, columns = dynamic_engine(exported)
    assert_greedy_equals_plain(engine, Eagle3Drafter(engine.target, head, columns), k)
    hybrid = HybridDrafter(NgramDrafter(), Eagle3Drafter(engine.target, head, columns))
    assert_greedy_equals_plain(engine, hybrid, k, prompts=PROMPTS[-2:])
    assert hybrid.proposals["eagle3"] > 0


def test_dynamic_target_only_equals_the_static_graphs(exported, tiny_engine):
    """Target-only greedy through the dynamic file == through the static ONNX Runtime graphs."""
    from tiny import plain

    engine, _, _ = dynamic_engine(exported)
    for prompt in PROMPTS[:2]:
        ids = tiny_engine.tokenizer.encode(prompt)
        assert plain(engine, ids, 30) == plain(tiny_engine, ids, 30)


def test_config_refuses_what_the_backend_cannot_run(tiny_cfg):
    for drafter, head_key in (("medusa", "speculative.medusa_head"), ("peagle", "speculative.peagle_head")):
        with pytest.raises(ConfigError, match=f"drafter={drafter} cannot run on runtime.backend=tensorrt"):
            tiny_cfg.replace(**{"runtime.backend": "tensorrt", "speculative.drafter": drafter, head_key: "/h"})
    for drafter in ("eagle3", "hybrid"):  # allowed: the head has a TensorRT engine spec
        params = dict(to_params(tiny_cfg), **{"runtime.backend": "tensorrt", "speculative.drafter": drafter,
                                               "speculative.eagle3_head": "/h"})
        assert from_params(params).speculative.drafter == drafter


def test_plan_counts_the_head(exported):
    p = profiles.plan_for_config(exported.cfg, None)
    lines = dict(p.lines)
    assert lines[f"EAGLE-3 head weights (Vd={p.inputs.head.draft_vocab_size})"] == head_memory.head_weight_bytes(
        p.inputs.head, 4)
    assert lines[f"EAGLE-3 head KV ({exported.cfg.graphs.max_context} positions)"] > 0
    target = p.inputs.target
    assert lines["shared embedding table (target + head)"] == target.vocab_size * target.hidden_size * 4
    # the head engine holds what the plan counts: its graph's weights file (+ the d2t map) is that size
    on_disk = (exported.head / "weights.bin").stat().st_size
    assert abs(on_disk - head_memory.head_weight_bytes(p.inputs.head, 4)) < 0.02 * on_disk


def test_thor_eagle3_plan_needs_no_weights(capsys):
    assert commands.plan_main(["thor_llama31_8b_eagle3", "--config-only"]) == 0
    out = capsys.readouterr().out
    assert "EAGLE-3 head weights (Vd=32000)" in out and "shared embedding table" in out
    cfg = load(profiles.resolve_profile("thor_llama31_8b_eagle3"))
    assert eagle3_export.head_widths(cfg) == list(head_memory.head_widths(cfg.graphs))
