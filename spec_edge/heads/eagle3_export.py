"""An EAGLE-3 head's static graphs (heads/eagle3.py has the head itself): one ingest graph per width
(1, each k+1, the prefill chunk) and the draft step, exported into the head's artifact folder with
its own weights.bin, draft_ids.npy and head.json (read back by read_head_config).

    eagle3_ingest_<W>: tokens (1, W), hidden (W, 3Ht), position (1,), last_index (1,),
                       k_cache / v_cache (1, Hkv, S, D), embed_table (V, H)
                       -> logits (1, Vd), k_new / v_new (1, Hkv, W, D), hidden_out (1, H)
    eagle3_step_1:     the same with hidden (1, H) (the head's own output; no fc)

and the TensorRT-bound one (export_dynamic_head): eagle3_dynamic.onnx, every width in one graph with
the d2t-mapped argmax inside (dynamic_head_module says how).
"""
from __future__ import annotations

import json
from pathlib import Path

from spec_edge.config import ConfigError, ModelConfig
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


# ---------------------------------------------------------------------------------------------
# The TensorRT-bound head graph: one dynamic-width graph, one engine, a profile per width

DYNAMIC_HEAD_STEM = "eagle3_dynamic"


def dynamic_head_plan() -> dict[str, dict]:
    return {DYNAMIC_HEAD_STEM: {"kind": "dynamic", "width": 0}}


def export_dynamic_head(cfg, head_path: str | Path, target: ModelConfig, out_dir: Path, progress=print) -> Path:
    """Export the head's one dynamic-width graph (export_dynamic_head_graph) into out_dir, unless up to date.

    TensorRT builds one engine from it with an optimization profile per ingest width (1, each k+1,
    the prefill chunk; head_widths) and one more width-1 profile for the draft step (an execution
    context per profile, so the step has its own; specs.engine_specs)."""
    head_path = Path(head_path).expanduser()
    hcfg, state, draft_ids = load_head(head_path, target)
    if hcfg.has_embedding:
        raise ConfigError(f"EAGLE-3 head '{head_path}' ships its own embed_tokens: the TensorRT head graph reads "
                          f"the target's table (embed_table), so such a head runs on runtime.backend: onnxruntime")
    wanted = {"format": HEAD_FORMAT, "role": "eagle3", "source": str(head_path),
              "fingerprint": head_fingerprint(head_path), "max_context": cfg.graphs.max_context,
              "dtype": cfg.graphs.dtype, "layout": "shared", "widths": head_widths(cfg),
              "graphs": dynamic_head_plan()}

    def write_graph(spec: dict, path: Path, store) -> None:
        export_dynamic_head_graph(hcfg, state, draft_ids, path, store, max_context=cfg.graphs.max_context,
                                  dtype=cfg.graphs.dtype)

    return head_folder.export(out_dir, wanted, write_graph, hcfg, draft_ids, "eagle3 head (dynamic)", progress)


def dynamic_head_module(hcfg: HeadConfig, state: dict, draft_ids, dtype: str = "float32"):
    """The head with the TensorRT graph's forward (io_names.py's HIDDEN_DRAFT / DRAFT_TOKEN):

    forward(tokens (1, T), hidden (T, 3Ht), hidden_draft (T, H), position (1,), last_index (1,),
            k_cache, v_cache (1, Hkv, S, D), embed_table (V, H))
      -> logits (1, Vd) float32, draft_token (1,) int64, k_new, v_new (1, Hkv, T, D), hidden_out (1, H)

    The head row is fc(hidden) + hidden_draft: an ingest passes zeros as hidden_draft, a draft step
    zeros as hidden (fc has no bias). draft_token = d2t[argmax(logits)] is computed in the graph, so a
    draft chain sends one target id per step to the host; the next step reads it on the device."""
    import torch

    from spec_edge.graphs import export

    head = build_module(hcfg, state).to(export.torch_dtype(dtype)).eval()

    class DynamicHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.head = head
            self.register_buffer("draft_ids", torch.as_tensor(draft_ids, dtype=torch.int64))  # (Vd,) -> target id

        def forward(self, tokens, hidden, hidden_draft, position, last_index, k_cache, v_cache, embed_table):
            h_in = self.head.fc(hidden) + hidden_draft  # (T, H)
            emb = torch.index_select(embed_table, 0, tokens[0])  # (T, H)
            h, k_new, v_new = self.head.layer(emb, h_in, position, k_cache, v_cache, tokens.shape[1])
            h_last = torch.index_select(h, 0, last_index)  # (1, H)
            logits = self.head.lm_head(self.head.norm(h_last)).float()  # (1, Vd)
            draft_token = torch.index_select(self.draft_ids, 0, torch.argmax(logits, dim=-1))  # (1,)
            return logits, draft_token, k_new[None], v_new[None], h_last

    return DynamicHead().eval()


