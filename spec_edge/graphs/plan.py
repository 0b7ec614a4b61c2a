"""The graph plan a config runs and the folders that hold it, by name: what the export and the
post-export passes make (export.py, ort_attention.py, quantize.py; the packed copy: spec_edge/artifacts.py)
and what the runners read (runtime/backends/). Nothing here makes a file.

    artifact_dir(cfg, role)   the exported rows=1 graphs of a role's form (folders.form_name)
    ort_dir(cfg, role)        the folder ONNX Runtime runs: artifact_dir, then <..>_fused (graphs.ort_attention
                              fused; a target / draft model without q/k norms, an EAGLE-3 head), the target's
                              <..>_q4 / <..>_q4a0 (graphs.weights), a head's <..>_q8 (graphs.head_weights)
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import Config, ConfigError, ModelConfig, engine_root
from spec_edge.graphs import folders, hidden, io_names

ACCURACY_LEVELS = {"q4": 4, "q4_fp32act": 0}  # graphs.weights -> MatMulNBits accuracy_level
ORT_WEIGHTS = ("fp32",) + tuple(ACCURACY_LEVELS)  # the graphs.weights forms ONNX Runtime runs


def row_counts(batch: int) -> tuple[int, ...]:
    """Row counts m of the rows > 1 graphs for B slots (one row runs the B=1 graphs): every count up to
    8, then steps of 2 up to 16, of 4 up to 32, of 8 up to 64, and B. A call with n rows runs the
    smallest m >= n, so its padding rows are under a quarter of its rows (cost per row: docs/bench.md,
    "Calls over a subset of the slots"). () for B = 1."""
    counts, m = [], 2
    while m < batch:
        counts.append(m)
        m += 1 << max(0, m.bit_length() - 3)  # 1 below 8, then a quarter of the power of two below m
    return tuple(counts + [batch]) if batch > 1 else ()


def rows_stem(rows: int, kind: str, width: int) -> str:
    """File stem of a graph of m > 1 rows: rows_stem(4, "verify", 5) = 'rows4_verify_5'."""
    return f"rows{rows}_" + io_names.graph_file(kind, width)


def step_width(cfg: Config) -> int:
    """The width a decode step runs at: 2 for graphs.weights q4 (int8 activations: the token twice,
    graphs/two_rows.py), else 1."""
    return 2 if cfg.graphs.weights == "q4" else 1


def graph_plan(cfg: Config, role: str) -> dict[str, dict]:
    """stem -> {kind, width, rows[, n_layers][, hidden_layers]}: every graph a role ('target' or 'draft')
    runs. rows = 1: the B=1 graphs, exported from torch (export_model); the target's graphs of m > 1
    rows (graphs.batch_slots = B > 1: each m of row_counts(B), at the step width and each k+1) run with
    fused attention only and are made by that pass (graphs/ort_attention.py)."""
    g = cfg.graphs
    plan = {io_names.graph_file("prefill", g.prefill_chunk): {"kind": "prefill", "width": g.prefill_chunk, "rows": 1},
            io_names.graph_file("step", 1): {"kind": "step", "width": 1, "rows": 1}}
    if role == "target":
        for k in sorted(set(g.k_values)):
            plan[io_names.graph_file("verify", k + 1)] = {"kind": "verify", "width": k + 1, "rows": 1}
        plan[io_names.graph_file(f"layerskip{g.layer_skip_layers}_step", 1)] = {
            "kind": "layerskip", "width": 1, "rows": 1, "n_layers": g.layer_skip_layers}
        step = step_width(cfg)
        widths = [("step", step)] + [("verify", k + 1) for k in sorted(set(g.k_values)) if k + 1 != step]
        for m in row_counts(g.batch_slots):
            for kind, width in widths:
                plan[rows_stem(m, kind, width)] = {"kind": kind, "width": width, "rows": m}
        if is_vision(cfg.model.target):  # a vision model: the prefill of a prompt with image rows (graphs/vision.py)
            plan[io_names.graph_file("prefill_image", g.prefill_chunk)] = {
                "kind": "prefill_image", "width": g.prefill_chunk, "rows": 1}
        hidden_layers = hidden.target_hidden_layers(cfg)
        if hidden_layers:  # a head is configured: the full-model graphs also return the hidden states it reads
            for spec in plan.values():
                if spec["kind"] in ("prefill", "prefill_image", "step", "verify"):
                    spec["hidden_layers"] = list(hidden_layers)
    return plan


def is_vision(source: str) -> bool:
    """Whether a model source is a vision model (a Hugging Face folder of a weights.VISION_TYPES model)."""
    from spec_edge.graphs.weights import VISION_TYPES

    path = Path(source).expanduser() / "config.json" if source else None
    return bool(path and path.is_file() and json.loads(path.read_text()).get("model_type") in VISION_TYPES)


def vision_dir(cfg: Config) -> Path:
    """The folder of the vision target's encoder graph (graphs/vision.py), beside the target's exported folder."""
    folder = artifact_dir(cfg, "target")
    return folder.parent / f"{folder.name}_vision"


def read_model_config(out_dir: Path) -> ModelConfig:
    raw = json.loads((Path(out_dir) / "model.json").read_text())
    if raw.get("rope_llama3") is not None:
        raw["rope_llama3"] = tuple(raw["rope_llama3"])
    raw["eos_ids"] = tuple(raw["eos_ids"])
    return ModelConfig(**raw)


def artifact_dir(cfg: Config, role: str) -> Path:
    """The folder of cfg's form of a role's exported graphs (folders.form_name): 'target' and 'draft' (the
    models), 'eagle3', 'peagle', 'medusa' (the configured head of that kind)."""
    from spec_edge.graphs import weights

    g = cfg.graphs
    if role in ("target", "draft"):
        source = cfg.model.target if role == "target" else cfg.model.draft
        if not source:
            raise ConfigError(f"no {role} model configured (model.{role})")
        stamp, layers = weights.fingerprint(source), hidden.target_hidden_layers(cfg) if role == "target" else ()
    else:
        head = getattr(cfg.speculative, f"{role}_head")
        if not head:
            raise ConfigError(f"no {role} head configured (speculative.{role}_head)")
        stamp, layers = folders.path_stamp(head), ()
    name = folders.form_name(role, stamp, g.max_context, g.prefill_chunk, g.dtype, layers)
    return engine_root(cfg) / cfg.runtime.profile / "onnx" / name


def fused_dir(src_dir: Path) -> Path:
    return src_dir.parent / f"{src_dir.name}_fused"


def q4_dir(fp32_dir: Path, accuracy_level: int) -> Path:
    return fp32_dir.parent / (f"{fp32_dir.name}_q4" if accuracy_level == 4 else f"{fp32_dir.name}_q4a{accuracy_level}")


def q8_dir(head_dir: Path) -> Path:
    return head_dir.parent / f"{head_dir.name}_q8"


def runs_fused(cfg: Config, src_dir: Path) -> bool:
    """Whether ONNX Runtime runs the fused-attention copy of the exported folder src_dir (graphs.ort_attention
    fused), i.e. unless its model has q/k norms (Qwen3), which the rewrite does not cover."""
    if cfg.graphs.ort_attention != "fused":
        return False
    role = json.loads((Path(src_dir) / "manifest.json").read_text()).get("role")
    return role not in ("target", "draft") or not read_model_config(src_dir).qk_norm


def ort_dir(cfg: Config, role: str) -> Path:
    """The folder ONNX Runtime runs for a role of cfg (module docstring; 'target', 'draft', 'eagle3', 'peagle',
    'medusa'). The exported folder must be there (whether it runs fused is read from it)."""
    folder = artifact_dir(cfg, role)
    if role in ("target", "draft", "eagle3") and runs_fused(cfg, folder):
        folder = fused_dir(folder)
    if role == "target" and cfg.graphs.weights != "fp32":
        folder = q4_dir(folder, ACCURACY_LEVELS[cfg.graphs.weights])
    if role in ("eagle3", "peagle", "medusa") and cfg.graphs.head_weights == "q8":
        folder = q8_dir(folder)
    return folder
