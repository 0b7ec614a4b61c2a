"""Medusa heads: greedy speculative output == target-only greedy with heads drafting (random ResBlocks, output
layers fitted to the tiny target: accepted drafts; through the real ONNX Runtime graphs), sampling runs through
the full-vocabulary q_draft, the heads' graph is static and matches the torch module, saved heads load back
identically, heads that do not fit the target (or a k above their head count) are refused, and
spec-edge-train --kind medusa trains and resumes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError
from spec_edge.heads import medusa
from spec_edge_training import medusa as medusa_training
from spec_edge.runtime.engine import Engine
from spec_edge.runtime.requests import GenerateRequest, RequestError
from spec_edge.runtime.sampling import Sampler, SamplingParams
from spec_edge.runtime.scheduler import run_one
from tiny import (PROMPTS, assert_greedy_equals_plain, assert_misfits_refused, assert_request_equals_plain,
                  assert_same_head, assert_sampling_follows_target, assert_sampling_uses_full_vocab_q, engine_with,
                  exported_graphs, fit_output_layer, head_inputs, one_thread, ort_session, set_config,
                  target_answers, train_draft_argv)


def make_heads(path, target_dir, *, seed=0, n_heads=4, draft_vocab=200, std=0.05, fitted=True):
    """Medusa heads for a tiny target, saved in the layout spec_edge loads: random ResBlocks (std), each head's
    output layer fitted (tiny.fit_output_layer) from its ResBlock's features of the target's final-norm state at
    t to the token the target writes at t + i + 2 (target_answers), so head 0's drafts are often accepted."""
    target_cfg, state, draft_ids = head_inputs(target_dir, seed=seed, draft_vocab=draft_vocab, fitted=fitted)
    mcfg = medusa_training.config_for(target_cfg, n_heads, draft_vocab)
    head_state = medusa_training.init_state(mcfg, state, draft_ids, seed=seed, std=std)
    if fitted:
        module = medusa.build_module(mcfg, head_state).eval()
        H = target_cfg.hidden_size
        answers = target_answers(target_dir)
        with one_thread():
            for i, head in enumerate(module.medusa_head):
                features = torch.cat([head[:-1](answer["hidden"][:-i - 1, -H:]) for answer in answers])  # (R, H)
                labels = torch.cat([answer["labels"][i + 1:] for answer in answers])  # written at t + i + 2
                head_state[f"medusa_head.{i}.{mcfg.n_layers}.weight"] = fit_output_layer(features, labels, draft_ids)
    medusa.save_heads(path, mcfg, head_state, draft_ids, dtype="float32")
    return path, target_cfg


@pytest.fixture(scope="module")
def medusa_engine(tiny_models, tiny_cfg):
    heads, _ = make_heads(tiny_models["root"] / "medusa_a", tiny_models["target"])
    return engine_with(tiny_cfg, {"runtime.profile": "tiny-medusa", "speculative.medusa_head": str(heads),
                                  "speculative.drafter": "medusa"})


@pytest.mark.parametrize("k", [1, 3, 4])
def test_medusa_greedy_equals_plain(medusa_engine, k):
    assert_greedy_equals_plain(medusa_engine, medusa_engine.drafter("medusa"), k)


def test_medusa_drafts_are_the_heads_argmax(medusa_engine):
    """Draft i is head i's argmax on the target's final-norm state at the last verified position,
    which is the state the target's own head turned into the pending token."""
    drafter = medusa_engine.drafter("medusa")
    target = medusa_engine.target
    ids = medusa_engine.tokenizer.encode(PROMPTS[0])
    logits = target.prefill(ids, 0)
    seq = ids + [int(np.argmax(logits))]
    hidden = target.hidden_states(len(ids) - 1, len(ids))[:, drafter.columns]  # (1, H)
    mcfg, state, draft_ids = medusa.load_heads(medusa_engine.cfg.speculative.medusa_head, medusa_engine.model_cfg)
    # the final-norm state through the target's lm_head gives the pending token
    from safetensors.torch import load_file

    lm_head = load_file(str(medusa_engine.cfg.model.target) + "/model.safetensors")["lm_head.weight"].numpy()
    assert int(np.argmax(hidden[0] @ lm_head.T)) == seq[-1]
    module = medusa.build_module(mcfg, state).eval()
    with torch.no_grad():
        want = module(torch.from_numpy(np.ascontiguousarray(hidden))).numpy()  # (n, Vd)
    draft = drafter.propose(seq, 4, Sampler(SamplingParams()))
    assert draft.tokens == [int(draft_ids[i]) for i in want.argmax(-1)]


