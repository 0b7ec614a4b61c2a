"""A profile without its weights: where its yaml is, the architecture of each model it names, and the
memory plan of the profile (memory.PlanInputs from a Config).

Nothing here reads a checkpoint or needs TensorRT: `spec-edge plan` runs on any machine.
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import Config, ConfigError, ModelConfig, speculative_k
from spec_edge.device.presets import HEAD_PRESETS, MODEL_PRESETS, VISION_PRESETS
from spec_edge.device import memory
from spec_edge.edgellm_layout import VISION_MODEL_TYPES


def resolve_profile(arg: str) -> Path:
    """A profile path, or a name looked up as config/<name>.yaml here, in the source tree, and in
    the installed package share directory."""
    path = Path(arg).expanduser()
    if path.is_file():
        return path
    name = arg if arg.endswith(".yaml") else f"{arg}.yaml"
    candidates = [Path.cwd() / "config" / name, Path(__file__).resolve().parents[2] / "config" / name]
    try:
        from ament_index_python.packages import get_package_share_directory
        candidates.append(Path(get_package_share_directory("spec_edge")) / "config" / name)
    except Exception:  # ament_index missing or the package not installed: only the local paths apply
        pass
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"profile '{arg}' not found (looked for {', '.join(str(c) for c in candidates)})")


def model_config(source: str) -> ModelConfig:
    """The architecture a model source names: a preset name, an HF folder's config.json, or (for a
    folder not downloaded yet) the preset whose published name is the folder's name."""
    if source in MODEL_PRESETS:
        return MODEL_PRESETS[source]
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        from spec_edge.graphs.weights import config_from_hf
        hf = json.loads((path / "config.json").read_text())
        if hf.get("model_type") in VISION_MODEL_TYPES:
            return _vlm_text_config(hf, path.name)
        return config_from_hf(hf)
    by_name = {m.name.lower(): m for m in MODEL_PRESETS.values()}
    if path.name.lower() in by_name:
        return by_name[path.name.lower()]
    if source == "embedded":
        return MODEL_PRESETS["smollm2-135m"]
    raise ConfigError(f"cannot tell the architecture of '{source}': give a Hugging Face folder with "
                      f"config.json, or a preset ({', '.join(MODEL_PRESETS)})")


def _vlm_text_config(hf: dict, name: str) -> ModelConfig:
    """The text model of a Qwen-VL checkpoint (root keys, or text_config), for the memory plan only: Edge-LLM runs
    it (its M-RoPE and q/k/v biases are not the ONNX Runtime graphs', which config_from_hf guards)."""
    text = {**hf, **(hf.get("text_config") or {})}
    n_heads = int(text["num_attention_heads"])
    eos = text.get("eos_token_id")
    return ModelConfig(
        vocab_size=int(text["vocab_size"]), hidden_size=int(text["hidden_size"]),
        intermediate_size=int(text["intermediate_size"]), n_layers=int(text["num_hidden_layers"]), n_heads=n_heads,
        n_kv_heads=int(text.get("num_key_value_heads", n_heads)),
        head_dim=int(text.get("head_dim") or int(text["hidden_size"]) // n_heads),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)), rope_theta=float(text.get("rope_theta", 1e6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        qk_norm=hf.get("model_type") == "qwen3_vl", eos_ids=tuple(eos) if isinstance(eos, list) else (
            () if eos is None else (int(eos),)), max_position_embeddings=int(text.get("max_position_embeddings", 8192)),
        name=name)


def vision_config(source: str) -> memory.VisionConfig:
    """The vision tower a VLM profile's model.target names: the folder's config.json vision_config, or (a folder not
    downloaded yet) the VISION_PRESETS entry of its name; ConfigError when it has none (not a VLM)."""
    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        vision = json.loads((path / "config.json").read_text()).get("vision_config")
    else:
        by_name = {key.lower(): raw for key, raw in VISION_PRESETS.items()}
        vision = by_name.get(path.name.lower()) or VISION_PRESETS.get(model_config(source).name)
    if not vision:
        raise ConfigError(f"graphs.max_image_tokens needs a Qwen-VL model.target ({', '.join(VISION_MODEL_TYPES)}); "
                          f"'{source}' has no vision_config (nor a preset of that name: {', '.join(VISION_PRESETS)})")
    try:
        return memory.VisionConfig.from_hf(vision)
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(f"the vision_config of '{source}' lacks what the plan reads ({err})") from None


def head_config(source: str, target: ModelConfig):
    """The EAGLE-3 head's geometry (heads.eagle3.HeadConfig) a profile names, without its weights: the
    folder's config.json, or (for a folder not downloaded yet) the HEAD_PRESETS entry of its name."""
    from spec_edge.heads.eagle3 import parse_head_config

    path = Path(source).expanduser()
    if (path / "config.json").is_file():
        return parse_head_config(json.loads((path / "config.json").read_text()), target)
    by_name = {name.lower(): raw for name, raw in HEAD_PRESETS.items()}
    if path.name.lower() in by_name:
        return parse_head_config(by_name[path.name.lower()], target)
    raise ConfigError(f"speculative.eagle3_head '{source}': no config.json there and no preset of that name "
                      f"({', '.join(HEAD_PRESETS)}): download the head folder first")


def plan_inputs(cfg: Config) -> memory.PlanInputs:
    target = model_config(cfg.model.target)
    drafter = cfg.speculative.drafter
    head = head_config(cfg.speculative.eagle3_head, target) if drafter == "eagle3" else None
    vision = vision_config(cfg.model.target) if cfg.graphs.max_image_tokens else None
    return memory.PlanInputs(target=target, graphs=cfg.graphs, memory=cfg.memory, drafter=drafter,
                             k=speculative_k(cfg), head=head, vision=vision)


def plan_for_config(cfg: Config, device: memory.DeviceMemory | None = None) -> memory.Plan:
    return memory.plan(plan_inputs(cfg), device)
