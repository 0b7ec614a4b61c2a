"""Parallel drafting (P-EAGLE style): greedy speculative output == target-only greedy with a head (random
layers, an output layer fitted to the tiny target: accepted drafts) drafting all k tokens in one pass (through
the real ONNX Runtime graphs), the drafter's bookkeeping, sampling through the full-vocabulary q_draft, static
draft graphs that match the torch module, a saved head loads back identically, a head that does not fit is
refused, two heads configured together share the target's hidden outputs, and spec-edge-train --kind peagle
trains and resumes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError
from spec_edge.graphs import hidden
from spec_edge.heads import eagle3, peagle
from spec_edge_training import eagle3 as eagle3_training, peagle as peagle_training
from spec_edge import artifacts
from tiny import (PROMPTS, assert_greedy_equals_plain, assert_misfits_refused, assert_request_equals_plain,
                  assert_same_head, assert_sampling_follows_target, assert_sampling_uses_full_vocab_q, engine_with,
                  exported_graphs, fake_drafter, fitted_eagle3_lm_head, head_inputs, ort_session, train_draft_argv)

AUX = (0, 1, 2)  # the tiny target has 4 layers


def make_head(path, target_dir, *, seed=0, draft_vocab=200, aux=AUX, scale=20.0, fitted=True):
    """A P-EAGLE head for a tiny target, saved in the layout spec_edge loads: random layers, the output layer
    fitted to the target's own answers on the first draft row (tiny.fitted_eagle3_lm_head)."""
    target_cfg, state, draft_ids = head_inputs(target_dir, seed=seed, draft_vocab=draft_vocab, fitted=fitted)
    hcfg = eagle3_training.head_config_for(target_cfg, draft_vocab, aux)
    head_state = peagle_training.init_state(hcfg, state, draft_ids, seed=seed)
    for name, tensor in head_state.items():
        if name.startswith("midlayer.") and tensor.dim() == 2:
            head_state[name] = tensor * scale
    head_state["mask_hidden"] = head_state["mask_hidden"] * 50
    if fitted:
        head_state["lm_head.weight"] = fitted_eagle3_lm_head(peagle.build_module(hcfg, head_state).eval(), hcfg,
                                                             target_dir, draft_ids)
    peagle.save_head(path, hcfg, head_state, draft_ids, parallel_k=4, dtype="float32")
    return path, target_cfg


@pytest.fixture(scope="module")
def peagle_engine(tiny_models, tiny_cfg):
    head, _ = make_head(tiny_models["root"] / "peagle_a", tiny_models["target"])
    # the same target hidden outputs as test_eagle3's profile: its target graphs are reused
    return engine_with(tiny_cfg, {"runtime.profile": "tiny-eagle3", "speculative.peagle_head": str(head),
                                  "speculative.drafter": "peagle"})


@pytest.mark.parametrize("k", [1, 3, 4])
def test_peagle_greedy_equals_plain(peagle_engine, k):
    assert_greedy_equals_plain(peagle_engine, peagle_engine.drafter("peagle"), k)


def test_peagle_through_engine_request(peagle_engine):
    assert_request_equals_plain(peagle_engine, "peagle", 4)


class FakeHead:
    """Records what the drafter feeds the head; draft row i gives draft id i + 1 (target id 2(i + 1))."""
    max_context = 64
    draft_widths = [1, 3]
    held: tuple[int, ...] = ()

    def __init__(self):
        self.draft_ids = np.arange(10) * 2
        self.calls = []

    def ingest(self, tokens, hidden, position):
        self.calls.append(("ingest", list(tokens), hidden[:, 0].tolist(), position))

    def draft(self, token, hidden, position, k):
        self.calls.append(("draft", token, hidden[:, 0].tolist(), position, k))
        return np.eye(10, dtype=np.float32)[1:k + 1]


