"""The heads' exporters (the build's; the runtime reads what they make through the readers beside each head's
config: eagle3_layouts.read_head_config, medusa.read_config). Each writes a head's static graphs into its artifact
folder (export_folder: its own weights.bin, draft_ids.npy, head.json, manifest.json).

EAGLE-3 (heads/eagle3.py has the head itself): one ingest graph per width (1, each k+1, the prefill chunk) and the
draft step:

    eagle3_ingest_<W>: tokens (1, W), hidden (W, 3Ht), position (1,), last_index (1,),
                       k_cache / v_cache (1, Hkv, S, D), embed_table (V, H)
                       -> logits (1, Vd), k_new / v_new (1, Hkv, W, D), hidden_out (1, H)
    eagle3_step_1:     the same with hidden (1, H) (the head's own output; no fc)

P-EAGLE: EAGLE-3's ingest graphs and a draft pass per built k; Medusa: one graph, hidden (1, H) -> logits (n, Vd).
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spec_edge.config import ModelConfig
from spec_edge.heads import medusa, peagle
from spec_edge.heads.eagle3 import HEAD_FORMAT, HeadConfig, build_module, head_fingerprint, load_head


def _same_config(out_dir: Path, head_cfg) -> bool:
    """head.json holds head_cfg: the graphs were made from the same reading of config.json (a loader
    that now reads a key differently, e.g. a theta, re-exports; fields head.json predates count as
    their defaults)."""
    path = out_dir / "head.json"
    if not path.is_file():
        return False
    defaults = {field.name: field.default for field in dataclasses.fields(head_cfg)
                if field.default is not dataclasses.MISSING}
    have = {**defaults, **json.loads(path.read_text())}
    return json.loads(json.dumps(have)) == json.loads(json.dumps(dataclasses.asdict(head_cfg)))


def export_folder(out_dir: Path, wanted: dict, write_graph: Callable, head_cfg, draft_ids: np.ndarray,
           label: str, progress=print, arrays: dict | None = None) -> Path:
    """Export a head's graphs into out_dir (its own weights.bin), unless up to date (the manifest
    has every key of wanted and each of wanted["graphs"] is there): write_graph(spec, path, store)
    per graph, then draft_ids.npy, head.json (head_cfg), <name>.npy per arrays and manifest.json,
    written into a temporary folder that then replaces out_dir, under out_dir's writer lock
    (graphs/folders.py: a concurrent exporter waits, then finds it made)."""
    import time

    from spec_edge.graphs import folders
    from spec_edge.graphs.export import WeightStore

    out_dir = Path(out_dir)

    def current() -> bool:
        try:
            have = json.loads((out_dir / "manifest.json").read_text())
        except (OSError, json.JSONDecodeError):
            return False
        return all(have.get(key) == value for key, value in wanted.items()) and all(
            (out_dir / f"{stem}.onnx").is_file() for stem in wanted["graphs"]) and _same_config(out_dir, head_cfg)

    if current():
        folders.mark_used(out_dir)
        return out_dir
    with folders.writing(out_dir, progress, f"[export] {label}:"):
        if current():
            folders.mark_used(out_dir)
            return out_dir
        started = time.monotonic()
        tmp_dir = folders.temporary(out_dir)
        store = WeightStore(tmp_dir / "weights.bin")
        for stem, spec in wanted["graphs"].items():
            progress(f"[export] {label}: {stem} ...")
            write_graph(spec, tmp_dir / f"{stem}.onnx", store)
        store.close()
        np.save(tmp_dir / "draft_ids.npy", draft_ids)
        (tmp_dir / "head.json").write_text(json.dumps(dataclasses.asdict(head_cfg), indent=1))
        for name, array in (arrays or {}).items():
            np.save(tmp_dir / f"{name}.npy", array)
        manifest = dict(wanted, export_seconds=round(time.monotonic() - started, 1))
        (tmp_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
        folders.publish(tmp_dir, out_dir)
        folders.mark_used(out_dir)
    n = len(wanted["graphs"])
    progress(f"[export] {label}: {n} graph{'' if n == 1 else 's'} in {manifest['export_seconds']} s")
    return out_dir


def head_graph_plan(widths: list[int]) -> dict[str, dict]:
    plan = {f"eagle3_ingest_{w}": {"kind": "ingest", "width": w} for w in sorted(set(widths))}
    plan["eagle3_step_1"] = {"kind": "step", "width": 1}
    return plan


def head_widths(cfg) -> list[int]:
    """Ingest widths for a config: 1, each k+1 and the prefill chunk."""
    return sorted({1, cfg.graphs.prefill_chunk} | {k + 1 for k in cfg.graphs.k_values})


def export_eagle3(cfg, head_path: str | Path, target: ModelConfig, out_dir: Path, progress=print) -> Path:
    """Export the head graphs for cfg into out_dir (its own weights.bin), unless up to date."""
    head_path = Path(head_path).expanduser()
    hcfg, state, draft_ids = load_head(head_path, target)
    wanted = {"format": HEAD_FORMAT, "role": "eagle3", "source": str(head_path),
              "fingerprint": head_fingerprint(head_path), "max_context": cfg.graphs.max_context,
              "dtype": cfg.graphs.dtype, "graphs": head_graph_plan(head_widths(cfg))}

    def write_graph(spec: dict, path: Path, store) -> None:
        export_head_graph(hcfg, state, path, store, fused=spec["kind"] == "ingest", width=spec["width"],
                          max_context=cfg.graphs.max_context, dtype=cfg.graphs.dtype)

    return export_folder(out_dir, wanted, write_graph, hcfg, draft_ids, "eagle3 head", progress,
                              embed_arrays(state))


def embed_arrays(state: dict) -> dict:
    """embed_tokens.npy for an exported head that ships its own embedding."""
    return {"embed_tokens": state["embed_tokens.weight"].numpy()} if "embed_tokens.weight" in state else {}


def export_head_graph(hcfg: HeadConfig, state: dict, path: Path, store, *, fused: bool, width: int,
                      max_context: int, dtype: str = "float32") -> None:
    import torch

    from spec_edge.graphs import export, io_names

    tdtype = export.torch_dtype(dtype)
    module = build_module(hcfg, state).to(tdtype).eval()
    module.fused = fused
    shape = (1, hcfg.n_kv_heads, max_context, hcfg.head_dim)
    hidden_in = 3 * hcfg.target_hidden_size if fused else hcfg.hidden_size
    args = (torch.zeros(1, width, dtype=torch.int64), torch.zeros(width, hidden_in, dtype=tdtype),
            torch.tensor([0]), torch.tensor([width - 1]), torch.zeros(shape, dtype=tdtype),
            torch.zeros(shape, dtype=tdtype), torch.zeros(hcfg.target_vocab_size, hcfg.hidden_size, dtype=tdtype))
    inputs = [io_names.TOKENS, io_names.HIDDEN, io_names.POSITION, io_names.LAST_INDEX, io_names.K_CACHE,
              io_names.V_CACHE, io_names.EMBED_TABLE]
    outputs = [io_names.LOGITS, io_names.K_NEW, io_names.V_NEW, io_names.HIDDEN_OUT]
    export.save_static(module, args, inputs, outputs, path, store)


def medusa_graph_stem(mcfg: medusa.MedusaConfig) -> str:
    return f"medusa_{mcfg.n_heads}"


def export_medusa(cfg, head_path: str | Path, target: ModelConfig, out_dir: Path, progress=print) -> Path:
    """Export the heads' graph into out_dir (its own weights.bin), unless up to date."""
    from spec_edge.graphs import export, io_names

    head_path = Path(head_path).expanduser()
    mcfg, state, draft_ids = medusa.load_heads(head_path, target)
    wanted = {"format": medusa.HEAD_FORMAT, "role": "medusa", "source": str(head_path),
              "fingerprint": medusa.head_fingerprint(head_path), "dtype": cfg.graphs.dtype,
              "graphs": {medusa_graph_stem(mcfg): {"kind": "medusa", "width": 1, "n_heads": mcfg.n_heads}}}

    def write_graph(spec: dict, path: Path, store) -> None:
        import torch

        tdtype = export.torch_dtype(cfg.graphs.dtype)
        module = medusa.build_module(mcfg, state).to(tdtype).eval()
        export.save_static(module, (torch.zeros(1, mcfg.hidden_size, dtype=tdtype),), [io_names.HIDDEN],
                           [io_names.LOGITS], path, store)

    return export_folder(out_dir, wanted, write_graph, mcfg, draft_ids, "medusa heads", progress)


