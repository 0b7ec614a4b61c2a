"""EAGLE-3 draft heads: the config, the checkpoint layouts, the torch module (heads/export.py
exports its static graphs; the layer ids it reads are graphs/hidden.py's).

A head drafts from three hidden states of the target (a low, a middle and a high layer):

    fc:        (T, 3 * Ht) -> (T, H)             fuses the target's hidden states
    midlayer:  one decoder layer over [input_layernorm(embed(x)) ; hidden_norm(h)] (2H into q/k/v),
               residual on h, its own KV cache (1, Hkv, S, D)
    norm, lm_head over the reduced draft vocabulary (Vd); d2t maps a draft id to a target id:
               target_id = draft_id + d2t[draft_id]  (SafeAILab's offset form)

Pairing (as in EAGLE): the head row at position p holds (target hidden at p, token p+1) and predicts
token p+2. Its output hidden h' (before the final norm; after it for speculators' norm_output) is the
next draft step's input hidden, which then skips fc. So k drafts cost one ingest pass (the verified
pairs, width <= k+1) + k-1 [1, 1] steps.

Graphs (heads/export.py; all static, S = max context): an ingest graph per width W and a
[1, 1] draft step. The token embedding table is a graph *input* bound to the target's own embedding
(a memory map of the target's weights.bin), so the head costs no second copy of the V x H table.

The published checkpoint layouts (SafeAILab, Model Optimizer, vLLM speculators, ours) and what each
config key means are heads/eagle3_layouts.py's; HeadConfig lives there and is re-exported here.
Saved heads (spec-edge-train) use the SafeAILab tensor names and the NVIDIA-style eagle_config.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.heads import head_folder
from spec_edge.heads.eagle3_layouts import HeadConfig, parse_head_config, read_tensors

__all__ = ["HEAD_FORMAT", "HeadConfig", "build_module", "check_head", "head_class", "head_fingerprint",
           "head_parameter_names", "load_head", "parse_head_config", "save_head"]

HEAD_FORMAT = 1


# ---------------------------------------------------------------------------------------------
# Checkpoint reading / writing

def check_head(hcfg: HeadConfig, state: dict, target: ModelConfig, where: str = "EAGLE-3 head") -> None:
    """Refuse a head that does not fit the target, naming the mismatch."""
    problems = []
    fc = state.get("fc.weight")
    if fc is None:
        problems.append("it has no fc.weight (not an EAGLE-3 head: EAGLE-1/2 heads are not supported)")
    else:
        if fc.shape[1] != 3 * target.hidden_size:
            problems.append(f"fc.weight takes {fc.shape[1]} inputs but the target's hidden size is "
                            f"{target.hidden_size} (3 x {target.hidden_size} = {3 * target.hidden_size}): "
                            f"the head was trained for another model")
        if fc.shape[0] != hcfg.hidden_size:
            problems.append(f"fc.weight gives {fc.shape[0]} outputs but config hidden_size is {hcfg.hidden_size}")
    if not hcfg.has_embedding and hcfg.hidden_size != target.hidden_size:
        problems.append(f"head hidden size {hcfg.hidden_size} differs from the target's {target.hidden_size} "
                        f"and the head has no embedding of its own")
    problems += head_folder.target_problems(hcfg.target_vocab_size, hcfg.target_layers, target)
    bad = [i for i in hcfg.aux_layers if not 0 <= i < target.n_layers]
    if bad or len(hcfg.aux_layers) != 3:
        problems.append(f"auxiliary layers {list(hcfg.aux_layers)} do not fit a {target.n_layers}-layer target "
                        f"(need three layer indices in [0, {target.n_layers}))")
    lm_head = state.get("lm_head.weight")
    if lm_head is None:
        problems.append("it has no lm_head.weight")
    elif lm_head.shape[0] != hcfg.draft_vocab_size:
        problems.append(f"lm_head has {lm_head.shape[0]} rows but draft_vocab_size is {hcfg.draft_vocab_size}")
    problems += head_folder.d2t_problems(state.get("d2t"), hcfg.draft_vocab_size, hcfg.target_vocab_size,
                                         target.vocab_size, earlier=bool(problems))
    for flag, prefix, what in (("norm_before_fc", "input_norm.", "an RMSNorm before fc"),
                               ("fc_norm", "fc_norm.", "an RMSNorm per target layer before fc")):
        if any(name.startswith(prefix) for name in state) and not getattr(hcfg, flag):
            problems.append(f"it has {prefix}weight ({what}) but config.json does not set {flag}: true")
    wanted = [name for name in head_parameter_names(hcfg) if name not in state]
    if wanted and not problems:
        problems.append(f"tensors missing: {wanted[:4]}")
    head_folder.refuse(problems, where, target)


def head_parameter_names(hcfg: HeadConfig) -> list[str]:
    names = ["fc.weight", "norm.weight", "lm_head.weight"]
    names += [f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")]
    names += [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
    names += [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    names += ["input_norm.weight"] if hcfg.norm_before_fc else []
    return names + ([f"fc_norm.{i}.weight" for i in range(len(hcfg.aux_layers))] if hcfg.fc_norm else [])


def load_head(path: str | Path, target: ModelConfig) -> tuple[HeadConfig, dict, np.ndarray]:
    """(config, float32 state dict, draft-to-target id map (Vd,) int64) of a head folder, checked
    against the target."""
    path = Path(path).expanduser()
    raw = head_folder.read_config(path, "EAGLE-3 head", "spec-edge-train")
    state = read_tensors(path)
    try:
        hcfg = parse_head_config(raw, target)
    except ConfigError as error:
        raise ConfigError(f"EAGLE-3 head '{path}': {error}") from None
    if "embed_tokens.weight" in state:
        hcfg = dataclasses.replace(hcfg, has_embedding=True)
    check_head(hcfg, state, target, f"EAGLE-3 head '{path}'")
    draft_ids = head_folder.draft_ids_of(state.get("d2t"), hcfg.draft_vocab_size)
    float_state = {name: tensor.float() for name, tensor in state.items()
                   if name not in ("d2t", "t2d") and tensor.is_floating_point()}
    return hcfg, float_state, draft_ids


def head_fingerprint(path: str | Path) -> str:
    return head_folder.fingerprint(path, (".json", ".safetensors", ".bin"), ("train_state.json",))


def save_head(path: str | Path, hcfg: HeadConfig, state: dict, draft_ids: np.ndarray,
              dtype: str = "float16", extra: dict | None = None, more_tensors: tuple[str, ...] = (),
              more_config: dict | None = None) -> Path:
    """Write a head folder in the SafeAILab tensor layout (+ NVIDIA-style eagle_config);
    more_tensors / more_config: what a variant (the P-EAGLE head) adds."""
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hcfg.hidden_size, "intermediate_size": hcfg.intermediate_size,
        "num_attention_heads": hcfg.n_heads, "num_key_value_heads": hcfg.n_kv_heads, "head_dim": hcfg.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": hcfg.rms_norm_eps, "rope_theta": hcfg.rope_theta,
        "rope_scaling": None if hcfg.rope_llama3 is None else dict(
            rope_type="llama3", factor=hcfg.rope_llama3[0], low_freq_factor=hcfg.rope_llama3[1],
            high_freq_factor=hcfg.rope_llama3[2], original_max_position_embeddings=hcfg.rope_llama3[3]),
        "vocab_size": hcfg.target_vocab_size, "draft_vocab_size": hcfg.draft_vocab_size,
        "target_hidden_size": hcfg.target_hidden_size, "target_num_hidden_layers": hcfg.target_layers,
        "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(hcfg.aux_layers), "use_aux_hidden_state": True},
        "norm_before_residual": hcfg.norm_before_residual, "norm_before_fc": hcfg.norm_before_fc,
        "fc_norm": hcfg.fc_norm, "norm_output": hcfg.norm_output,
        "spec_edge": dict(format=HEAD_FORMAT, **(extra or {})),
        **(more_config or {}),
    }
    return head_folder.write(path, state, head_parameter_names(hcfg) + list(more_tensors), draft_ids,
                             hcfg.target_vocab_size, dtype, config)


# ---------------------------------------------------------------------------------------------
# The head as a torch module (export graphs and training share it)

def build_module(hcfg: HeadConfig, state: dict | None = None):
    return head_folder.load_state(head_class(hcfg)(), state, "EAGLE-3 head")


def head_class(hcfg: HeadConfig):
    """The head's torch module class for hcfg (the P-EAGLE head in peagle.py extends it)."""
    import torch
    from torch import nn

    from spec_edge.graphs.model import MLP, Attention, RMSNorm, rope_and_mask, rope_inv_freq

    mcfg = hcfg.as_model_config()

    class MidLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attention(mcfg)
            H = hcfg.hidden_size
            self.self_attn.q_proj = nn.Linear(2 * H, hcfg.n_heads * hcfg.head_dim, bias=False)
            self.self_attn.k_proj = nn.Linear(2 * H, hcfg.n_kv_heads * hcfg.head_dim, bias=False)
            self.self_attn.v_proj = nn.Linear(2 * H, hcfg.n_kv_heads * hcfg.head_dim, bias=False)
            self.mlp = MLP(mcfg)
            self.hidden_norm = RMSNorm(H, hcfg.rms_norm_eps)
            self.input_layernorm = RMSNorm(H, hcfg.rms_norm_eps)
            self.post_attention_layernorm = RMSNorm(H, hcfg.rms_norm_eps)

    class Eagle3Head(nn.Module):
        """forward(tokens, hidden, position, last_index, k_cache, v_cache, embed_table)
        -> logits (1, Vd), k_new, v_new (1, Hkv, W, D), hidden_out (1, H)."""

        def __init__(self, fused: bool = True):
            super().__init__()
            self.fused = fused  # True: hidden is the target's (W, 3Ht) and goes through fc
            self.fc = nn.Linear(3 * hcfg.target_hidden_size, hcfg.hidden_size, bias=False)
            Ht = hcfg.target_hidden_size
            if hcfg.norm_before_fc:  # speculators' norm_before_fc: one RMSNorm over the (W, 3Ht) hidden
                self.input_norm = RMSNorm(3 * Ht, hcfg.rms_norm_eps)
            if hcfg.fc_norm:  # fc_norm: an RMSNorm over each (W, Ht) target layer's block
                self.fc_norm = nn.ModuleList([RMSNorm(Ht, hcfg.rms_norm_eps) for _ in hcfg.aux_layers])
            self.midlayer = MidLayer()
            self.norm = RMSNorm(hcfg.hidden_size, hcfg.rms_norm_eps)
            self.lm_head = nn.Linear(hcfg.hidden_size, hcfg.draft_vocab_size, bias=False)
            self.register_buffer("inv_freq", rope_inv_freq(mcfg), persistent=False)

        def fuse(self, hidden):
            """(..., 3Ht) target hidden states -> (..., H)."""
            if hcfg.fc_norm:
                blocks = hidden.chunk(len(hcfg.aux_layers), dim=-1)
                hidden = torch.cat([norm(block) for norm, block in zip(self.fc_norm, blocks)], dim=-1)
            return self.fc(self.input_norm(hidden) if hcfg.norm_before_fc else hidden)

        def layer_inputs(self, emb, h):
            mid = self.midlayer
            h_normed = mid.hidden_norm(h)
            residual = h_normed if hcfg.norm_before_residual else h
            return torch.cat((mid.input_layernorm(emb), h_normed), dim=-1), residual

        def forward(self, tokens, hidden, position, last_index, k_cache, v_cache, embed_table):
            emb = torch.index_select(embed_table, 0, tokens[0])  # (W, H)
            h = self.fuse(hidden) if self.fused else hidden    # (W, H)
            h, k_new, v_new = self.layer(emb, h, position, k_cache, v_cache, tokens.shape[1])
            h_last = torch.index_select(h, 0, last_index)  # (1, H)
            normed = self.norm(h_last)
            logits = self.lm_head(normed).float()
            # the next step's hidden: h' before the final norm (SafeAILab), after it with norm_output
            return logits, k_new[None], v_new[None], normed if hcfg.norm_output else h_last

        def layer(self, emb, h, position, k_cache, v_cache, seq: int):
            """The decoder layer over seq rows at positions position.. (causal, after the cache rows
            < position): h' (seq, H) before the final norm, k_new, v_new (Hkv, seq, D)."""
            cache_len = k_cache.shape[2]
            cos, sin, mask = rope_and_mask(self.inv_freq, position, seq, cache_len, h.dtype)
            x, residual = self.layer_inputs(emb, h)
            attn, k_new, v_new = self.midlayer.self_attn(x, cos, sin, k_cache[0], v_cache[0], mask)
            h = residual + attn
            h = h + self.midlayer.mlp(self.midlayer.post_attention_layernorm(h))
            return h, k_new, v_new

    return Eagle3Head
