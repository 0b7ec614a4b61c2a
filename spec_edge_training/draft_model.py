"""spec-edge-train --kind draft: a small separate draft model distilled from the target.

The draft model is the target's architecture with --draft-layers decoder layers, initialised from
evenly spaced target layers (the first and the last included) and the target's embedding, final
norm and output head (frozen: the tied 49k x 576 table is most of a small model's weights). It is
trained on the same cached data as the heads (data.make_data: the target's own greedy answers) to
predict the target's argmax at every position (cross-entropy on the target's choice), and saved as
a Hugging Face folder (config.json, model.safetensors, the target's tokenizer files), the form
`model.draft` loads; `speculative.drafter: draft` then runs it through the same backend.

On a 135M target a separate draft model is structurally expensive: its output head alone is ~21%
of a target step, so even a perfect 2-layer draft costs ~0.26 target steps per drafted token.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError, ModelConfig
from spec_edge_training.data import log
from spec_edge_training.fit import fit, load_resume, split


def layer_choice(n_target: int, n_draft: int) -> list[int]:
    """Target layers the draft layers start from: evenly spaced, first and last included."""
    if not 1 <= n_draft < n_target:
        raise ConfigError(f"--draft-layers must be in [1, {n_target - 1}] for a {n_target}-layer target, got {n_draft}")
    if n_draft == 1:
        return [0]
    return [round(i * (n_target - 1) / (n_draft - 1)) for i in range(n_draft)]


def init_state(target_state: dict, layers: list[int], tie_embeddings: bool) -> dict:
    """Draft state dict (HF names) from the target's: layer j <- target layer layers[j]."""
    draft_index = {source: j for j, source in enumerate(layers)}  # distinct: layer_choice spaces them
    state = {}
    for name, tensor in target_state.items():
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index in draft_index:
                state[name.replace(f"model.layers.{index}.", f"model.layers.{draft_index[index]}.", 1)] = tensor.clone()
        elif not (tie_embeddings and name == "lm_head.weight"):
            state[name] = tensor.clone()
    return state


def build_module(hf_config: dict, n_layers: int, state: dict):
    """transformers LlamaForCausalLM with n_layers layers and `state` loaded (embeddings frozen)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**{**hf_config, "num_hidden_layers": n_layers})
    module = AutoModelForCausalLM.from_config(config)
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ConfigError(f"draft model state does not match its config: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        module.tie_weights()
    module.model.embed_tokens.weight.requires_grad_(False)
    module.lm_head.weight.requires_grad_(False)
    module.model.norm.weight.requires_grad_(False)
    return module.float()


def _batch(items: list[dict], answer_only: bool = False):
    """tokens (B, N) right-padded, labels (B, N) = target argmax after each token (-100 = none)."""
    import torch

    n = max(len(item["tokens"]) for item in items)
    tokens = torch.zeros((len(items), n), dtype=torch.long)
    labels = torch.full((len(items), n), -100, dtype=torch.long)
    for b, item in enumerate(items):
        length = len(item["tokens"])
        tokens[b, :length] = item["tokens"]
        labels[b, :length] = item["labels"]
        if answer_only:  # score the answer: predictions from the last prompt token on
            labels[b, :item["n_prompt"] - 1] = -100
    return tokens, labels


def save_draft_model(out: Path, hf_config: dict, module, tokenizer_files, dtype: str, extra: dict) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    state = {name: t.detach().to(torch_dtype).contiguous() for name, t in module.state_dict().items()
             if not (hf_config.get("tie_word_embeddings") and name == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"))
    n_layers = len({name.split(".")[2] for name in state if name.startswith("model.layers.")})
    config = {**hf_config, "num_hidden_layers": n_layers, "torch_dtype": dtype, "spec_edge": extra}
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str))
    (out / "tokenizer.json").write_text(tokenizer_files.tokenizer_json)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": tokenizer_files.chat_template, "bos_token": tokenizer_files.bos_token,
        "eos_token": tokenizer_files.eos_token, "add_bos_token": tokenizer_files.add_bos}, indent=1))


def train_draft_model(args, argv: list[str], data: list[dict], target_state: dict, cfg: ModelConfig,
                      hf_config: dict, out: Path) -> int:
    import torch

    from spec_edge.graphs import weights

    layers = layer_choice(cfg.n_layers, args.draft_layers)
    identity = {"kind": "draft", "layers": layers}
    resume = load_resume(out, identity)
    hf_config = {key: value for key, value in hf_config.items()
                 if key not in ("_name_or_path", "torch_dtype", "dtype", "transformers_version")}
    module = build_module(hf_config, len(layers), init_state(target_state, layers, cfg.tie_embeddings))
    tokenizer_files = weights.load(args.target)[2]
    eval_data, train_data = split(data)
    log(f"[spec-edge-train] draft model: {len(layers)} layers initialised from target layers {layers}")

    def batch_loss(items):
        tokens, labels = _batch(items)
        logits = module(input_ids=tokens).logits  # (B, N, V)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    def evaluate() -> list[float]:
        """Top-1 agreement with the target's next token on the held-out answers (teacher-forced)."""
        hits = total = 0
        for start in range(0, len(eval_data), args.batch):
            tokens, labels = _batch(eval_data[start:start + args.batch], answer_only=True)
            valid = labels != -100
            predicted = module(input_ids=tokens).logits.argmax(-1)
            hits += (predicted[valid] == labels[valid]).sum().item()
            total += valid.sum().item()
        return [hits / max(total, 1)]

    def save_head(extra: dict) -> None:
        save_draft_model(out, hf_config, module, tokenizer_files, args.dtype,
                         {**extra, "initialised_from_target_layers": layers})

    return fit(args=args, argv=argv, out=out, kind="draft", module=module, identity=identity,
               resume=resume, draft_ids=np.zeros(0, np.int64), train_data=train_data,
               batch_loss=batch_loss, evaluate=evaluate, save_head=save_head, n_sequences=len(data))
