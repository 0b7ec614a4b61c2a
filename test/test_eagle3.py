"""EAGLE-3 heads: greedy speculative output == target-only greedy with a head drafting, sampling
runs through the full-vocabulary q_draft, the head graphs are static and match the torch module,
a saved head loads back identically, and a head made for another model is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tiny import TINY_K_VALUES
from spec_edge import eagle3, export, speculative
from spec_edge.config import ConfigError
from spec_edge.engine import Engine
from spec_edge.sampling import SamplingParams

PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the"]
AUX = (0, 1, 2)  # the tiny target has 4 layers: EAGLE-3's default (1, L/2-1, L-4) would collide


def make_head(path, target_dir, *, seed=0, draft_vocab=200, aux=AUX, scale=1.0):
    """A random-weight head for a tiny target, saved in the layout spec_edge loads."""
    from safetensors.torch import load_file

    from spec_edge import weights

    target_cfg, _, _ = weights.load(str(target_dir))
    state = load_file(str(target_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    draft_ids = np.sort(rng.choice(target_cfg.vocab_size, draft_vocab, replace=False))
    hcfg = eagle3.head_config_for(target_cfg, draft_vocab, aux)
    head_state = eagle3.init_state(hcfg, state, draft_ids, seed=seed)
    if scale != 1.0:
        for name, tensor in head_state.items():
            if name.startswith("midlayer.") and tensor.dim() == 2:
                head_state[name] = tensor * scale
    eagle3.save_head(path, hcfg, head_state, draft_ids, dtype="float32")
    return path, target_cfg


@pytest.fixture(scope="module")
def head_engine(tiny_models, tiny_cfg):
    head, _ = make_head(tiny_models["root"] / "head_a", tiny_models["target"], scale=20.0)
    cfg = tiny_cfg.replace(**{"runtime.profile": "tiny-eagle3", "speculative.eagle3_head": str(head),
                              "speculative.drafter": "eagle3"})
    return Engine.from_config(cfg, progress=lambda message: None)


def plain(engine, prompt_ids, max_new=40):
    return speculative.generate(engine.target, prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids)[0]


@pytest.mark.parametrize("k", TINY_K_VALUES)
def test_eagle3_greedy_equals_plain(head_engine, k):
    drafter = head_engine._drafter("eagle3")
    for prompt in PROMPTS:
        ids = head_engine.tokenizer.encode(prompt)
        want = plain(head_engine, ids)
        got, _, stats = speculative.generate(head_engine.target, ids, max_new_tokens=40,
                                             eos_ids=head_engine.eos_ids, drafter=drafter, k=k)
        assert got == want, f"k={k} prompt={prompt!r}"
        assert stats.verify_calls > 0


def test_eagle3_through_engine_request(head_engine):
    from spec_edge.engine import GenerateRequest

    spec = head_engine.generate(GenerateRequest(prompt="Move the arm", max_new_tokens=30, drafter="eagle3", k=4))
    base = head_engine.generate(GenerateRequest(prompt="Move the arm", max_new_tokens=30, speculate=False))
    assert spec.token_ids == base.token_ids
    assert spec.stats.drafter == "eagle3" and spec.stats.drafted > 0


def test_eagle3_greedy_second_head_k3(tiny_models, tiny_cfg):
    """Another head (full draft vocabulary, other layers, k=3 only): still exactly plain greedy."""
    head, _ = make_head(tiny_models["root"] / "head_b", tiny_models["target"], seed=3, draft_vocab=320, aux=(0, 1, 3))
    cfg = tiny_cfg.replace(**{"runtime.profile": "tiny-eagle3b", "speculative.eagle3_head": str(head),
                              "speculative.drafter": "eagle3", "graphs.k_values": [3], "speculative.k": 3})
    engine = Engine.from_config(cfg, progress=lambda message: None)
    drafter = engine._drafter("eagle3")
    for prompt in PROMPTS:
        ids = engine.tokenizer.encode(prompt)
        want = plain(engine, ids, 60)
        got, _, stats = speculative.generate(engine.target, ids, max_new_tokens=60, eos_ids=engine.eos_ids,
                                             drafter=drafter, k=3)
        assert got == want


class FakeHead:
    """Records what the drafter feeds the head; drafts draft-id 1, 2, 3 ... (target ids via map)."""
    max_context = 64

    def __init__(self):
        self.draft_ids = np.arange(10) * 2  # draft id d -> target id 2d
        self.calls = []

    def ingest(self, tokens, hidden, position):
        self.calls.append(("ingest", list(tokens), hidden[:, 0].tolist(), position))
        return np.eye(10, dtype=np.float32)[1], np.zeros((1, 4), np.float32)

    def step(self, token, hidden, position):
        self.calls.append(("step", token, position))
        return np.eye(10, dtype=np.float32)[len(self.calls) % 10], hidden


class FakeTarget:
    vocab_size = 20

    def hidden_states(self, start, stop):
        return np.arange(start, stop, dtype=np.float32)[:, None] * np.ones((1, 3))


def test_eagle3_drafter_bookkeeping():
    """Pairs (target hidden at p, token p+1) are fed once each, at position p; after a verify that
    accepted n drafts exactly the n + 1 new pairs are ingested; draft steps follow at last+1 ...."""
    from spec_edge.drafters.eagle3 import Eagle3Drafter
    from spec_edge.speculative import Sampler

    head = FakeHead()
    drafter = Eagle3Drafter(FakeTarget(), head)
    sampler = Sampler(SamplingParams())
    prompt = [5, 6, 7]
    drafter.start(prompt)
    seq = prompt + [8]  # the target's first token is pending at position 3
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
    drafter = head_engine._drafter("eagle3")
    ids = head_engine.tokenizer.encode("Move the arm")
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

    out, _, stats = speculative.generate(head_engine.target, ids, max_new_tokens=30, eos_ids=(),
                                         sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=7,
                                         drafter=Spy(), k=4)
    assert len(out) == 30 and seen
    for draft in seen:
        assert draft.q_draft.shape == (4, head_engine.target.vocab_size)
        assert np.allclose(draft.q_draft.sum(axis=1), 1.0)
        outside = np.setdiff1d(np.arange(head_engine.target.vocab_size), drafter.draft_ids)
        assert np.all(draft.q_draft[:, outside] == 0)
        for i, token in enumerate(draft.tokens):
            assert draft.q_draft[i, token] > 0


def test_head_graphs_static_and_match_torch(head_engine, tiny_models):
    import onnx
    import onnxruntime as ort

    head_dir = export.artifact_dir(head_engine.cfg, "eagle3")
    manifest = json.loads((head_dir / "manifest.json").read_text())
    widths = {spec["width"] for spec in manifest["graphs"].values() if spec["kind"] == "ingest"}
    assert widths == {1, 16} | {k + 1 for k in TINY_K_VALUES}
    for stem in manifest["graphs"]:
        checked, dynamic = export.dynamic_tensors(onnx.load(str(head_dir / f"{stem}.onnx"), load_external_data=False))
        assert checked > 10 and not dynamic, stem
    # ONNX == torch on the saved head, for one ingest width
    hcfg, state, _ = eagle3.load_head(head_engine.cfg.speculative.eagle3_head, head_engine.model_cfg)
    module = eagle3.build_module(hcfg, state).eval()
    rng = np.random.default_rng(0)
    width, S = 5, head_engine.cfg.graphs.max_context
    tokens = rng.integers(0, hcfg.target_vocab_size, (1, width))
    hidden = rng.standard_normal((width, 3 * hcfg.target_hidden_size)).astype(np.float32)
    k_cache = rng.standard_normal((1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    v_cache = rng.standard_normal((1, hcfg.n_kv_heads, S, hcfg.head_dim)).astype(np.float32)
    embed = head_engine._drafter("eagle3").head.embed_table
    feeds = {"tokens": tokens, "hidden": hidden, "position": np.array([7]), "last_index": np.array([3]),
             "k_cache": k_cache, "v_cache": v_cache, "embed_table": np.asarray(embed)}
    options = ort.SessionOptions()
    options.use_per_session_threads = False  # the process shares one global pool (OrtRunner)
    session = ort.InferenceSession(str(head_dir / f"eagle3_ingest_{width}.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)
    with torch.no_grad():
        want = module(*(torch.from_numpy(np.asarray(feeds[name])) for name in
                        ("tokens", "hidden", "position", "last_index", "k_cache", "v_cache", "embed_table")))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-4, atol=1e-4)


def test_head_round_trip(tmp_path, tiny_models):
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=5)
    hcfg, state, draft_ids = eagle3.load_head(path, target_cfg)
    eagle3.save_head(tmp_path / "h2", hcfg, state, draft_ids, dtype="float32")
    hcfg2, state2, draft_ids2 = eagle3.load_head(tmp_path / "h2", target_cfg)
    assert hcfg2 == hcfg and np.array_equal(draft_ids, draft_ids2)
    assert state.keys() == state2.keys()
    for name in state:
        assert torch.equal(state[name], state2[name]), name
    raw = json.loads((path / "config.json").read_text())
    assert raw["draft_vocab_size"] == 200 and raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(AUX)


def test_published_layout_names_load(tmp_path, tiny_models):
    """SafeAILab (pytorch_model.bin, no layer ids) and NVIDIA-style (layers.0. prefix) names load."""
    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=6)
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
    assert hcfg.aux_layers == eagle3.default_aux_layers(4)
    raw_safeai["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]  # vLLM indexing: outputs of 0, 1, 2
    (safeai / "config.json").write_text(json.dumps(raw_safeai))
    assert eagle3.load_head(safeai, target_cfg)[0].aux_layers == (0, 1, 2)


def test_bad_heads_refused(tmp_path, tiny_models):
    from tiny import make_checkpoint

    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=7)
    other = make_checkpoint(tmp_path / "wide", seed=9, hidden=96, heads=4, kv_heads=2)
    other_head, other_cfg = make_head(tmp_path / "wide_head", other)
    with pytest.raises(ConfigError, match="hidden size"):
        eagle3.load_head(other_head, target_cfg)
    deep = make_checkpoint(tmp_path / "deep", seed=9, n_layers=6)
    from spec_edge import weights

    deep_cfg = weights.load(str(deep))[0]
    with pytest.raises(ConfigError, match="4-layer target"):
        eagle3.load_head(path, deep_cfg)
    raw = json.loads((path / "config.json").read_text())
    raw["vocab_size"] = 999
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="vocabulary"):
        eagle3.load_head(path, target_cfg)
    raw["vocab_size"] = target_cfg.vocab_size
    raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 2, 9]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="auxiliary layers"):
        eagle3.load_head(path, target_cfg)
    with pytest.raises(ConfigError, match="config.json"):
        eagle3.load_head(tmp_path / "nothing", target_cfg)


def test_eagle3_without_head_is_a_clear_error(tiny_cfg):
    with pytest.raises(ConfigError, match="eagle3_head"):
        tiny_cfg.replace(**{"speculative.drafter": "eagle3"})


def test_train_draft_tiny_saves_loadable_head_and_resumes(tmp_path, tiny_models):
    """`spec-edge train-draft` end to end on the tiny target (a few steps): a head folder that loads
    against the target, and a second run that resumes from the first run's step."""
    from spec_edge import cli, weights

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Move the arm to the left\nNavigate to the kitchen\ndef add(a, b):\nReport the battery\n")
    out = tmp_path / "head"
    argv = ["train-draft", "--target", str(tiny_models["target"]), "--out", str(out), "--prompts", str(prompts),
            "--max-new-tokens", "12", "--draft-vocab", "64", "--aux-layers", "0", "1", "2", "--batch", "2",
            "--steps", "3", "--dtype", "float32"]
    assert cli.main(argv) == 0
    target_cfg = weights.load(str(tiny_models["target"]))[0]
    hcfg, state, draft_ids = eagle3.load_head(out, target_cfg)
    assert hcfg.draft_vocab_size == 64 and hcfg.aux_layers == (0, 1, 2) and len(set(draft_ids)) == 64
    assert json.loads((out / "config.json").read_text())["spec_edge"]["trained_steps"] == 3
    argv[argv.index("--steps") + 1] = "5"
    assert cli.main(argv) == 0
    assert torch.load(str(out / "train_state.pt"), weights_only=False)["step"] == 5  # resumed at 3
    eagle3.load_head(out, target_cfg)  # the kept (best held-out) checkpoint still loads
