"""A profile without its weights: where its yaml is, the architecture of each model it names, and the
memory plan of the profile (memory.PlanInputs from a Config).

Nothing here reads a checkpoint or needs TensorRT: `spec-edge plan` runs on any machine.
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import Config, ConfigError, ModelConfig, speculative_k
from spec_edge.device.presets import HEAD_PRESETS, MODEL_PRESETS
from spec_edge.device import memory


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
        return config_from_hf(json.loads((path / "config.json").read_text()))
    by_name = {m.name.lower(): m for m in MODEL_PRESETS.values()}
    if path.name.lower() in by_name:
        return by_name[path.name.lower()]
    if source == "embedded":
        return MODEL_PRESETS["smollm2-135m"]
    raise ConfigError(f"cannot tell the architecture of '{source}': give a Hugging Face folder with "
                      f"config.json, or a preset ({', '.join(MODEL_PRESETS)})")


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
    return memory.PlanInputs(target=target, graphs=cfg.graphs, memory=cfg.memory, drafter=drafter,
                             k=speculative_k(cfg), head=head)


def plan_for_config(cfg: Config, device: memory.DeviceMemory | None = None) -> memory.Plan:
    return memory.plan(plan_inputs(cfg), device)
