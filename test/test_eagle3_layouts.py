"""Published EAGLE-3 heads load exactly as they were trained: test/fixtures/eagle3/<source>/config.json
are the sources' own config files (see the README there for where each comes from). Each must give
the RoPE theta and scaling its trainer used (never the target's), the layer ids in our convention
(layer outputs), and its norm flags; what the head graphs do not implement is refused naming the key.
Shrunken-shape copies (the same keys, tiny sizes, random tensors under each source's tensor names)
load through load_head, and a flag that changes the computation (norm_before_fc) is applied."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.device.presets import MODEL_PRESETS
from spec_edge.graphs import hidden
from spec_edge.heads import eagle3, export
from spec_edge.heads.eagle3_layouts import layout_of, parse_head_config

FIXTURES = Path(__file__).parent / "fixtures" / "eagle3"
LLAMA31 = MODEL_PRESETS["llama-3.1-8b"]  # 32 layers, rope_theta 500000 + Llama-3 scaling
QWEN3_MOE = ModelConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288, n_layers=94, n_heads=64,
                        n_kv_heads=4, head_dim=128, rope_theta=5000000.0, name="Qwen3-MoE (94 layers)")


def fixture(source: str) -> dict:
    return json.loads((FIXTURES / source / "config.json").read_text())


# (source, layout, theta, layer ids in our convention, eps, norm_before_residual)
LLAMA_SOURCES = [
    ("safeailab-llama31-8b", "safeailab", 10000.0, (1, 15, 28), 1e-5, False),
    ("speculators-converted-llama31-8b", "speculators", 10000.0, (1, 15, 28), 1e-5, False),
    ("modelopt-llama31-8b", "modelopt", 10000.0, (1, 15, 28), 1e-5, False),
]


@pytest.mark.parametrize("source,layout,theta,aux,eps,nbr", LLAMA_SOURCES)
def test_published_config_reads_as_trained(source, layout, theta, aux, eps, nbr):
    raw = fixture(source)
    hcfg = parse_head_config(raw, LLAMA31)
    assert layout_of(raw) == layout
    assert hcfg.rope_theta == theta != LLAMA31.rope_theta  # the head's own theta, not the target's 500000
    assert hcfg.rope_llama3 is None  # none of them was trained with the target's Llama-3 scaling
    assert hcfg.aux_layers == aux == hidden.default_aux_layers(32)
    assert (hcfg.rms_norm_eps, hcfg.norm_before_residual, hcfg.norm_before_fc) == (eps, nbr, False)
    assert (hcfg.hidden_size, hcfg.n_heads, hcfg.n_kv_heads, hcfg.head_dim) == (4096, 32, 8, 128)
    assert (hcfg.draft_vocab_size, hcfg.target_vocab_size) == (32000, 128256)


def test_speculators_08_config_refuses_what_it_cannot_run():
    raw = fixture("speculators-0.8-qwen3moe")
    with pytest.raises(ConfigError, match="transformer_layer_config.use_sliding_window is true"):
        parse_head_config(raw, QWEN3_MOE)
    runnable = copy.deepcopy(raw)
    runnable["transformer_layer_config"]["use_sliding_window"] = False
    hcfg = parse_head_config(runnable, QWEN3_MOE)
    assert hcfg.rope_theta == 5000000.0 and hcfg.rms_norm_eps == 1e-6
    assert (hcfg.norm_before_residual, hcfg.norm_before_fc, hcfg.norm_output, hcfg.fc_norm) == (True, True, True, False)
    assert hcfg.aux_layers == (1, 45, 90, 92)  # "before layer j" = output of layer j-1
    assert "input_norm.weight" in eagle3.head_parameter_names(hcfg)


def test_layer_id_conventions():
    raw = fixture("speculators-converted-llama31-8b")
    raw["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]  # speculators' own default: inputs of layers
    assert parse_head_config(raw, LLAMA31).aux_layers == (1, 15, 28)
    raw["eagle_aux_hidden_state_layer_ids"] = [1, 15, 28]  # Model Optimizer's output ids copied unchanged
    fixes = r"write \[2, 16, 29\] here .* eagle_config.eagle_aux_hidden_state_layer_ids \[0, 14, 27\]"
    with pytest.raises(ConfigError, match=fixes):
        parse_head_config(raw, LLAMA31)
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 15, 28]}  # the trainer's own ids are there
    assert parse_head_config(raw, LLAMA31).aux_layers == (1, 15, 28)
    raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [3, 15, 28]}
    with pytest.raises(ConfigError, match="two different layer sets"):
        parse_head_config(raw, LLAMA31)
    raw = fixture("speculators-converted-llama31-8b")
    raw["eagle_aux_hidden_state_layer_ids"] = [0, 16, 29]
    with pytest.raises(ConfigError, match="input of layer 0"):
        parse_head_config(raw, LLAMA31)
    modelopt = fixture("modelopt-llama31-8b")
    modelopt["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 16, 29]  # outputs: taken as they are
    assert parse_head_config(modelopt, LLAMA31).aux_layers == (2, 16, 29)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


def test_rope_parameters_and_scaling():
    raw = fixture("safeailab-llama31-8b")
    raw["rope_parameters"] = {"rope_theta": 500000.0, **LLAMA3_ROPE}  # transformers 5
    hcfg = parse_head_config(raw, LLAMA31)
    assert hcfg.rope_theta == 500000.0 and hcfg.rope_llama3 == (8.0, 1.0, 4.0, 8192)
    raw = fixture("safeailab-llama31-8b")
    raw["rope_theta"], raw["rope_scaling"] = 500000.0, dict(LLAMA3_ROPE)  # transformers 4
    assert parse_head_config(raw, LLAMA31).rope_llama3 == (8.0, 1.0, 4.0, 8192)
    raw["rope_parameters"] = {"rope_theta": 10000.0}
    with pytest.raises(ConfigError, match="two RoPE thetas"):
        parse_head_config(raw, LLAMA31)
    spec = fixture("speculators-converted-llama31-8b")
    spec["transformer_layer_config"]["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0}
    with pytest.raises(ConfigError, match="lacks"):
        parse_head_config(spec, LLAMA31)


@pytest.mark.parametrize("kind", ["linear", "dynamic", "yarn"])
@pytest.mark.parametrize("key", ["rope_scaling", "rope_parameters"])
def test_unimplemented_rope_scaling_is_refused_naming_it(kind, key):
    raw = fixture("safeailab-llama31-8b")
    raw[key] = {"type" if key == "rope_scaling" else "rope_type": kind, "factor": 2.0}
    with pytest.raises(ConfigError, match=f"{key}.rope_type '{kind}'"):
        parse_head_config(raw, LLAMA31)


def test_flags_that_change_the_computation():
    spec = fixture("speculators-converted-llama31-8b")
    del spec["norm_before_residual"]
    with pytest.raises(ConfigError, match="norm_before_residual"):
        parse_head_config(spec, LLAMA31)
    spec["norm_before_residual"] = True
    assert parse_head_config(spec, LLAMA31).norm_before_residual
    spec["transformer_layer_config"]["attention_bias"] = True
    with pytest.raises(ConfigError, match="transformer_layer_config.attention_bias"):
        parse_head_config(spec, LLAMA31)
    modelopt = fixture("modelopt-llama31-8b")
    modelopt["eagle_config"]["use_last_layernorm"] = False
    with pytest.raises(ConfigError, match="eagle_config.use_last_layernorm"):
        parse_head_config(modelopt, LLAMA31)


def test_target_graphs_read_the_same_conventions(tmp_path, tiny_models):
    """graphs/hidden.py (which hidden states the exported target returns) converts like the loader:
    speculators' "before layer j" ids, Model Optimizer's output ids, the default."""
    head = tmp_path / "head"
    head.mkdir()
    for raw, want in (({"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}, (0, 1, 3)),
                      ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}, (0, 2, 3)),
                      ({}, None)):
        (head / "config.json").write_text(json.dumps(raw))
        if want is None:  # no ids: the default for the tiny target's 4 layers, (1, 1, 0), is refused
            with pytest.raises(ConfigError, match="distinct and ascending"):
                hidden.head_hidden_layers(str(head), str(tiny_models["target"]))
        else:
            assert hidden.head_hidden_layers(str(head), str(tiny_models["target"])) == want


def test_committed_head_reads_as_before(tmp_path):
    """heads/smollm2-135m-eagle3 (our save_head format) parses to what it was trained with, and its
    exported graphs (head.json written before norm_before_fc existed) are still up to date."""
    raw = json.loads((Path(__file__).parents[1] / "heads" / "smollm2-135m-eagle3" / "config.json").read_text())
    hcfg = parse_head_config(raw, MODEL_PRESETS["smollm2-135m"])
    assert layout_of(raw) == "spec_edge"
    assert (hcfg.rope_theta, hcfg.aux_layers, hcfg.rope_llama3) == (100000.0, (1, 14, 26), None)
    assert (hcfg.norm_before_residual, hcfg.norm_before_fc, hcfg.draft_vocab_size) == (False, False, 4096)
    out = tmp_path
    old = {key: value for key, value in dataclasses.asdict(hcfg).items() if key != "norm_before_fc"}
    (out / "head.json").write_text(json.dumps(old))
    assert export._same_config(out, hcfg)
    assert not export._same_config(out, dataclasses.replace(hcfg, rope_theta=500000.0))


# ---------------------------------------------------------------------------------------------
# Shrunken copies that load weights

TINY = ModelConfig(vocab_size=320, hidden_size=64, intermediate_size=128, n_layers=8, n_heads=4, n_kv_heads=2,
                   head_dim=16, rope_theta=500000.0, rope_llama3=(8.0, 1.0, 4.0, 8192), name="tiny-8")
DRAFT_VOCAB = 48


def shrink(raw: dict) -> dict:
    """The same config with the tiny target's sizes (every key that is not a size kept as it is)."""
    raw = copy.deepcopy(raw)
    sizes = {"hidden_size": TINY.hidden_size, "intermediate_size": TINY.intermediate_size,
             "num_attention_heads": TINY.n_heads, "num_key_value_heads": TINY.n_kv_heads, "vocab_size": TINY.vocab_size}
    layer = raw.get("transformer_layer_config") or raw
    layer.update(sizes)
    if "head_dim" in layer:
        layer["head_dim"] = TINY.head_dim
    raw["draft_vocab_size"] = DRAFT_VOCAB
    return raw


