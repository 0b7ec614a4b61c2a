"""Parallel drafting (P-EAGLE style): greedy speculative output == target-only greedy with a
random-weight head drafting all k tokens in one pass (through the real ONNX Runtime graphs), the
drafter's bookkeeping, sampling through the full-vocabulary q_draft, static draft graphs that match
the torch module, a saved head loads back identically, a head that does not fit is refused, two
heads configured together share the target's hidden outputs, and train-draft --kind peagle trains
and resumes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spec_edge import eagle3, export, peagle, speculative
from spec_edge.config import ConfigError
from spec_edge.engine import Engine, GenerateRequest
from spec_edge.sampling import SamplingParams

PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the"]
AUX = (0, 1, 2)  # the tiny target has 4 layers


def make_head(path, target_dir, *, seed=0, draft_vocab=200, aux=AUX, scale=20.0):
    """A random-weight P-EAGLE head for a tiny target, saved in the layout spec_edge loads."""
    from safetensors.torch import load_file

    from spec_edge import weights

    target_cfg, _, _ = weights.load(str(target_dir))
    state = load_file(str(target_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    draft_ids = np.sort(rng.choice(target_cfg.vocab_size, draft_vocab, replace=False))
    hcfg = eagle3.head_config_for(target_cfg, draft_vocab, aux)
    head_state = peagle.init_state(hcfg, state, draft_ids, seed=seed)
    for name, tensor in head_state.items():
        if name.startswith("midlayer.") and tensor.dim() == 2:
            head_state[name] = tensor * scale
    head_state["mask_hidden"] = head_state["mask_hidden"] * 50
    peagle.save_head(path, hcfg, head_state, draft_ids, parallel_k=4, dtype="float32")
    return path, target_cfg


@pytest.fixture(scope="module")
def peagle_engine(tiny_models, tiny_cfg):
    head, _ = make_head(tiny_models["root"] / "peagle_a", tiny_models["target"])
    # the same target hidden outputs as test_eagle3's profile: its target graphs are reused
    cfg = tiny_cfg.replace(**{"runtime.profile": "tiny-eagle3", "speculative.peagle_head": str(head),
                              "speculative.drafter": "peagle"})
    return Engine.from_config(cfg, progress=lambda message: None)


def plain(engine, prompt_ids, max_new=40):
    return speculative.generate(engine.target, prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids)[0]


@pytest.mark.parametrize("k", [1, 3, 4])
def test_peagle_greedy_equals_plain(peagle_engine, k):
    drafter = peagle_engine._drafter("peagle")
    for prompt in PROMPTS:
        ids = peagle_engine.tokenizer.encode(prompt)
        want = plain(peagle_engine, ids)
        got, _, stats = speculative.generate(peagle_engine.target, ids, max_new_tokens=40,
                                             eos_ids=peagle_engine.eos_ids, drafter=drafter, k=k)
        assert got == want, f"k={k} prompt={prompt!r}"
        assert stats.verify_calls > 0


def test_peagle_through_engine_request(peagle_engine):
    spec = peagle_engine.generate(GenerateRequest(prompt="Move the arm", max_new_tokens=30, drafter="peagle", k=4))
    base = peagle_engine.generate(GenerateRequest(prompt="Move the arm", max_new_tokens=30, speculate=False))
    assert spec.token_ids == base.token_ids
    assert spec.stats.drafter == "peagle" and spec.stats.drafted > 0


class FakeHead:
    """Records what the drafter feeds the head; draft row i gives draft id i + 1 (target id 2(i + 1))."""
    max_context = 64
    draft_widths = [1, 3]

    def __init__(self):
        self.draft_ids = np.arange(10) * 2
        self.calls = []

    def ingest(self, tokens, hidden, position):
        self.calls.append(("ingest", list(tokens), hidden[:, 0].tolist(), position))

    def draft(self, token, hidden, position, k):
        self.calls.append(("draft", token, hidden[:, 0].tolist(), position, k))
        return np.eye(10, dtype=np.float32)[1:k + 1]


class FakeTarget:
    vocab_size = 20

    def hidden_states(self, start, stop):
        return np.arange(start, stop, dtype=np.float32)[:, None] * np.ones((1, 3))


def test_peagle_drafter_bookkeeping():
    """Pairs (target hidden at p, token p+1) are fed once each at row p: the newest through the draft
    pass (one call for all k drafts), the ones before it through an ingest pass."""
    from spec_edge.drafters.peagle import PEagleDrafter
    from spec_edge.speculative import Sampler

    head = FakeHead()
    drafter = PEagleDrafter(FakeTarget(), head)
    sampler = Sampler(SamplingParams())
    prompt = [5, 6, 7]
    drafter.start(prompt)
    seq = prompt + [8]  # the target's first token is pending at position 3
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
    drafter = peagle_engine._drafter("peagle")
    ids = peagle_engine.tokenizer.encode("Move the arm")
    seen = []

    class Spy:
        name = "spy"

        def start(self, p):
            drafter.start(p)

        def propose(self, seq, k, sampler):
            draft = drafter.propose(seq, k, sampler)
            if draft is not None:
                seen.append(draft)
            return draft

        def observe(self, a, b):
            pass

    out, _, _ = speculative.generate(peagle_engine.target, ids, max_new_tokens=30, eos_ids=(),
                                     sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=7,
                                     drafter=Spy(), k=4)
    assert len(out) == 30 and seen
    V = peagle_engine.target.vocab_size
    outside = np.setdiff1d(np.arange(V), drafter.draft_ids)
    for draft in seen:
        assert draft.q_draft.shape == (4, V)
        assert np.allclose(draft.q_draft.sum(axis=1), 1.0)
        assert np.all(draft.q_draft[:, outside] == 0)
        for i, token in enumerate(draft.tokens):
            assert draft.q_draft[i, token] > 0


def test_peagle_graphs_static_and_match_torch(peagle_engine):
    import onnx
    import onnxruntime as ort

    head_dir = export.artifact_dir(peagle_engine.cfg, "peagle")
    manifest = json.loads((head_dir / "manifest.json").read_text())
    kinds = {(spec["kind"], spec["width"]) for spec in manifest["graphs"].values()}
    assert {("draft", k) for k in (1, 3, 4, 7)} <= kinds and ("ingest", 16) in kinds
    for stem in manifest["graphs"]:
        checked, dynamic = export.dynamic_tensors(onnx.load(str(head_dir / f"{stem}.onnx"), load_external_data=False))
        assert checked > 10 and not dynamic, stem
    hcfg, state, _ = peagle.load_head(peagle_engine.cfg.speculative.peagle_head, peagle_engine.model_cfg)
    rng = np.random.default_rng(0)
    S = peagle_engine.cfg.graphs.max_context
    cache = rng.standard_normal((2, 1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    embed = np.asarray(peagle_engine._drafter("peagle").head.embed_table)
    feeds = {"tokens": np.array([[17]]), "hidden": rng.standard_normal((1, 3 * hcfg.target_hidden_size)).astype(np.float32),
             "position": np.array([9]), "k_cache": cache[0], "v_cache": cache[1], "embed_table": embed}
    options = ort.SessionOptions()
    options.use_per_session_threads = False  # the process shares one global pool (OrtRunner)

    def run(stem, extra=()):
        session = ort.InferenceSession(str(head_dir / f"{stem}.onnx"), options, providers=["CPUExecutionProvider"])
        return session.run(None, dict(feeds, **dict(extra)))

    got = run("peagle_draft_4")
    kv = (1, hcfg.n_kv_heads, 4, hcfg.head_dim)
    assert [a.shape for a in got] == [(4, 200), kv, kv]
    module = peagle.build_module(hcfg, state, width=4).eval()
    with torch.no_grad():
        want = module(*(torch.from_numpy(np.asarray(feeds[name])) for name in
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
    path, target_cfg = make_head(tiny_models["root"] / "peagle_tf", tiny_models["target"], seed=2)
    hcfg, state, _ = peagle.load_head(path, target_cfg)
    k, n, anchor = 4, 7, 4
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(hcfg.target_vocab_size, hcfg.hidden_size, generator=gen)
    tokens = torch.randint(0, hcfg.target_vocab_size, (n + 1,), generator=gen)
    hid3 = torch.randn(n, 3 * hcfg.target_hidden_size, generator=gen)
    module = peagle.build_module(hcfg, state, width=k).eval()
    with torch.no_grad():
        normed = module.train_forward(embed[tokens[1:]][None], hid3[None], torch.tensor([[anchor]]), k)[0]
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
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=5)
    hcfg, state, draft_ids = peagle.load_head(path, target_cfg)
    peagle.save_head(tmp_path / "h2", hcfg, state, draft_ids, parallel_k=4, dtype="float32")
    hcfg2, state2, draft_ids2 = peagle.load_head(tmp_path / "h2", target_cfg)
    assert hcfg2 == hcfg and np.array_equal(draft_ids, draft_ids2)
    assert state.keys() == state2.keys() and {"mask_embed", "mask_hidden"} <= state.keys()
    for name in state:
        assert torch.equal(state[name], state2[name]), name
    raw = json.loads((path / "config.json").read_text())
    assert raw["parallel_drafting"] == {"k": 4} and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)


def test_bad_peagle_heads_refused(tmp_path, tiny_models):
    from tiny import make_checkpoint

    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=7)
    wide = make_checkpoint(tmp_path / "wide", seed=9, hidden=96, heads=4, kv_heads=2)
    wide_head, _ = make_head(tmp_path / "wide_head", wide)
    with pytest.raises(ConfigError, match="hidden size"):
        peagle.load_head(wide_head, target_cfg)
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
    assert export.target_hidden_layers(cfg) == (0, 1, 3, 4)
    engine = Engine.from_config(cfg, progress=lambda message: None)
    for name in ("peagle", "medusa"):
        drafter = engine._drafter(name)
        for prompt in PROMPTS[:3]:
            ids = engine.tokenizer.encode(prompt)
            got, _, stats = speculative.generate(engine.target, ids, max_new_tokens=40, eos_ids=engine.eos_ids,
                                                 drafter=drafter, k=3)
            assert got == plain(engine, ids), (name, prompt)
            assert stats.verify_calls > 0


def test_train_draft_peagle_tiny_saves_loadable_head_and_resumes(tmp_path, tiny_models):
    from spec_edge import cli, weights

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Move the arm to the left\nNavigate to the kitchen\ndef add(a, b):\nReport the battery\n")
    out = tmp_path / "peagle"
    argv = ["train-draft", "--kind", "peagle", "--parallel-k", "3", "--anchors", "4",
            "--target", str(tiny_models["target"]), "--out", str(out), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--draft-vocab", "64", "--aux-layers", "0", "1", "2", "--batch", "2",
            "--steps", "3", "--save-every", "2", "--data-cache", str(tiny_models["root"] / "train_data.pt"),
            "--gen-batch", "4", "--dtype", "float32"]
    assert cli.main(argv) == 0
    target_cfg = weights.load(str(tiny_models["target"]))[0]
    hcfg, _, draft_ids = peagle.load_head(out, target_cfg)
    assert hcfg.draft_vocab_size == 64 and hcfg.aux_layers == AUX and len(set(draft_ids)) == 64
    config = json.loads((out / "config.json").read_text())
    assert config["parallel_drafting"] == {"k": 3}
    assert config["spec_edge"]["command"].startswith("spec-edge train-draft --kind peagle")
    argv[argv.index("--steps") + 1] = "5"
    assert cli.main(argv) == 0
    assert torch.load(str(out / "train_state.pt"), weights_only=False)["step"] == 5  # resumed at 3
    peagle.load_head(out, target_cfg)
