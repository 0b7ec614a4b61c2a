"""EAGLE-3 heads: greedy speculative output == target-only greedy with a head drafting (its output layer fitted
to the tiny target, tiny.fitted_eagle3_lm_head: its drafts are accepted, per case), sampling
runs through the full-vocabulary q_draft, the head graphs are static and match the torch module,
a saved head loads back identically, and a head made for another model is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError
from spec_edge.graphs import hidden
from spec_edge.heads import eagle3, eagle3_layouts
from spec_edge_training import eagle3 as eagle3_training
from tiny import (TINY_K_VALUES, assert_greedy_equals_plain, assert_misfits_refused, assert_request_equals_plain,
                  assert_same_head, assert_sampling_follows_target, assert_sampling_uses_full_vocab_q, engine_with,
                  exported_graphs, fake_drafter, fitted_eagle3_lm_head, head_inputs, ort_session, set_config,
                  train_draft_argv)

AUX = (0, 1, 2)  # the tiny target has 4 layers: EAGLE-3's default (1, L/2-1, L-4) would collide


def make_head(path, target_dir, *, seed=0, draft_vocab=200, aux=AUX, scale=1.0, fitted=True):
    """A head for a tiny target, saved in the layout spec_edge loads: random layers (scaled by scale), the
    output layer fitted to the target's own answers (tiny.fitted_eagle3_lm_head), so its drafts are accepted."""
    target_cfg, state, draft_ids = head_inputs(target_dir, seed=seed, draft_vocab=draft_vocab, fitted=fitted)
    hcfg = eagle3_training.head_config_for(target_cfg, draft_vocab, aux)
    head_state = eagle3_training.init_state(hcfg, state, draft_ids, seed=seed)
    if scale != 1.0:
        for name, tensor in head_state.items():
            if name.startswith("midlayer.") and tensor.dim() == 2:
                head_state[name] = tensor * scale
    if fitted:
        head_state["lm_head.weight"] = fitted_eagle3_lm_head(eagle3.build_module(hcfg, head_state).eval(), hcfg,
                                                             target_dir, draft_ids)
    eagle3.save_head(path, hcfg, head_state, draft_ids, dtype="float32")
    return path, target_cfg


@pytest.fixture(scope="module")
def head_engine(tiny_models, tiny_cfg):
    head, _ = make_head(tiny_models["root"] / "head_a", tiny_models["target"], scale=20.0)
    return engine_with(tiny_cfg, {"runtime.profile": "tiny-eagle3", "speculative.eagle3_head": str(head),
                                  "speculative.drafter": "eagle3"})


@pytest.mark.parametrize("k", TINY_K_VALUES)
def test_eagle3_greedy_equals_plain(head_engine, k):
    assert_greedy_equals_plain(head_engine, head_engine.drafter("eagle3"), k)


def test_eagle3_through_engine_request(head_engine):
    assert_request_equals_plain(head_engine, "eagle3", 4)


def test_eagle3_greedy_second_head_k3(tiny_models, tiny_cfg):
    """Another head (full draft vocabulary, other layers, k=3 only): still exactly plain greedy."""
    head, _ = make_head(tiny_models["root"] / "head_b", tiny_models["target"], seed=3, draft_vocab=320, aux=(0, 1, 3))
    engine = engine_with(tiny_cfg, {"runtime.profile": "tiny-eagle3b", "speculative.eagle3_head": str(head),
                                    "speculative.drafter": "eagle3", "graphs.k_values": [3], "speculative.k": 3})
    assert_greedy_equals_plain(engine, engine.drafter("eagle3"), 3, max_new=60)


