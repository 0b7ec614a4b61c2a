"""Tiny random-weight Llama-family checkpoints in Hugging Face layout, for fast tests.

A byte-level BPE tokenizer (a few hundred tokens, ChatML specials) is trained in code on a fixed
text, so the folders need no download. Weights are drawn with a fixed seed and scaled up so the
logits are far apart (greedy choices are not near-ties, which would let the different reduction
orders of the step and verify graphs disagree).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = [
    "The robot picks up the red box and places it on the shelf.",
    "Move the arm to the left, then open the gripper slowly.",
    "Navigate to the kitchen and report the battery level.",
    "def add(a, b):\n    return a + b\n",
    "Temperature sensors read 21.5 degrees; humidity is 40 percent.",
    "Ünïcödé tëxt and emoji 🤖 keep the byte-level path honest.",
] * 20
TINY_K_VALUES = [1, 3, 4, 7]  # verify graphs the session's tiny target is exported with
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def train_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_checkpoint(path: Path, *, seed: int, n_layers: int = 4, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, inter: int = 128, tie: bool = False, model_type: str = "llama",
                    llama3_rope: bool = False, tokenizer=None, scale: float = 3.0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer()
    vocab = tok.get_vocab_size()
    head_dim = hidden // heads
    cfg = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": n_layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tie, "hidden_act": "silu",
           "max_position_embeddings": 4096, "bos_token_id": tok.token_to_id("<|im_start|>"),
           "eos_token_id": tok.token_to_id("<|im_end|>"), "_name_or_path": f"tiny-{model_type}-{seed}"}
    if llama3_rope:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    state = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden)}
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        state[pre + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden, std=scale / hidden ** 0.5)
        state[pre + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden, std=scale / hidden ** 0.5)
        state[pre + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden, std=1 / hidden ** 0.5)
        state[pre + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, std=1 / hidden ** 0.5)
        state[pre + "mlp.gate_proj.weight"] = rand(inter, hidden, std=1 / hidden ** 0.5)
        state[pre + "mlp.up_proj.weight"] = rand(inter, hidden, std=1 / hidden ** 0.5)
        state[pre + "mlp.down_proj.weight"] = rand(hidden, inter, std=1 / inter ** 0.5)
        state[pre + "input_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        state[pre + "post_attention_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        if model_type == "qwen3":
            state[pre + "self_attn.q_norm.weight"] = 1 + rand(head_dim, std=0.1)
            state[pre + "self_attn.k_norm.weight"] = 1 + rand(head_dim, std=0.1)
    if not tie:
        state["lm_head.weight"] = rand(vocab, hidden, std=scale / hidden ** 0.5 * 2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}))
    return path
