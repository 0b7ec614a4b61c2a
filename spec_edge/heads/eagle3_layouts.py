"""The published EAGLE-3 checkpoint layouts, read into one HeadConfig exactly as each head was trained.

Four layouts of config.json (layout_of tells them apart), the same tensors (SafeAILab names; the
prefixes of the others are mapped by canonical_name):

  safeailab    yuhuili/EAGLE3-* (SafeAILab/EAGLE eagle/traineagle3): llama fields + draft_vocab_size at
               the top level, no layer ids (the trainer hard-codes the inputs of layers 2, L//2, L-3),
               tensors midlayer.*, fc, norm, lm_head, d2t, t2d.
  modelopt     NVIDIA Model Optimizer exports (nvidia/*-Eagle3, hf_spec_export.py): the same top-level
               fields + eagle_config {eagle_aux_hidden_state_layer_ids (layer outputs), use_* flags},
               tensors layers.0.*.
  speculators  vLLM speculators (RedHatAI/*speculator.eagle3): transformer_layer_config (a LlamaConfig)
               + speculators_config, top-level eagle_aux_hidden_state_layer_ids ("before layer j"),
               norm_before_residual / norm_before_fc / fc_norm / norm_output, tensors layers.0.*.
  spec_edge    our own save_head: the safeailab tensors + eagle_config ids + a "spec_edge" block.

What a key the config leaves out means (each source's own default, checked in its code):
  rope_theta   10000: SafeAILab's trainer builds LlamaRotaryEmbedding(head_dim) with base=10000 and
               never reads a theta; speculators' converter writes LlamaConfig(rope_theta=
               eagle_config.get("rope_theta", 10000.0)); Model Optimizer's default_eagle_config has
               10000 and its export always writes the value. Never the target's theta.
  rms_norm_eps 1e-6 (transformers' LlamaConfig default, which all four configs are read as).
  norm_before_residual  False for safeailab / modelopt (SafeAILab keeps the residual before
               hidden_norm; vLLM reads a missing key as False; SGLang has no such flag and always
               keeps it before); a speculators config must state it: Eagle3SpeculatorConfig's field
               defaults to False but speculators' own trainer builds heads with True, so a config
               without it is refused rather than guessed.
  norm_before_fc / fc_norm / norm_output  False (speculators' config fields; SGLang reads a missing
               one as False). Applied: norm_before_fc = one RMSNorm (input_norm.weight, 3Ht)
               over the fused hidden before fc; fc_norm (SGLang also reads use_aux_norm) = an RMSNorm
               per target layer's block (fc_norm.i.weight, SGLang's legacy aux_norm_low/mid/high);
               norm_output = the next draft step's hidden is h' after the final norm (SGLang's
               llama_eagle3.py: `aux = hidden_states_to_logits if self.norm_output`).
Layer ids: graphs/hidden.py (configured_aux_layers) converts each convention to ours (layer outputs).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spec_edge.config import ConfigError, ModelConfig
from spec_edge.graphs.hidden import configured_aux_layers, default_aux_layers
from spec_edge.heads import head_folder

UNSTATED_ROPE_THETA = 10000.0  # what every EAGLE-3 trainer used when the config names none (above)
UNSTATED_RMS_NORM_EPS = 1e-6   # transformers LlamaConfig's default


@dataclass(frozen=True)
class HeadConfig:
    hidden_size: int             # H (the head's own width; EAGLE-3 heads use the target's)
    intermediate_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    target_hidden_size: int      # Ht: fc takes 3 * Ht
    target_vocab_size: int       # V
    draft_vocab_size: int        # Vd
    aux_layers: tuple[int, ...]  # target layers whose *outputs* feed fc (our 0-based indexing)
    rms_norm_eps: float = UNSTATED_RMS_NORM_EPS
    rope_theta: float = UNSTATED_ROPE_THETA
    rope_llama3: tuple[float, float, float, int] | None = None
    norm_before_residual: bool = False  # residual = hidden_norm(h) instead of h (speculators)
    norm_before_fc: bool = False        # RMSNorm (input_norm, 3Ht) over the fused hidden before fc
    fc_norm: bool = False               # an RMSNorm (fc_norm.i, Ht) over each target layer's block before fc
    norm_output: bool = False           # the next step's hidden is h' after the final norm
    target_layers: int = 0       # layer count of the target it was made for (0 = not recorded)
    has_embedding: bool = False  # the head ships its own embed_tokens (else it uses the target's)

    def as_model_config(self) -> ModelConfig:
        """The attention/rope geometry in the core's ModelConfig form (vocab = draft vocab)."""
        return ModelConfig(vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, n_layers=1, n_heads=self.n_heads,
                           n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_llama3=self.rope_llama3, name="eagle3-head")