class FakeHead:
    """Records what the drafter feeds the head; drafts draft-id 1, 2, 3 ... (target ids via map)."""
    max_context = 64
    held: tuple[int, ...] = ()

    def __init__(self):
        self.draft_ids = np.arange(10) * 2  # draft id d -> target id 2d
        self.calls = []

    def ingest(self, tokens, hidden, position):
        self.calls.append(("ingest", list(tokens), hidden[:, 0].tolist(), position))
        return np.eye(10, dtype=np.float32)[1], np.zeros((1, 4), np.float32)

    def step(self, token, hidden, position):
        self.calls.append(("step", token, position))
        return np.eye(10, dtype=np.float32)[len(self.calls) % 10], hidden

    def greedy_chain(self, tokens, hidden, position, k):  # as ort_heads.OrtEagle3Head.greedy_chain
        logits, own = self.ingest(tokens, hidden, position)
        ids = [int(self.draft_ids[int(np.argmax(logits))])]
        for i in range(k - 1):
            logits, own = self.step(ids[-1], own, position + len(tokens) + i)
            ids.append(int(self.draft_ids[int(np.argmax(logits))]))
        return np.asarray(ids, np.int64)


def test_eagle3_drafter_bookkeeping():
    """Pairs (target hidden at p, token p+1) are fed once each, at position p; after a verify that
    accepted n drafts exactly the n + 1 new pairs are ingested; draft steps follow at last+1 ...."""
    from spec_edge.runtime.drafters.eagle3 import Eagle3Drafter

    head = FakeHead()
    drafter, sampler = fake_drafter(Eagle3Drafter, head)
    seq = [5, 6, 7, 8]  # the prompt; the target's first token is pending at position 3
    draft = drafter.propose(seq, 3, sampler)
    assert head.calls[0] == ("ingest", [6, 7, 8], [0.0, 1.0, 2.0], 0)
    assert head.calls[1][0] == "step" and head.calls[1][2] == 3 and head.calls[2][2] == 4
    assert draft.tokens[0] == 2  # draft id 1 -> target id 2
    head.calls.clear()
    seq += [draft.tokens[0], 9]  # one draft accepted, then the target's correction
    drafter.propose(seq, 3, sampler)
    assert head.calls[0] == ("ingest", [draft.tokens[0], 9], [3.0, 4.0], 3)
    head.calls.clear()
    seq += [11]  # a plain step (no proposal taken): one new pair
    drafter.propose(seq, 3, sampler)
    assert head.calls[0] == ("ingest", [11], [5.0], 5)
    assert drafter.propose(seq + [1] * 60, 3, sampler) is None  # no room in the head's cache


def test_eagle3_sampling_runs_with_full_vocab_q(head_engine):
    assert_sampling_uses_full_vocab_q(head_engine, head_engine.drafter("eagle3"))


def test_eagle3_sampling_keeps_target_distribution(head_engine):
    """Speculative sampling with the head's q_draft: the first three tokens follow the target's
    exact distribution (chi-square, fixed seeds)."""
    assert_sampling_follows_target(head_engine, head_engine.drafter("eagle3"))


