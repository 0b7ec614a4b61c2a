"""The published configs the memory planner needs without weights on disk: models (ModelConfig) and
EAGLE-3 heads (their config.json). device/profiles.py matches a profile's model / head folder by name;
a folder with weights (or a head's config.json) always wins."""
from __future__ import annotations

from typing import Any

from spec_edge.config import ModelConfig

MODEL_PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, n_layers=30, n_heads=9,
        n_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, tie_embeddings=True,
        bos_id=1, eos_ids=(2,), name="SmolLM2-135M-Instruct"),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32, n_heads=32,
        n_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_llama3=(8.0, 1.0, 4.0, 8192), tie_embeddings=False, bos_id=128000,
        eos_ids=(128001, 128008, 128009), max_position_embeddings=131072,
        name="Llama-3.1-8B-Instruct"),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, n_layers=16, n_heads=32,
        n_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_llama3=(32.0, 1.0, 4.0, 8192), tie_embeddings=True, bos_id=128000,
        eos_ids=(128001, 128008, 128009), max_position_embeddings=131072,
        name="Llama-3.2-1B-Instruct"),
    "qwen3-8b": ModelConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, n_layers=36, n_heads=32,
        n_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_embeddings=False, qk_norm=True, bos_id=-1, eos_ids=(151645, 151643),
        max_position_embeddings=40960, name="Qwen3-8B"),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, n_layers=28, n_heads=16,
        n_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_embeddings=True, qk_norm=True, bos_id=-1, eos_ids=(151645, 151643),
        max_position_embeddings=40960, name="Qwen3-0.6B"),
    "qwen2.5-vl-3b": ModelConfig(  # the text model of Qwen/Qwen2.5-VL-3B-Instruct's config.json
        vocab_size=151936, hidden_size=2048, intermediate_size=11008, n_layers=36, n_heads=16,
        n_kv_heads=2, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True,
        bos_id=151643, eos_ids=(151645,), max_position_embeddings=128000, name="Qwen2.5-VL-3B-Instruct"),
}

# Published VLMs' vision_config (config.json), by the model preset's name, for the visual engine's memory plan
# (memory.VisionConfig); a folder with config.json always wins.
VISION_PRESETS: dict[str, dict[str, Any]] = {
    "Qwen2.5-VL-3B-Instruct": {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "in_chans": 3,
        "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
        "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu"},
}


# Published EAGLE-3 heads' config.json, for the memory plan of a profile whose head folder is not
# downloaded yet (device/profiles.py matches the folder name; a folder with config.json always wins).
# yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (SafeAILab): one Llama layer over Llama-3.1-8B's hidden size, a
# 32000-token draft vocabulary, no rope_theta (SafeAILab's trainer uses the default 10000).
HEAD_PRESETS: dict[str, dict[str, Any]] = {
    "EAGLE3-LLaMA3.1-Instruct-8B": {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-05, "hidden_act": "silu", "max_position_embeddings": 2048,
        "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 0, "tie_word_embeddings": False,
        "torch_dtype": "float16", "vocab_size": 128256, "draft_vocab_size": 32000},
}