def random_tensors(seed: int, prefix: str, norm_before_fc: bool = False, fc_norm: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    H, inter = TINY.hidden_size, TINY.intermediate_size
    q, kv = TINY.n_heads * TINY.head_dim, TINY.n_kv_heads * TINY.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    state = {"fc.weight": rand(H, 3 * H), "norm.weight": 1 + rand(H), "lm_head.weight": rand(DRAFT_VOCAB, H)}
    layer = {"hidden_norm.weight": 1 + rand(H), "input_layernorm.weight": 1 + rand(H),
             "post_attention_layernorm.weight": 1 + rand(H), "self_attn.q_proj.weight": rand(q, 2 * H),
             "self_attn.k_proj.weight": rand(kv, 2 * H), "self_attn.v_proj.weight": rand(kv, 2 * H),
             "self_attn.o_proj.weight": rand(H, q), "mlp.gate_proj.weight": rand(inter, H),
             "mlp.up_proj.weight": rand(inter, H), "mlp.down_proj.weight": rand(H, inter)}
    state.update({prefix + name: tensor for name, tensor in layer.items()})
    if norm_before_fc:
        state["input_norm.weight"] = 1 + rand(3 * H)
    if fc_norm:
        state.update({f"fc_norm.{i}.weight": 1 + rand(H) for i in range(3)})
    draft_ids = np.sort(np.random.default_rng(seed).choice(TINY.vocab_size, DRAFT_VOCAB, replace=False))
    state["d2t"] = torch.from_numpy(draft_ids - np.arange(DRAFT_VOCAB))
    t2d = np.zeros(TINY.vocab_size, dtype=bool)
    t2d[draft_ids] = True
    state["t2d"] = torch.from_numpy(t2d)
    return state


def write_head(path: Path, raw: dict, state: dict, torch_bin: bool = False) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(raw))
    if torch_bin:
        torch.save(state, str(path / "pytorch_model.bin"))
    else:
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("source,prefix,torch_bin", [("safeailab-llama31-8b", "midlayer.", True),
                                                     ("speculators-converted-llama31-8b", "layers.0.", False),
                                                     ("modelopt-llama31-8b", "layers.0.", False)])