def test_head_graphs_static_and_match_torch(head_engine, tiny_models):
    head_dir, manifest = exported_graphs(head_engine, "eagle3", 10)
    widths = {spec["width"] for spec in manifest["graphs"].values() if spec["kind"] == "ingest"}
    assert widths == {1, 16} | {k + 1 for k in TINY_K_VALUES}
    # ONNX == torch on the saved head, for one ingest width
    hcfg, state, _ = eagle3.load_head(head_engine.cfg.speculative.eagle3_head, head_engine.model_cfg)
    module = eagle3.build_module(hcfg, state).eval()
    rng = np.random.default_rng(0)
    width, S = 5, head_engine.cfg.graphs.max_context
    tokens = rng.integers(0, hcfg.target_vocab_size, (1, width))
    hidden = rng.standard_normal((width, 3 * hcfg.target_hidden_size)).astype(np.float32)
    k_cache = rng.standard_normal((1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    embed = head_engine.drafter("eagle3").head.head.embed_table  # the head under slot 0's view
    feeds = {"tokens": tokens, "hidden": hidden, "position": np.array([7]), "last_index": np.array([3]),
             "k_cache": k_cache, "v_cache": v_cache, "embed_table": np.asarray(embed)}
    got = ort_session(head_dir / f"eagle3_ingest_{width}.onnx").run(None, feeds)
    with torch.no_grad():
        want = module(*(torch.from_numpy(np.array(feeds[name])) for name in
                        ("tokens", "hidden", "position", "last_index", "k_cache", "v_cache", "embed_table")))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-4, atol=1e-4)


def test_fused_head_matches_exported_head(head_engine):
    """The head's fused-attention graphs (GroupQueryAttention writing the head cache in place, the
    default on ONNX Runtime) give the exported graphs' drafts: a padded ingest, then draft steps."""
    from spec_edge.artifacts import ensure_packed
    from spec_edge.graphs import ort_attention, plan
    from spec_edge.runtime.backends.ort_heads import OrtEagle3Head

    exported = plan.artifact_dir(head_engine.cfg, "eagle3")
    fused = ort_attention.ensure_fused(exported, progress=lambda m: None,
                                       geometry=eagle3_layouts.read_head_config(exported).as_model_config())
    embed = head_engine.drafter("eagle3").head.head.embed_table  # the head under slot 0's view
    for folder in (exported, fused):  # the engine's build packed only the folder it runs (the q8 copy)
        ensure_packed(folder, progress=lambda m: None)
    heads = [OrtEagle3Head(folder, embed) for folder in (exported, fused)]
    assert not heads[0].fused and heads[1].fused
    rng = np.random.default_rng(1)
    n = 11  # ingest width 16: 5 padding rows, which only the fused head's spare cache rows take
    tokens = rng.integers(0, heads[0].cfg.target_vocab_size, n).tolist()
    hidden = rng.standard_normal((n, 3 * heads[0].cfg.target_hidden_size)).astype(np.float32)
    def copied(pair):  # the runner returns views of its output buffers
        return pair[0].copy(), pair[1].copy()

    results = [[copied(head.ingest(tokens, hidden, 0))] for head in heads]
    for pos in range(n, n + 4):
        for head, out in zip(heads, results):
            logits, h = out[-1]
            out.append(copied(head.step(int(np.argmax(logits)), h, pos)))
    for (want_logits, want_h), (got_logits, got_h) in zip(*results):
        np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(heads[1].k_cache[:, :, :n + 4], heads[0].k_cache[:, :, :n + 4], rtol=1e-4, atol=1e-4)


def test_q8_head_drafts_like_the_fp32_head(head_engine):
    """graphs.head_weights q8 (the default): the engine runs the head's 8-bit copy (a quarter of the
    weight bytes, MatMulNBits), whose logits stay within 5% of the fp32 graphs' (this head's layer
    weights are scaled x20) and whose drafts (argmax) are the same, call by call, along a padded
    ingest and draft steps. Exactness of its speculative output is test_eagle3_greedy_equals_plain
    (it runs the default)."""
    import onnx

    from spec_edge.artifacts import ensure_packed
    from spec_edge.graphs import ort_attention, plan, quantize
    from spec_edge.runtime.backends.ort_heads import OrtEagle3Head

    running = head_engine.drafter("eagle3").head.head  # the head under slot 0's view
    assert running.head_dir.name.endswith("_fused_q8") and head_engine.cfg.graphs.head_weights == "q8"
    exported = plan.artifact_dir(head_engine.cfg, "eagle3")
    fp32_dir = ort_attention.ensure_fused(exported, progress=lambda m: None,
                                          geometry=eagle3_layouts.read_head_config(exported).as_model_config())
    assert quantize.ensure_head_q8(fp32_dir, progress=lambda m: None) == running.head_dir  # made once, reused
    step = onnx.load(str(running.head_dir / "eagle3_step_1.onnx"), load_external_data=False)
    assert sum(node.op_type == "MatMulNBits" for node in step.graph.node) >= 7  # q k v o, gate up down (+ head)
    sizes = [(folder / "weights.bin").stat().st_size for folder in (fp32_dir, running.head_dir)]
    assert sizes[1] < 0.4 * sizes[0]
    ensure_packed(fp32_dir, progress=lambda m: None)  # the engine's build packed only the q8 copy it runs
    heads = [OrtEagle3Head(fp32_dir, running.embed_table), OrtEagle3Head(running.head_dir, running.embed_table)]
    rng = np.random.default_rng(2)
    n = 11
    tokens = rng.integers(0, heads[0].cfg.target_vocab_size, n).tolist()
    hidden = rng.standard_normal((n, 3 * heads[0].cfg.target_hidden_size)).astype(np.float32)
    outs = [head.ingest(tokens, hidden, 0) for head in heads]
    for pos in range(n, n + 4):
        (want, want_h), (got, _) = ((logits.copy(), h.copy()) for logits, h in outs)
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
        assert int(np.argmax(got)) == int(np.argmax(want))
        outs = [head.step(int(np.argmax(want)), want_h, pos) for head in heads]  # same input: no drift


def test_head_round_trip(tmp_path, tiny_models):
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=5, fitted=False)
    hcfg, state, draft_ids = eagle3.load_head(path, target_cfg)
    eagle3.save_head(tmp_path / "h2", hcfg, state, draft_ids, dtype="float32")
    assert_same_head((hcfg, state, draft_ids), eagle3.load_head(tmp_path / "h2", target_cfg))
    raw = json.loads((path / "config.json").read_text())
    assert raw["draft_vocab_size"] == 200 and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)


