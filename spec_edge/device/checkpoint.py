"""The folders TensorRT Edge-LLM's exporter reads: the target as a Hugging Face folder (the embedded GGUF,
or any .gguf, converted once and cached) and the EAGLE-3 head rewritten from any published layout the
project reads (heads/eagle3_layouts.py) into the SafeAILab layout Edge-LLM's Eagle3DraftModel loads.

No GPU, no TensorRT: `spec-edge build --export-only` runs this on any machine.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from spec_edge.config import ConfigError, ModelConfig

QUANT_CONFIG = "hf_quant_config.json"  # written by ModelOpt / tensorrt-edgellm-quantize beside config.json


def hf_folder(source: str, cache_root: Path) -> Path:
    """A Hugging Face folder (config.json, *.safetensors, tokenizer) for a model source: the folder itself,
    or for 'embedded' / a .gguf file its fp16 conversion under cache_root/<gguf stem>-<fingerprint>/
    (made once, reused by every profile)."""
    from spec_edge.graphs import weights

    path = weights.resolve(source)
    if path.is_dir():
        return path
    out = Path(cache_root) / f"{path.stem}-{weights.fingerprint(source)}"
    if (out / "config.json").is_file():
        return out
    _convert_gguf(path, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    """transformers + gguf dequantize the file; written as fp16 safetensors + config + tokenizer (transformers'
    save_pretrained refuses GGUF-loaded models, so the state dict is written directly)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    config["architectures"] = [type(model).__name__]
    state = {name: tensor.detach().half().contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def quantization_of(folder: Path) -> str | None:
    """The quantization a checkpoint already carries (ModelOpt's hf_quant_config.json or config.json's
    quantization_config), in graphs.weights' names, or None for an unquantized one."""
    raw = None
    if (folder / QUANT_CONFIG).is_file():
        raw = json.loads((folder / QUANT_CONFIG).read_text()).get("quantization", {}).get("quant_algo")
    elif (folder / "config.json").is_file():
        q = json.loads((folder / "config.json").read_text()).get("quantization_config") or {}
        raw = q.get("quant_algo") or q.get("quant_method")
    if raw is None:
        return None
    names = {"NVFP4": "nvfp4", "W4A16_AWQ": "int4_awq", "FP8": "fp8", "AWQ": "int4_awq", "FP8_PER_CHANNEL": "fp8"}
    return names.get(str(raw).upper(), str(raw).lower())


def edgellm_head_folder(head: str, target: ModelConfig, out: Path) -> Path:
    """The head folder rewritten for Edge-LLM's exporter: read through heads.eagle3.load_head (every published
    layout, checked against the target), refused where Edge-LLM's EAGLE-3 draft computes something else, written
    in the SafeAILab layout (fp16, midlayer.*, d2t) to `out`."""
    from spec_edge.graphs.hidden import default_aux_layers
    from spec_edge.heads.eagle3 import load_head, save_head

    hcfg, state, draft_ids = load_head(head, target)
    problems = []
    want = default_aux_layers(target.n_layers)
    if tuple(hcfg.aux_layers) != tuple(want):
        problems.append(f"it reads the outputs of target layers {list(hcfg.aux_layers)}; Edge-LLM's EAGLE-3 base "
                        f"export always emits those of layers {list(want)} (hidden states "
                        f"[2, L//2, L-3])")
    for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "has_embedding"):
        if getattr(hcfg, flag):
            problems.append(f"{flag} is set; Edge-LLM's Eagle3DraftModel implements the SafeAILab layer only")
    if problems:
        raise ConfigError(f"EAGLE-3 head '{head}' cannot run on TensorRT Edge-LLM: " + "; ".join(problems)
                          + " (runtime.backend: onnxruntime runs it)")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_head(tmp, hcfg, state, draft_ids, dtype="float16",
              extra={"source": str(Path(head).expanduser().resolve())})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
