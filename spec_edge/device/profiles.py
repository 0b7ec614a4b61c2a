"""A profile without its weights: where its yaml is, the architecture of each model it names, the
engine layout, and the memory plan of the profile (memory.PlanInputs from a Config).

Nothing here reads a checkpoint or needs TensorRT: `spec-edge plan` runs on any machine.
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import HEAD_DRAFTERS, Config, ConfigError, ModelConfig
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


def engine_layout() -> str:
    """'shared': one engine per model, one optimization profile per width, over the dynamic-width
    graph export.export_model(dynamic=True) writes (memory.py explains why). specs.engine_specs()
    still builds one engine per graph ('per_graph') when it finds only static graphs."""
    return "shared"


def plan_inputs(cfg: Config, layout: str | None = None, measured_activation: int | None = None
                ) -> memory.PlanInputs:
    drafter = cfg.speculative.drafter
    draft = model_config(cfg.model.draft) if drafter == "draft" else None
    target = model_config(cfg.model.target)
    head = head_config(cfg.speculative.eagle3_head, target) if drafter in HEAD_DRAFTERS else None
    return memory.PlanInputs(target=target, graphs=cfg.graphs, memory=cfg.memory,
                             drafter=drafter, k=cfg.speculative.k, draft=draft,
                             layout=layout or engine_layout(), measured_activation=measured_activation,
                             head=head, hidden_layers=len(head.aux_layers) if head is not None else 0,
                             measured_target_weights=quantized_weights_bytes(cfg))


def quantized_weights_bytes(cfg: Config) -> int | None:
    """The size of the target's Q/DQ weights.bin (codes, scales, minima, pre-scales: all of it) once
    `spec-edge build` (or --export-only) has written it for this profile's graphs.weights; else None."""
    import json

    from spec_edge.config import QDQ_WEIGHTS
    from spec_edge.graphs import export, qdq

    if cfg.graphs.weights not in QDQ_WEIGHTS:
        return None
    from spec_edge.graphs import batch_dynamic

    source = export.artifact_dir(cfg, "target") if cfg.graphs.batch_slots == 1 else batch_dynamic.folder(cfg)
    folder = qdq.folder_for(source, cfg.graphs.weights)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    record = json.loads(manifest.read_text()).get("quantization") or {}
    if record.get("block_size") != qdq.wanted_record(cfg, cfg.graphs.weights, None).get("block_size"):
        return None  # made for another block size: the estimate is the better number until rebuilt
    return (folder / "weights.bin").stat().st_size


def plan_for_config(cfg: Config, device: memory.DeviceMemory | None = None, layout: str | None = None,
                    measured_activation: int | None = None) -> memory.Plan:
    return memory.plan(plan_inputs(cfg, layout, measured_activation), device)