def test_published_layout_names_load(tmp_path, tiny_models):
    """SafeAILab (pytorch_model.bin, no layer ids) and NVIDIA-style (layers.0. prefix) names load."""
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=6, fitted=False)
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    raw = json.loads((path / "config.json").read_text())
    nv = tmp_path / "nv"
    nv.mkdir()
    from safetensors.torch import save_file

    save_file({name.replace("midlayer.", "layers.0."): t for name, t in tensors.items()}, str(nv / "model.safetensors"))
    (nv / "config.json").write_text(json.dumps(raw))
    assert eagle3.load_head(nv, target_cfg)[0].aux_layers == AUX
    safeai = tmp_path / "safeai"
    safeai.mkdir()
    torch.save(tensors, str(safeai / "pytorch_model.bin"))
    raw_safeai = {key: value for key, value in raw.items() if key not in ("eagle_config", "spec_edge",
                                                                             "target_num_hidden_layers")}
    (safeai / "config.json").write_text(json.dumps(raw_safeai))
    # no layer ids: EAGLE-3's default for the target's layer count
    hcfg = eagle3.load_head(safeai, target_cfg)[0]
    assert hcfg.aux_layers == hidden.default_aux_layers(4)
    raw_safeai["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # vLLM indexing: outputs of 0, 1, 2
    (safeai / "config.json").write_text(json.dumps(raw_safeai))
    assert eagle3.load_head(safeai, target_cfg)[0].aux_layers == (0, 1, 2)


def test_bad_heads_refused(tmp_path, tiny_models):
    path, target_cfg = assert_misfits_refused(tmp_path, tiny_models, make_head, eagle3.load_head)
    set_config(path, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 9], "use_aux_hidden_state": True})
    with pytest.raises(ConfigError, match="auxiliary layers"):
        eagle3.load_head(path, target_cfg)
    with pytest.raises(ConfigError, match="config.json"):
        eagle3.load_head(tmp_path / "nothing", target_cfg)


def test_eagle3_without_head_is_a_clear_error(tiny_cfg):
    with pytest.raises(ConfigError, match="eagle3_head"):
        tiny_cfg.replace(**{"speculative.drafter": "eagle3"})


@pytest.mark.release
def test_train_draft_tiny_saves_loadable_head_and_resumes(tmp_path, tiny_models):
    """`spec-edge-train` end to end on the tiny target (a few steps): a head folder that loads
    against the target, and a second run that resumes from the first run's step."""
    from spec_edge_training import train
    from spec_edge.graphs import weights

    out = tmp_path / "head"
    argv = train_draft_argv(tmp_path, tiny_models, out) + ["--dtype", "float32"]
    assert train.main(argv) == 0
    target_cfg = weights.load(str(tiny_models["target"]))[0]
    hcfg, state, draft_ids = eagle3.load_head(out, target_cfg)
    assert hcfg.draft_vocab_size == 64 and hcfg.aux_layers == (0, 1, 2) and len(set(draft_ids)) == 64
    assert json.loads((out / "config.json").read_text())["spec_edge"]["trained_steps"] == 3
    argv[argv.index("--steps") + 1] = "5"
    assert train.main(argv) == 0
    assert torch.load(str(out / "train_state.pt"), weights_only=False)["step"] == 5  # resumed at 3
    eagle3.load_head(out, target_cfg)  # the kept (best held-out) checkpoint still loads
