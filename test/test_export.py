"""ONNX export: every tensor static, ONNX Runtime == torch within tolerance, refusals are clear."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from spec_edge.artifacts import ensure_packed
from spec_edge.config import Config, ConfigError
from spec_edge.graphs import export, model, ort_attention, plan, weights
from spec_edge.runtime.backends.ort_runner import b1_runner

REL_TOL = 5e-5  # fp32: max |ONNX Runtime - torch| relative to the largest |value| (logits here ~15)


def close(got, want) -> bool:
    want = np.asarray(want)
    return float(np.abs(np.asarray(got) - want).max()) < REL_TOL * max(1.0, float(np.abs(want).max()))


def test_every_exported_graph_is_static(tiny_engine):
    files = sorted(plan.artifact_dir(tiny_engine.cfg, "target").glob("*.onnx"))
    assert {f.stem for f in files} >= {"prefill_16", "step_1", "verify_2", "verify_4", "verify_5", "verify_8",
                                       "layerskip2_step_1"}
    for path in files:
        checked, dynamic = export.dynamic_tensors(onnx.load(str(path), load_external_data=False))
        assert checked > 50 and dynamic == [], (path.name, dynamic[:5])


def test_graphs_share_one_weights_file(tiny_engine):
    size = (tiny_engine.graph_dir / "weights.bin").stat().st_size
    cfg, state, _ = weights.load(str(json.loads((tiny_engine.graph_dir / "manifest.json").read_text())["source"]))
    params = sum(t.numel() * 4 for t in state.values())
    assert size < params * 1.2  # seven graphs, the weights stored once


@pytest.mark.parametrize("variant, attention", [({}, "graph"), ({"model_type": "qwen3"}, "graph"),
                                                ({"llama3_rope": True, "tie": True}, "graph"),
                                                ({}, "fused"), ({"llama3_rope": True, "tie": True}, "fused")])
def test_onnxruntime_matches_torch(tmp_path, variant, attention):
    """The exported graphs, and their fused-attention rewrite (GroupQueryAttention writing the cache
    in place), against the torch model: prefill, verify, layer-skip."""
    from tiny import make_checkpoint

    folder = make_checkpoint(tmp_path / "m", seed=3, **variant)
    cfg = Config().replace(**{"model.target": str(folder), "graphs.weights": "fp32", "graphs.batch_slots": 1,
                              "graphs.max_context": 64, "graphs.prefill_chunk": 8,
                              "graphs.k_values": [3], "speculative.k": 3, "graphs.layer_skip_layers": 1,
                              "runtime.engine_dir": str(tmp_path / "e")})
    out = export.export_model(cfg, "target", tmp_path / "onnx", progress=lambda m: None)
    model_cfg, state, _ = weights.load(str(folder))
    if attention == "fused":
        out = ort_attention.ensure_fused(out, progress=lambda m: None)
        step = onnx.load(str(out / "step_1.onnx"), load_external_data=False)
        assert sum(n.op_type == "GroupQueryAttention" for n in step.graph.node) == model_cfg.n_layers
        assert not any(n.op_type == "Softmax" for n in step.graph.node)  # the exported attention is gone
    reference = model.build(model_cfg, state)
    ensure_packed(out, progress=lambda m: None)
    runner = b1_runner(out)
    ids = list(range(5, 25))  # 20 tokens: prefill chunks 8 + 8 + 4 (padded)
    k_cache, v_cache = model.empty_cache(model_cfg, 64)
    with torch.no_grad():
        want, k_new, v_new = reference(torch.tensor([ids]), torch.tensor([0]), k_cache, v_cache)
    got = runner.prefill(ids, 0)
    assert close(got, want[-1].numpy())
    assert close(runner.runner.k_cache[:, 0, :, :20], k_new.numpy())
    with torch.no_grad():  # verify width 4 at position 20 against torch over the cached prefix
        k_cache[:, :, :20], v_cache[:, :, :20] = k_new, v_new
        want4, k4, v4 = reference(torch.tensor([[7, 8, 9, 10]]), torch.tensor([20]), k_cache, v_cache)
        k_cache[:, :, 20:24], v_cache[:, :, 20:24] = k4, v4
    assert close(runner.forward([7, 8, 9, 10], 20), want4.numpy())
    skip = runner.layer_skip(1)
    with torch.no_grad():
        short = model.build(model_cfg, state, n_layers=1)
        want_skip, _, _ = short(torch.tensor([[11]]), torch.tensor([24]), k_cache[:1], v_cache[:1])
    assert close(skip.forward([11], 24), want_skip.numpy())


def test_fused_attention_to_the_end_of_the_cache(tmp_path):
    """A padded prefill chunk that reaches past S (its padding rows land in the fused cache's spare
    rows) and a verify call ending at S give the torch model's logits; a model with q/k norms is
    refused by the rewrite and kept as exported (with a note) by the config path."""
    from tiny import make_checkpoint

    folder = make_checkpoint(tmp_path / "m", seed=5)
    cfg = Config().replace(**{"model.target": str(folder), "graphs.weights": "fp32", "graphs.batch_slots": 1,
                              "graphs.max_context": 32, "graphs.prefill_chunk": 8,
                              "graphs.k_values": [3], "speculative.k": 3, "graphs.layer_skip_layers": 1,
                              "runtime.engine_dir": str(tmp_path / "e")})
    out = ort_attention.ensure_fused(export.export_model(cfg, "target", tmp_path / "onnx", progress=lambda m: None),
                                     progress=lambda m: None)
    ensure_packed(out, progress=lambda m: None)
    runner = b1_runner(out)
    assert runner.runner.k_cache.shape[1:4:2] == (1, 32 + 8)  # one slot, no scratch; S + one chunk of room for padding
    model_cfg, state, _ = weights.load(str(folder))
    reference = model.build(model_cfg, state)
    ids = [(7 * i) % 50 + 3 for i in range(28)]
    k_cache, v_cache = model.empty_cache(model_cfg, 32)
    with torch.no_grad():
        want, k_new, v_new = reference(torch.tensor([ids]), torch.tensor([0]), k_cache, v_cache)
        k_cache[:, :, :28], v_cache[:, :, :28] = k_new, v_new
        want4, _, _ = reference(torch.tensor([[1, 2, 3, 4]]), torch.tensor([28]), k_cache, v_cache)
    runner.prefill(ids[:3], 0)
    got = runner.prefill(ids[3:], 3)  # chunks at 3, 11, 19, 27: the last (1 real row) pads to 34 > S
    assert close(got, want[-1].numpy())
    assert close(runner.runner.k_cache[:, 0, :, :28], k_new.numpy())
    assert close(runner.forward([1, 2, 3, 4], 28), want4.numpy())  # rows 28..31: the last rows of S

    qwen = make_checkpoint(tmp_path / "q", seed=5, model_type="qwen3")
    qcfg = cfg.replace(**{"model.target": str(qwen), "runtime.engine_dir": str(tmp_path / "eq")})
    qdir = export.export_model(qcfg, "target", tmp_path / "qonnx", progress=lambda m: None)
    with pytest.raises(ort_attention.AttentionRewriteError, match="q/k norms"):
        ort_attention.ensure_fused(qdir, progress=lambda m: None)
    notes = []
    assert ort_attention.for_config(qcfg, qdir, progress=notes.append) == qdir
    assert "q/k norms" in notes[0] and "graphs.ort_attention: graph" in notes[0]


def test_cli_export_leaves_the_graphs_onnxruntime_runs(tmp_path, capsys):
    """`spec-edge export` also runs the post-export pass the engine would run on first load, so a
    robot's first start after an export loads in seconds."""
    from spec_edge import cli
    from tiny import make_checkpoint

    folder = make_checkpoint(tmp_path / "m", seed=2)
    profile = tmp_path / "p.yaml"
    profile.write_text("/**:\n  ros__parameters:\n    graphs:\n      max_context: 64\n      prefill_chunk: 8\n"
                       "      layer_skip_layers: 1\n      k_values: [3]\n      weights: fp32\n      batch_slots: 1\n"
                       "    speculative:\n      k: 3\n")
    assert cli.main(["export", "--config", str(profile), "--target", str(folder),
                     "--engine-dir", str(tmp_path / "e"), "--profile", "cli"]) == 0
    cfg = Config().replace(**{"model.target": str(folder), "graphs.max_context": 64, "graphs.prefill_chunk": 8,
                              "runtime.engine_dir": str(tmp_path / "e"), "runtime.profile": "cli"})
    fused = plan.fused_dir(plan.artifact_dir(cfg, "target"))  # onnx/target-c64-p8-float32-<model>_fused
    assert json.loads((fused / "manifest.json").read_text())["attention"] == "fused"
    assert f"ONNX Runtime runs {fused}" in capsys.readouterr().err

    # with batch slots, the same folder gains the graphs of 2 rows the node loads too (its first start would
    # make them otherwise); the B=1 graphs are not exported again
    profile.write_text("/**:\n  ros__parameters:\n    graphs:\n      max_context: 64\n      prefill_chunk: 8\n"
                       "      layer_skip_layers: 1\n      k_values: [3]\n      weights: fp32\n      batch_slots: 2\n"
                       "    speculative:\n      k: 3\n")
    assert cli.main(["export", "--config", str(profile), "--target", str(folder),
                     "--engine-dir", str(tmp_path / "e"), "--profile", "cli"]) == 0
    assert {"rows2_step_1", "rows2_verify_4"} <= set(json.loads((fused / "manifest.json").read_text())["graphs"])
    err = capsys.readouterr().err
    assert f"ONNX Runtime runs {fused}" in err and "[export] target: loading" not in err