def test_medusa_through_engine_request_and_k_refused(medusa_engine):
    assert_request_equals_plain(medusa_engine, "medusa", 3)
    with pytest.raises(RequestError, match="Medusa heads"):  # k=7 has a verify graph but only 4 heads
        run_one(medusa_engine, GenerateRequest(prompt="Move the arm", max_new_tokens=5, drafter="medusa", k=7))


def test_medusa_sampling_runs_with_full_vocab_q(medusa_engine):
    assert_sampling_uses_full_vocab_q(medusa_engine, medusa_engine.drafter("medusa"))


def test_medusa_sampling_keeps_target_distribution(medusa_engine):
    """Speculative sampling with the head's q_draft: the first three tokens follow the target's
    exact distribution (chi-square, fixed seeds)."""
    assert_sampling_follows_target(medusa_engine, medusa_engine.drafter("medusa"))


def test_medusa_graph_static_and_matches_torch(medusa_engine):
    import onnx

    head_dir, manifest = exported_graphs(medusa_engine, "medusa", 4)
    (stem,) = manifest["graphs"]
    graph = onnx.load(str(head_dir / f"{stem}.onnx"), load_external_data=False)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(graph.graph.input) + list(graph.graph.output)}
    mcfg, state, _ = medusa.load_heads(medusa_engine.cfg.speculative.medusa_head, medusa_engine.model_cfg)
    assert shapes == {"hidden": [1, mcfg.hidden_size], "logits": [4, 200]}
    hidden = np.random.default_rng(0).standard_normal((1, mcfg.hidden_size)).astype(np.float32)
    got = ort_session(head_dir / f"{stem}.onnx").run(None, {"hidden": hidden})[0]
    with torch.no_grad():
        want = medusa.build_module(mcfg, state).eval()(torch.from_numpy(hidden)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_medusa_round_trip(tmp_path, tiny_models):
    path, target_cfg = make_heads(tmp_path / "h", tiny_models["target"], seed=5, n_heads=3, fitted=False)
    mcfg, state, draft_ids = medusa.load_heads(path, target_cfg)
    assert mcfg.n_heads == 3 and mcfg.draft_vocab_size == 200 and mcfg.target_layers == 4
    medusa.save_heads(tmp_path / "h2", mcfg, state, draft_ids, dtype="float32")
    assert_same_head((mcfg, state, draft_ids), medusa.load_heads(tmp_path / "h2", target_cfg))
    raw = json.loads((path / "config.json").read_text())
    assert raw["medusa_num_heads"] == 3 and raw["medusa_num_layers"] == 1


def test_bad_medusa_heads_refused(tmp_path, tiny_models):
    path, target_cfg = assert_misfits_refused(tmp_path, tiny_models, make_heads, medusa.load_heads,
                                              "hidden size 96 differs from the target's 64")
    set_config(path, draft_vocab_size=150)  # the tensors hold 200 rows
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        medusa.load_heads(path, target_cfg)
    with pytest.raises(ConfigError, match="config.json"):
        medusa.load_heads(tmp_path / "nothing", target_cfg)
    with pytest.raises(ConfigError, match="medusa_head"):
        from spec_edge.config import Config

        Config().replace(**{"speculative.drafter": "medusa"})


def test_profile_k_above_head_count_refused(medusa_engine):
    cfg = medusa_engine.cfg.replace(**{"speculative.k": 7})  # a verify graph exists, a 7th head does not
    with pytest.raises(ConfigError, match="k=7 needs 7 Medusa heads.*have 4"):
        Engine.from_config(cfg, progress=lambda message: None)


@pytest.mark.release
def test_train_draft_medusa_tiny_saves_loadable_heads_and_resumes(tmp_path, tiny_models):
    from spec_edge_training import train
    from spec_edge.graphs import weights

    out = tmp_path / "medusa"
    argv = train_draft_argv(tmp_path, tiny_models, out, "--kind", "medusa", "--medusa-heads", "3") + [
        "--save-every", "2", "--data-cache", str(tiny_models["root"] / "train_data.pt"), "--gen-batch", "4",
        "--dtype", "float32"]
    assert train.main(argv) == 0
    target_cfg = weights.load(str(tiny_models["target"]))[0]
    mcfg, _, draft_ids = medusa.load_heads(out, target_cfg)
    assert mcfg.n_heads == 3 and mcfg.draft_vocab_size == 64 and len(set(draft_ids)) == 64
    config = json.loads((out / "config.json").read_text())
    assert config["spec_edge"]["command"].startswith("spec-edge-train --kind medusa")
    argv[argv.index("--steps") + 1] = "5"
    assert train.main(argv) == 0
    assert torch.load(str(out / "train_state.pt"), weights_only=False)["step"] == 5  # resumed at 3
    assert json.loads((out / "train_log.json").read_text())["kind"] == "medusa"
    medusa.load_heads(out, target_cfg)