def test_peagle_drafter_bookkeeping():
    """Pairs (target hidden at p, token p+1) are fed once each at row p: the newest through the draft
    pass (one call for all k drafts), the ones before it through an ingest pass."""
    from spec_edge.runtime.drafters.peagle import PEagleDrafter

    head = FakeHead()
    drafter, sampler = fake_drafter(PEagleDrafter, head)
    seq = [5, 6, 7, 8]  # the prompt; the target's first token is pending at position 3
    draft = drafter.propose(seq, 3, sampler)
    assert head.calls == [("ingest", [6, 7], [0.0, 1.0], 0), ("draft", 8, [2.0], 2, 3)]
    assert draft.tokens == [2, 4, 6]
    head.calls.clear()
    seq += [draft.tokens[0], 9]  # one draft accepted, then the target's correction
    drafter.propose(seq, 3, sampler)
    assert head.calls == [("ingest", [draft.tokens[0]], [3.0], 3), ("draft", 9, [4.0], 4, 3)]
    head.calls.clear()
    seq += [11]  # a plain step: only the newest pair, no ingest
    drafter.propose(seq, 1, sampler)
    assert head.calls == [("draft", 11, [5.0], 5, 1)]
    with pytest.raises(ConfigError, match="k=4 has no P-EAGLE draft graph"):
        drafter.propose(seq + [1], 4, sampler)
    assert drafter.propose(seq + [1] * 60, 3, sampler) is None  # no room in the head's cache


def test_peagle_sampling_runs_with_full_vocab_q(peagle_engine):
    assert_sampling_uses_full_vocab_q(peagle_engine, peagle_engine.drafter("peagle"))


def test_peagle_sampling_keeps_target_distribution(peagle_engine):
    """Speculative sampling with the head's q_draft: the first three tokens follow the target's
    exact distribution (chi-square, fixed seeds)."""
    assert_sampling_follows_target(peagle_engine, peagle_engine.drafter("peagle"))


def test_peagle_graphs_static_and_match_torch(peagle_engine):
    head_dir, manifest = exported_graphs(peagle_engine, "peagle", 10)
    kinds = {(spec["kind"], spec["width"]) for spec in manifest["graphs"].values()}
    assert {("draft", k) for k in (1, 3, 4, 7)} <= kinds and ("ingest", 16) in kinds
    hcfg, state, _ = peagle.load_head(peagle_engine.cfg.speculative.peagle_head, peagle_engine.model_cfg)
    rng = np.random.default_rng(0)
    S = peagle_engine.cfg.graphs.max_context
    cache = rng.standard_normal((2, 1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    embed = np.asarray(peagle_engine.drafter("peagle").head.head.embed_table)  # under slot 0's view
    feeds = {"tokens": np.array([[17]]), "hidden": rng.standard_normal((1, 3 * hcfg.target_hidden_size)).astype(np.float32),
             "position": np.array([9]), "k_cache": cache[0], "v_cache": cache[1], "embed_table": embed}

    def run(stem, extra=()):
        return ort_session(head_dir / f"{stem}.onnx").run(None, dict(feeds, **dict(extra)))

    got = run("peagle_draft_4")
    kv = (1, hcfg.n_kv_heads, 4, hcfg.head_dim)
    assert [a.shape for a in got] == [(4, 200), kv, kv]
    module = peagle.build_module(hcfg, state, width=4).eval()
    with torch.no_grad():
        want = module(*(torch.from_numpy(np.array(feeds[name])) for name in
                        ("tokens", "hidden", "position", "k_cache", "v_cache", "embed_table")))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-4, atol=1e-4)
    # row 0 of the draft pass is the EAGLE-3 ingest of the same pair
    ingest = run("eagle3_ingest_1", {"last_index": np.array([0])})
    np.testing.assert_allclose(got[0][0], ingest[0][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1][:, :, :1], ingest[1], rtol=1e-4, atol=1e-4)


def test_peagle_train_forward_matches_the_draft_pass(tiny_models):
    """The training graph (real rows + mask rows of an anchor under one attention mask) computes the
    same states as ingesting the real pairs and then running the draft pass at the anchor."""
    path, target_cfg = make_head(tiny_models["root"] / "peagle_tf", tiny_models["target"], seed=2, fitted=False)
    hcfg, state, _ = peagle.load_head(path, target_cfg)
    k, n, anchor = 4, 7, 4
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(hcfg.target_vocab_size, hcfg.hidden_size, generator=gen)
    tokens = torch.randint(0, hcfg.target_vocab_size, (n + 1,), generator=gen)
    hid3 = torch.randn(n, 3 * hcfg.target_hidden_size, generator=gen)
    module = peagle.build_module(hcfg, state, width=k).eval()
    with torch.no_grad():
        normed = peagle_training.train_forward(module, hcfg, embed[tokens[1:]][None], hid3[None], torch.tensor([[anchor]]),
                                                k)[0]
        train_logits = module.lm_head(torch.cat((normed[anchor:anchor + 1], normed[n:]))).float()
        ingest = eagle3.build_module(hcfg, state).eval()
        S = 32
        cache = torch.zeros(2, 1, hcfg.n_kv_heads, S, hcfg.head_dim)
        _, k_new, v_new, _ = ingest(tokens[None, 1:anchor + 1], hid3[:anchor], torch.tensor([0]),
                                    torch.tensor([anchor - 1]), cache[0], cache[1], embed)
        cache[0][:, :, :anchor], cache[1][:, :, :anchor] = k_new, v_new
        logits, _, _ = module(tokens[None, anchor + 1:anchor + 2], hid3[anchor:anchor + 1], torch.tensor([anchor]),
                              cache[0], cache[1], embed)
    torch.testing.assert_close(train_logits, logits, rtol=1e-4, atol=1e-4)


def test_peagle_round_trip(tmp_path, tiny_models):
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=5, fitted=False)
    hcfg, state, draft_ids = peagle.load_head(path, target_cfg)
    peagle.save_head(tmp_path / "h2", hcfg, state, draft_ids, parallel_k=4, dtype="float32")
    assert_same_head((hcfg, state, draft_ids), peagle.load_head(tmp_path / "h2", target_cfg))
    assert {"mask_embed", "mask_hidden"} <= state.keys()
    raw = json.loads((path / "config.json").read_text())
    assert raw["parallel_drafting"] == {"k": 4} and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)


