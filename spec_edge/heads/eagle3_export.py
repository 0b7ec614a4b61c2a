"""An EAGLE-3 head's static graphs (heads/eagle3.py has the head itself): one ingest graph per width
(1, each k+1, the prefill chunk) and the draft step, exported into the head's artifact folder with
its own weights.bin, draft_ids.npy and head.json (read back by read_head_config).

    eagle3_ingest_<W>: tokens (1, W), hidden (W, 3Ht), position (1,), last_index (1,),
                       k_cache / v_cache (1, Hkv, S, D), embed_table (V, H)
                       -> logits (1, Vd), k_new / v_new (1, Hkv, W, D), hidden_out (1, H)
    eagle3_step_1:     the same with hidden (1, H) (the head's own output; no fc)
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import ModelConfig
from spec_edge.heads import head_folder
from spec_edge.heads.eagle3 import HEAD_FORMAT, HeadConfig, build_module, head_fingerprint, load_head


def head_graph_plan(widths: list[int]) -> dict[str, dict]:
    plan = {f"eagle3_ingest_{w}": {"kind": "ingest", "width": w} for w in sorted(set(widths))}
    plan["eagle3_step_1"] = {"kind": "step", "width": 1}
    return plan


def head_widths(cfg) -> list[int]:
    """Ingest widths for a config: 1, each k+1 and the prefill chunk."""
    return sorted({1, cfg.graphs.prefill_chunk} | {k + 1 for k in cfg.graphs.k_values})


def export_head(cfg, head_path: str | Path, target: ModelConfig, out_dir: Path, progress=print) -> Path:
    """Export the head graphs for cfg into out_dir (its own weights.bin), unless up to date."""
    head_path = Path(head_path).expanduser()
    hcfg, state, draft_ids = load_head(head_path, target)
    wanted = {"format": HEAD_FORMAT, "role": "eagle3", "source": str(head_path),
              "fingerprint": head_fingerprint(head_path), "max_context": cfg.graphs.max_context,
              "dtype": cfg.graphs.dtype, "graphs": head_graph_plan(head_widths(cfg))}

    def write_graph(spec: dict, path: Path, store) -> None:
        export_head_graph(hcfg, state, path, store, fused=spec["kind"] == "ingest", width=spec["width"],
                          max_context=cfg.graphs.max_context, dtype=cfg.graphs.dtype)

    return head_folder.export(out_dir, wanted, write_graph, hcfg, draft_ids, "eagle3 head", progress,
                              embed_arrays(state))


def embed_arrays(state: dict) -> dict:
    """embed_tokens.npy for an exported head that ships its own embedding."""
    return {"embed_tokens": state["embed_tokens.weight"].numpy()} if "embed_tokens.weight" in state else {}


def read_head_config(out_dir: Path) -> HeadConfig:
    raw = json.loads((Path(out_dir) / "head.json").read_text())
    raw["aux_layers"] = tuple(raw["aux_layers"])
    if raw.get("rope_llama3") is not None:
        raw["rope_llama3"] = tuple(raw["rope_llama3"])
    return HeadConfig(**raw)


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