def layout_of(raw: dict) -> str:
    """Which of the layouts above a head's config.json is."""
    if "speculators_config" in raw or "transformer_layer_config" in raw or raw.get("speculators_model_type"):
        return "speculators"
    if "spec_edge" in raw:
        return "spec_edge"
    if "eagle_config" in raw:
        return "modelopt"
    return "safeailab"


# ---------------------------------------------------------------------------------------------
# Tensors

_PREFIXES = ("midlayer.", "layers.0.", "model.layers.0.", "model.midlayer.")


_ALIASES = {"aux_norm_low.": "fc_norm.0.", "aux_norm_mid.": "fc_norm.1.", "aux_norm_high.": "fc_norm.2."}


def canonical_name(name: str) -> str:
    """A published tensor name in the SafeAILab form spec_edge uses."""
    if name.startswith("model."):
        name = name[6:] if name[6:].startswith(("fc.", "norm.", "embed_tokens.", "input_norm.", "fc_norm.")) else name
    for alias, canonical in _ALIASES.items():
        if name.startswith(alias):
            return canonical + name[len(alias):]
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return "midlayer." + name[len(prefix):]
    return name


def read_tensors(path: Path) -> dict:
    state = head_folder.read_tensors(path, "EAGLE-3 head", ("pytorch_model.bin",))
    return {canonical_name(name): tensor for name, tensor in state.items()}


# ---------------------------------------------------------------------------------------------
# config.json