def test_unsupported_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        weights.load(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "attention_bias": True}))
    with pytest.raises(ConfigError, match="attention_bias"):
        weights.load(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        weights.load(str(tmp_path / "nope"))


def test_export_is_reused_when_up_to_date(tiny_engine, tiny_cfg):
    exported = plan.artifact_dir(tiny_cfg, "target")
    before = [(folder / "manifest.json").stat().st_mtime_ns for folder in (exported, tiny_engine.graph_dir)]
    messages = []
    assert export.export_model(tiny_cfg, "target", exported, progress=messages.append) == exported
    assert ort_attention.ensure_fused(exported, progress=messages.append) == tiny_engine.graph_dir
    assert messages == []
    assert [(folder / "manifest.json").stat().st_mtime_ns for folder in (exported, tiny_engine.graph_dir)] == before


def test_trace_gives_torchs_optimized_graph(tmp_path):
    """export.trace skips onnxscript's pattern rewriter (over half of an export's time, no rule of which
    matches these graphs): the graph equals torch's optimize=True export, node for node, for the
    full model and a layer-skip prefix."""
    from tiny import make_checkpoint

    model_cfg, state, _ = weights.load(str(make_checkpoint(tmp_path / "m", seed=3, llama3_rope=True, tie=True)))
    for n_layers in (None, 1):
        module = model.build(model_cfg, state, n_layers=n_layers, cls=model.LayerCaches)
        k_cache, v_cache = model.empty_cache(model_cfg, 32, n_layers)
        args = (torch.zeros(1, 3, dtype=torch.int64), torch.tensor([0])) + tuple(x.clone() for x in (*k_cache, *v_cache))
        names = export.io_names.graph_inputs(n_layers or model_cfg.n_layers), list(export.io_names.GRAPH_OUTPUTS)
        ours = export.trace(module, args, *names)
        with torch.no_grad():
            torch.onnx.export(module, args, str(tmp_path / "ref.onnx"), dynamo=True, opset_version=20, input_names=names[0],
                              output_names=names[1], external_data=True, optimize=True, verbose=False)
        ref = onnx.load(str(tmp_path / "ref.onnx"), load_external_data=True)
        assert [n.SerializeToString() for n in ours.graph.node] == [n.SerializeToString() for n in ref.graph.node]
        assert {(t.name, tuple(t.dims)) for t in ours.graph.initializer} == \
            {(t.name, tuple(t.dims)) for t in ref.graph.initializer}
        assert [(v.name, str(v.type)) for v in ours.graph.output] == [(v.name, str(v.type)) for v in ref.graph.output]