def dynamic_head_io() -> tuple[list[str], list[str]]:
    from spec_edge.graphs import io_names

    inputs = [io_names.TOKENS, io_names.HIDDEN, io_names.HIDDEN_DRAFT, io_names.POSITION, io_names.LAST_INDEX,
              io_names.K_CACHE, io_names.V_CACHE, io_names.EMBED_TABLE]
    outputs = [io_names.LOGITS, io_names.DRAFT_TOKEN, io_names.K_NEW, io_names.V_NEW, io_names.HIDDEN_OUT]
    return inputs, outputs


def export_dynamic_head_graph(hcfg: HeadConfig, state: dict, draft_ids, path: Path, store, *, max_context: int,
                              dtype: str = "float32") -> None:
    """Trace dynamic_head_module with a symbolic T (traced at 4), check its I/O contract, save it."""
    import torch

    from spec_edge.graphs import export

    tdtype = export.torch_dtype(dtype)
    module = dynamic_head_module(hcfg, state, draft_ids, dtype)
    H, width = hcfg.hidden_size, 4
    cache = (1, hcfg.n_kv_heads, max_context, hcfg.head_dim)
    args = (torch.zeros(1, width, dtype=torch.int64), torch.zeros(width, 3 * hcfg.target_hidden_size, dtype=tdtype),
            torch.zeros(width, H, dtype=tdtype), torch.tensor([0]), torch.tensor([width - 1]),
            torch.zeros(cache, dtype=tdtype), torch.zeros(cache, dtype=tdtype),
            torch.zeros(hcfg.target_vocab_size, H, dtype=tdtype))
    tokens_dim = torch.export.Dim("T", min=1, max=max_context)
    shapes = torch.export.ShapesCollection()
    shapes[args[0]] = {1: tokens_dim}
    shapes[args[1]] = {0: tokens_dim}
    shapes[args[2]] = {0: tokens_dim}
    inputs, outputs = dynamic_head_io()
    graph = export.trace(module, args, inputs, outputs, shapes)
    check_dynamic_head_io(graph, path.name, hcfg, max_context)
    export.save(graph, path, store)


def check_dynamic_head_io(graph, name: str, hcfg: HeadConfig, max_context: int) -> None:
    """T symbolic exactly on the token axis of tokens, hidden, hidden_draft, k_new and v_new."""
    from spec_edge.graphs import io_names

    def dims(value):
        return [d.dim_value if d.HasField("dim_value") else "T" for d in value.type.tensor_type.shape.dim]

    H, kv, D = hcfg.hidden_size, hcfg.n_kv_heads, hcfg.head_dim
    want = {io_names.TOKENS: [1, "T"], io_names.HIDDEN: ["T", 3 * hcfg.target_hidden_size],
            io_names.HIDDEN_DRAFT: ["T", H], io_names.POSITION: [1], io_names.LAST_INDEX: [1],
            io_names.K_CACHE: [1, kv, max_context, D], io_names.V_CACHE: [1, kv, max_context, D],
            io_names.EMBED_TABLE: [hcfg.target_vocab_size, H], io_names.LOGITS: [1, hcfg.draft_vocab_size],
            io_names.DRAFT_TOKEN: [1], io_names.K_NEW: [1, kv, "T", D], io_names.V_NEW: [1, kv, "T", D],
            io_names.HIDDEN_OUT: [1, H]}
    have = {v.name: dims(v) for v in list(graph.graph.input) + list(graph.graph.output)}
    if have != want:
        wrong = {k: have.get(k) for k in set(want) | set(have) if have.get(k) != want.get(k)}
        raise RuntimeError(f"{name}: the dynamic head graph has unexpected I/O {wrong}, expected "
                           f"{ {k: want.get(k) for k in wrong} }")