def parse_head_config(raw: dict, target: ModelConfig) -> HeadConfig:
    """HeadConfig from a head's config.json (any layout above) for a given target; refuses, naming
    the key, whatever changes the computation that the head graphs do not implement."""
    layout = layout_of(raw)
    layer_cfg = raw.get("transformer_layer_config") or raw  # speculators nest the layer's LlamaConfig
    hidden = int(layer_cfg.get("hidden_size", 0))
    if not hidden:
        raise ConfigError("EAGLE-3 head config.json has no hidden_size")
    n_heads = int(layer_cfg.get("num_attention_heads", 0)) or 1
    n_layers_head = int(layer_cfg.get("num_hidden_layers", 1))
    if n_layers_head != 1:
        raise ConfigError(f"EAGLE-3 head has {n_layers_head} decoder layers; spec_edge runs one-layer heads")
    _refuse_unimplemented(raw, layer_cfg, layout)
    aux = configured_aux_layers(raw, target.n_layers)
    if aux is None:
        aux = default_aux_layers(target.n_layers)
    theta, llama3 = rope_of(layer_cfg)
    vocab = int(layer_cfg.get("vocab_size", raw.get("vocab_size", target.vocab_size)))
    return HeadConfig(
        hidden_size=hidden, intermediate_size=int(layer_cfg.get("intermediate_size", 4 * hidden)),
        n_heads=n_heads, n_kv_heads=int(layer_cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(layer_cfg.get("head_dim") or hidden // n_heads),
        target_hidden_size=int(raw.get("target_hidden_size") or hidden),
        target_vocab_size=vocab, draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        aux_layers=aux, rms_norm_eps=float(layer_cfg.get("rms_norm_eps", UNSTATED_RMS_NORM_EPS)),
        rope_theta=theta, rope_llama3=llama3, norm_before_residual=_norm_before_residual(raw, layout),
        norm_before_fc=bool(raw.get("norm_before_fc", False)),
        fc_norm=bool(raw.get("fc_norm", raw.get("use_aux_norm", False))),
        norm_output=bool(raw.get("norm_output", False)),
        target_layers=int(raw.get("target_num_hidden_layers", 0)))


def rope_of(layer_cfg: dict) -> tuple[float, tuple[float, float, float, int] | None]:
    """(theta, Llama-3 scaling or None) from rope_theta, transformers-5 rope_parameters and
    rope_scaling (Model Optimizer writes rope_theta inside rope_scaling too). A config that names two
    thetas, or two scaling types, is refused; so is a scaling the graphs do not implement."""
    blocks = {key: dict(layer_cfg.get(key) or {}) for key in ("rope_parameters", "rope_scaling")}
    named = {"rope_theta": layer_cfg.get("rope_theta"),
             "rope_parameters.rope_theta": blocks["rope_parameters"].get("rope_theta"),
             "rope_scaling.rope_theta": blocks["rope_scaling"].get("rope_theta")}
    thetas = {key: float(value) for key, value in named.items() if value is not None}
    if len(set(thetas.values())) > 1:
        raise ConfigError(f"EAGLE-3 head config.json names two RoPE thetas ({thetas}): keep the one the head "
                          f"was trained with")
    theta = next(iter(thetas.values()), UNSTATED_ROPE_THETA)
    kinds = {key: block.get("rope_type", block.get("type")) for key, block in blocks.items()}
    kinds = {key: kind for key, kind in kinds.items() if kind not in (None, "default")}
    if len(set(kinds.values())) > 1:
        raise ConfigError(f"EAGLE-3 head config.json names two RoPE scalings ({kinds}): keep one")
    if not kinds:
        return theta, None
    key, kind = next(iter(kinds.items()))
    if kind != "llama3":
        # linear / dynamic (NTK) / yarn (and the rest) change the rotary frequencies (yarn also scales
        # the attention); the head graphs implement Llama-3 scaling only
        raise ConfigError(f"EAGLE-3 head config.json: {key}.rope_type '{kind}' is not supported (the head "
                          f"graphs implement default and llama3 RoPE)")
    rope = blocks[key]
    missing = [name for name in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
               if name not in rope]
    if missing:
        raise ConfigError(f"EAGLE-3 head config.json: {key} (llama3) lacks {missing}")
    return theta, (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                   int(rope["original_max_position_embeddings"]))


def _norm_before_residual(raw: dict, layout: str) -> bool:
    if "norm_before_residual" in raw:
        return bool(raw["norm_before_residual"])
    if layout == "speculators":
        raise ConfigError("EAGLE-3 head config.json (vLLM speculators) does not say norm_before_residual: "
                          "speculators' trainer makes heads with true, vLLM reads a missing key as false; add "
                          "\"norm_before_residual\": true or false as the head was trained")
    return False  # SafeAILab's layer keeps the residual before hidden_norm


# Model Optimizer's eagle_config switches (hf_spec_export.py writes them all), with the value the head
# graphs compute; a missing one means that value (TensorRT-LLM reads missing ones the same way).
_MODELOPT_FLAGS = {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True,
                   "use_last_layernorm": True, "use_mtp_layernorm": False}


def _refuse_unimplemented(raw: dict, layer_cfg: dict, layout: str) -> None:
    problems = []
    eagle_cfg = raw.get("eagle_config") or {}
    for key, wanted in _MODELOPT_FLAGS.items():
        if key in eagle_cfg and eagle_cfg[key] is not None and bool(eagle_cfg[key]) != wanted:
            problems.append(f"eagle_config.{key} is {eagle_cfg[key]} (the head graphs compute {wanted})")
    if int(eagle_cfg.get("parallel_draft_step") or 1) > 1:
        problems.append(f"eagle_config.parallel_draft_step is {eagle_cfg['parallel_draft_step']} (parallel "
                        f"draft heads are not implemented)")
    for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
        if layer_cfg.get(key):
            problems.append(f"{'transformer_layer_config.' if layer_cfg is not raw else ''}{key} is true "
                            f"(not implemented by the head graphs)")
    act = layer_cfg.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"hidden_act is '{act}' (SwiGLU with silu only)")
    if problems:
        raise ConfigError(f"EAGLE-3 head config.json ({layout} layout) asks for what spec_edge does not run: "
                          + "; ".join(problems))


def read_head_config(out_dir: Path) -> HeadConfig:
    raw = json.loads((Path(out_dir) / "head.json").read_text())
    raw["aux_layers"] = tuple(raw["aux_layers"])
    if raw.get("rope_llama3") is not None:
        raw["rope_llama3"] = tuple(raw["rope_llama3"])
    return HeadConfig(**raw)