def test_bad_peagle_heads_refused(tmp_path, tiny_models):
    path, target_cfg = assert_misfits_refused(tmp_path, tiny_models, make_head, peagle.load_head)
    hcfg, state, draft_ids = eagle3.load_head(path, target_cfg)
    eagle3.save_head(tmp_path / "plain", hcfg, state, draft_ids, dtype="float32")  # an EAGLE-3 head
    with pytest.raises(ConfigError, match="not a parallel-drafting"):
        peagle.load_head(tmp_path / "plain", target_cfg)
    with pytest.raises(ConfigError, match="peagle_head"):
        from spec_edge.config import Config

        Config().replace(**{"speculative.drafter": "peagle"})


def test_two_heads_share_the_target_hidden_outputs(tiny_models, tiny_cfg):
    """P-EAGLE (layers 0, 1, 3) and Medusa (the final-norm state) configured together: the target
    returns the union of their hidden states and each drafter reads its own columns; both exact."""
    from test_medusa import make_heads

    head, _ = make_head(tiny_models["root"] / "peagle_b", tiny_models["target"], seed=3, aux=(0, 1, 3))
    heads, _ = make_heads(tiny_models["root"] / "medusa_b", tiny_models["target"], seed=3)
    cfg = tiny_cfg.replace(**{"runtime.profile": "tiny-two-heads", "speculative.peagle_head": str(head),
                              "speculative.medusa_head": str(heads), "speculative.drafter": "peagle",
                              "graphs.k_values": [3], "speculative.k": 3})
    assert hidden.target_hidden_layers(cfg) == (0, 1, 3, 4)
    engine = artifacts.engine(cfg, progress=lambda message: None)
    for name in ("peagle", "medusa"):
        assert_greedy_equals_plain(engine, engine.drafter(name), 3, PROMPTS[:3])


@pytest.mark.release
def test_train_draft_peagle_tiny_saves_loadable_head_and_resumes(tmp_path, tiny_models):
    from spec_edge_training import train
    from spec_edge.graphs import weights

    out = tmp_path / "peagle"
    argv = train_draft_argv(tmp_path, tiny_models, out, "--kind", "peagle", "--parallel-k", "3", "--anchors", "4") + [
        "--save-every", "2", "--data-cache", str(tiny_models["root"] / "train_data.pt"), "--gen-batch", "4",
        "--dtype", "float32"]
    assert train.main(argv) == 0
    target_cfg = weights.load(str(tiny_models["target"]))[0]
    hcfg, _, draft_ids = peagle.load_head(out, target_cfg)
    assert hcfg.draft_vocab_size == 64 and hcfg.aux_layers == AUX and len(set(draft_ids)) == 64
    config = json.loads((out / "config.json").read_text())
    assert config["parallel_drafting"] == {"k": 3}
    assert config["spec_edge"]["command"].startswith("spec-edge-train --kind peagle")
    argv[argv.index("--steps") + 1] = "5"
    assert train.main(argv) == 0
    assert torch.load(str(out / "train_state.pt"), weights_only=False)["step"] == 5  # resumed at 3
    peagle.load_head(out, target_cfg)