def peagle_graph_plan(cfg) -> dict[str, dict]:
    """Ingest widths 1, each k and the prefill chunk (the newest pair goes through the draft pass,
    so an ingest after a verify is at most k wide); a draft pass per built k."""
    widths = sorted({1, cfg.graphs.prefill_chunk} | set(cfg.graphs.k_values))
    plan = {f"eagle3_ingest_{w}": {"kind": "ingest", "width": w} for w in widths}
    plan.update({f"peagle_draft_{k}": {"kind": "draft", "width": k} for k in sorted(set(cfg.graphs.k_values))})
    return plan


def export_peagle(cfg, head_path: str | Path, target: ModelConfig, out_dir: Path, progress=print) -> Path:
    """Export the head graphs for cfg into out_dir (its own weights.bin), unless up to date."""
    head_path = Path(head_path).expanduser()
    hcfg, state, draft_ids = peagle.load_head(head_path, target)
    wanted = {"format": peagle.HEAD_FORMAT, "role": "peagle", "source": str(head_path),
              "fingerprint": head_fingerprint(head_path), "max_context": cfg.graphs.max_context,
              "dtype": cfg.graphs.dtype, "graphs": peagle_graph_plan(cfg)}

    def write_graph(spec: dict, path: Path, store) -> None:
        if spec["kind"] == "ingest":
            export_head_graph(hcfg, state, path, store, fused=True, width=spec["width"],
                                     max_context=cfg.graphs.max_context, dtype=cfg.graphs.dtype)
        else:
            export_peagle_draft_graph(hcfg, state, path, store, width=spec["width"], max_context=cfg.graphs.max_context,
                               dtype=cfg.graphs.dtype)

    return export_folder(out_dir, wanted, write_graph, hcfg, draft_ids, "peagle head", progress,
                              embed_arrays(state))


def export_peagle_draft_graph(hcfg: HeadConfig, state: dict, path: Path, store, *, width: int, max_context: int,
                       dtype: str = "float32") -> None:
    import torch

    from spec_edge.graphs import export, io_names

    tdtype = export.torch_dtype(dtype)
    module = peagle.build_module(hcfg, state, width).to(tdtype).eval()
    shape = (1, hcfg.n_kv_heads, max_context, hcfg.head_dim)
    args = (torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 3 * hcfg.target_hidden_size, dtype=tdtype),
            torch.tensor([0]), torch.zeros(shape, dtype=tdtype), torch.zeros(shape, dtype=tdtype),
            torch.zeros(hcfg.target_vocab_size, hcfg.hidden_size, dtype=tdtype))
    inputs = [io_names.TOKENS, io_names.HIDDEN, io_names.POSITION, io_names.K_CACHE, io_names.V_CACHE,
              io_names.EMBED_TABLE]
    outputs = [io_names.LOGITS, io_names.K_NEW, io_names.V_NEW]
    export.save_static(module, args, inputs, outputs, path, store)