def test_shrunken_published_heads_load(tmp_path, source, prefix, torch_bin):
    raw = shrink(fixture(source))
    if "eagle_config" in raw:
        raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # the 32-layer ids do not fit 8
    state = random_tensors(3, prefix)
    hcfg, loaded, draft_ids = eagle3.load_head(write_head(tmp_path / source, raw, state, torch_bin), TINY)
    assert hcfg.rope_theta == 10000.0 and hcfg.rope_llama3 is None  # not the tiny target's 500000 / llama3
    assert hcfg.aux_layers == hidden.default_aux_layers(8) == (1, 3, 4)
    assert draft_ids.tolist() == (np.arange(DRAFT_VOCAB) + state["d2t"].numpy()).tolist()
    assert torch.equal(loaded["midlayer.self_attn.q_proj.weight"], state[prefix + "self_attn.q_proj.weight"])
    module = eagle3.build_module(hcfg, loaded)
    want = 1.0 / (10000.0 ** (torch.arange(0, TINY.head_dim, 2, dtype=torch.float64) / TINY.head_dim))
    assert torch.allclose(module.inv_freq.double(), want)


def head_outputs(module, hcfg, hidden_in: torch.Tensor):
    S = 16
    cache = torch.zeros(1, hcfg.n_kv_heads, S, hcfg.head_dim)
    tokens = torch.tensor([[5, 9, 11]])
    embed = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return module(tokens, hidden_in, torch.tensor([0]), torch.tensor([2]), cache, cache.clone(), embed)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_speculators_norm_flags_are_applied(tmp_path):
    """norm_before_fc, fc_norm and norm_output each change what the head computes as speculators /
    SGLang define them: the same as a head without the flag fed the normed input (or normed output),
    and not the same as ignoring the flag. Then all three through the exported graph == torch."""
    raw = shrink(fixture("speculators-converted-llama31-8b"))
    raw.update(norm_before_fc=True, fc_norm=True, norm_output=True)
    state = random_tensors(4, "layers.0.", norm_before_fc=True, fc_norm=True)
    hcfg, loaded, _ = eagle3.load_head(write_head(tmp_path / "flags", raw, state), TINY)
    assert (hcfg.norm_before_fc, hcfg.fc_norm, hcfg.norm_output) == (True, True, True)
    eps = hcfg.rms_norm_eps
    hidden_in = torch.randn(3, 3 * TINY.hidden_size, generator=torch.Generator().manual_seed(2)) * 3
    got = head_outputs(eagle3.build_module(hcfg, loaded).eval(), hcfg, hidden_in)
    plain_cfg = dataclasses.replace(hcfg, norm_before_fc=False, fc_norm=False, norm_output=False)
    plain = eagle3.build_module(plain_cfg, loaded).eval()
    blocks = hidden_in.chunk(3, dim=-1)
    normed = torch.cat([rms(block, eps) * loaded[f"fc_norm.{i}.weight"] for i, block in enumerate(blocks)], dim=-1)
    normed = rms(normed, eps) * loaded["input_norm.weight"]
    want = head_outputs(plain, plain_cfg, normed)
    for g, w in zip(got[:3], want[:3]):
        assert torch.allclose(g, w, atol=1e-5)
    assert torch.allclose(got[3], rms(want[3], eps) * loaded["norm.weight"], atol=1e-5)  # norm_output
    ignored = head_outputs(plain, plain_cfg, hidden_in)
    assert not torch.allclose(got[0], ignored[0], atol=1e-3)  # the norms matter for this input
    for flag in ("norm_before_fc", "fc_norm"):  # each one alone changes the logits too
        one = dataclasses.replace(plain_cfg, **{flag: True})
        assert not torch.allclose(head_outputs(eagle3.build_module(one, loaded).eval(), one, hidden_in)[0],
                                  ignored[0], atol=1e-3)

    from spec_edge.graphs.export import WeightStore
    from spec_edge.runtime.backends.onnxruntime import cpu_session

    store = WeightStore(tmp_path / "weights.bin")
    export.export_head_graph(hcfg, loaded, tmp_path / "ingest.onnx", store, fused=True, width=3, max_context=16)
    store.close()
    session = cpu_session(str(tmp_path / "ingest.onnx"))
    cache = np.zeros((1, hcfg.n_kv_heads, 16, hcfg.head_dim), dtype=np.float32)
    embed = torch.randn(TINY.vocab_size, TINY.hidden_size, generator=torch.Generator().manual_seed(1)).numpy()
    values = [np.array([[5, 9, 11]]), hidden_in.numpy(), np.array([0]), np.array([2]), cache, cache.copy(), embed]
    feeds = dict(zip([i.name for i in session.get_inputs()], values))
    outs = session.run(None, feeds)
    for index in (0, 3):  # logits, the next step's hidden
        assert np.abs(outs[index] - got[index].numpy()).max() <= 1e-4 * max(1.0, np.abs(got[index].numpy()).max())


@pytest.mark.parametrize("flag", ["norm_before_fc", "fc_norm"])
def test_norm_tensors_without_their_flag_are_refused(tmp_path, flag):
    raw = shrink(fixture("speculators-converted-llama31-8b"))
    state = random_tensors(5, "layers.0.", **{flag: True})
    with pytest.raises(ConfigError, match=f"does not set {flag}: true"):
        eagle3.load_head(write_head(tmp_path / "h", raw, state), TINY)


def test_sglang_legacy_fc_norm_names_load(tmp_path):
    raw = shrink(fixture("speculators-converted-llama31-8b"))
    raw["fc_norm"] = True
    state = random_tensors(6, "layers.0.", fc_norm=True)
    for i, name in enumerate(("low", "mid", "high")):
        state[f"aux_norm_{name}.weight"] = state.pop(f"fc_norm.{i}.weight")
    hcfg, loaded, _ = eagle3.load_head(write_head(tmp_path / "h", raw, state), TINY)
    assert hcfg.fc_norm and torch.equal(loaded["fc_norm.2.weight"], state["aux_norm_high.weight"])
