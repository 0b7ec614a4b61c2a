"""The dynamic batched target graph TensorRT builds for graphs.batch_slots = B > 1 (runtime.backend tensorrt).

    forward(tokens (n, T), position (n,), [embed_table (V, H)], k_cache_0 .. k_cache_{L-1}, v_cache_0 ..)
        -> logits (n, T, V) float32, k_new (L, n, Hkv, T, D), v_new (L, n, Hkv, T, D), [hidden (n, T, nH)]

    k_cache_<i> / v_cache_<i>: (n, Hkv, S, D), rows r = 0..n-1 of the call are n consecutive slots
    n in 1..B and T symbolic; every other dimension static, every tensor's shape a function of (n, T)
    (check_io proves the I/O contract). Attention as the B=1 dynamic graph: scores over the cache and
    over the new rows joined along S + T, a per-row mask hides each row's cache rows >= position[r]
    (graphs/batch_model.py's batch_rope_and_mask / batch_attention, reused as they are).

How a row is tied to a slot's region
------------------------------------
The resident cache is one (L, B, Hkv, S, D) tensor per K and V on the device; layer i's slots
[b0, b0 + n) are ONE contiguous (n, Hkv, S, D) block of it. The graph takes that block as its cache
input (bound by address, no copy), so row r of a call reads slot b0 + r's region and nothing else,
and returns only the new rows; the runner writes them into each row's own slot at its own position
on the device (index_copy_ over a flat view, runtime/backends/trt_batch.py), as the B=1 runner does.
A call over an arbitrary subset of slots runs the rows [0, max(slot) + 1) with b0 = 0: rows of slots
not in the call are idle rows (token 0 at position 0, their new rows never written anywhere, their
logits dropped). The prefill chunk runs n = 1 with b0 = the joining slot (its own block).

Why not the alternatives, on a memory-bound device (bytes per call, R = one slot's region, Hkv S D
per layer; for Llama-3.1-8B bf16 at S = 8192 that is 1 GiB over the 32 layers, against 15 GiB of
weights every call reads):
  - a slot-index input and Gather of the rows' regions inside the graph: reads n R, writes an n R
    copy and reads it again for attention (3 n R), and the copy is live scratch (2 n R per layer);
    at n = 8 that is +16 GiB per call, more than the weights. TensorRT does not fuse a Gather into
    the attention MatMul.
  - ScatterND of the new rows into a (B, Hkv, S, D) cache input inside the graph: an engine output is
    a new tensor, so the whole cache would be copied every call (B R per layer). The cache is written
    outside the engine instead.
  - the whole (B, Hkv, S, D) layer as input, every row attending to every slot with a mask: reads B R
    once but computes and stores scores of every row against every slot (n x B x S per head).
  - this layout: reads exactly the regions of rows [b0, b0 + n): n R for a prefix of occupied slots
    (the batch loop fills the lowest free slot, so occupied slots are a prefix but for holes a
    finished request leaves until the next join fills them); an idle row costs its region's read
    (R / (weights + n R) of a call) and its share of the small decode GEMMs. The cache is never copied.

The prefill chunk C keeps n = 1 (its profile is (1, C)): a joining prompt's chunk runs alone between
the other slots' decode calls (runtime/batch.py), C rows are compute-bound, and batching chunks of
different prompts would make a slot's first token wait for another prompt's chunks.

Folder: <engine_dir>/<profile>/onnx/target_dynamic_b<B>/ (never target/ or target_b<B>/, which the
B=1 dynamic export and the ONNX Runtime static batched export own): dynamic.onnx, weights.bin,
manifest.json (export.py's keys + "batch_slots"; the graph spec has "batch": B), the side files,
and with a head configured the shared embedding table record (graphs/shared_table.py).
"""
from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

from spec_edge.config import Config, ConfigError, engine_root
from spec_edge.graphs import export, hidden, io_names, shared_table

Progress = Callable[[str], None]
STEM = export.DYNAMIC_STEM  # dynamic.onnx, as the B=1 dynamic export
ROWS, WIDTH = "n", "T"      # the two symbolic dimensions' names in the ONNX file


@functools.cache
def module_class():
    """DynamicBatchCaches, made on first use (torch is imported only by an export or a test)."""
    import torch

    from spec_edge.graphs.batch_model import batch_attention, batch_rope_and_mask
    from spec_edge.graphs.model import Transformer

    class DynamicBatchCaches(Transformer):
        """forward(tokens (n, T), position (n,), [embed_table (V, H)], k_cache_0 .. (n, Hkv, S, D), v_cache_0 ..);
        a Transformer subclass, so initializer names stay Hugging Face's (the Q/DQ pass finds them)."""

        table_input = False  # True: embed_table (V, H) follows position (a head shares the table)

        def forward(self, tokens, position, *rest):
            embed_table, caches = (rest[0], rest[1:]) if self.table_input else (None, rest)
            batch, seq = tokens.shape
            n_layers = len(caches) // 2
            k_caches, v_caches = caches[:n_layers], caches[n_layers:]
            flat = tokens.reshape(batch * seq)
            x = self.model.embed_tokens(flat) if embed_table is None else torch.index_select(embed_table, 0, flat)
            cos, sin, mask = batch_rope_and_mask(self.inv_freq, position, seq, k_caches[0].shape[2], x.dtype)
            cos, sin, mask = cos.to(x.dtype), sin.to(x.dtype), mask.to(x.dtype)  # (n, T, D) x2, (n, T, S + T)
            k_news, v_news, hiddens = [], [], []
            for i, layer in enumerate(self.model.layers):  # x (n*T, H)
                attn, k_new, v_new = batch_attention(layer.self_attn, layer.input_layernorm(x), cos, sin,
                                                     k_caches[i], v_caches[i], mask, batch, seq)
                x = x + attn
                x = x + layer.mlp(layer.post_attention_layernorm(x))
                k_news.append(k_new)  # (n, Hkv, T, D)
                v_news.append(v_new)
                if i in self.hidden_layers:
                    hiddens.append(x)
            if self.n_layers in self.hidden_layers:  # index L: the final-norm state (Medusa)
                hiddens.append(self.model.norm(x))
            logits = self.head(x, embed_table).view(batch, seq, -1)  # (n, T, V) float32
            outputs = (logits, torch.stack(k_news), torch.stack(v_news))  # (L, n, Hkv, T, D)
            if self.hidden_layers:
                outputs = outputs + (torch.cat(hiddens, dim=-1).view(batch, seq, -1),)  # (n, T, nH)
            return outputs

    return DynamicBatchCaches


def folder(cfg: Config) -> Path:
    return engine_root(cfg) / cfg.runtime.profile / "onnx" / f"target_dynamic_b{cfg.graphs.batch_slots}"


def wanted(cfg: Config, fingerprint: str) -> dict:
    g = cfg.graphs
    spec = {"kind": "dynamic", "width": 0, "batch": g.batch_slots}
    layers = hidden.target_hidden_layers(cfg)
    if layers:  # a head reads them; it also shares the target's embedding table (an input)
        spec.update(hidden_layers=list(layers), embed_input=True)
    return {"format": export.FORMAT_VERSION, "role": "target", "source": cfg.model.target, "fingerprint": fingerprint,
            "max_context": g.max_context, "prefill_chunk": g.prefill_chunk, "dtype": g.dtype, "layout": "shared",
            "batch_slots": g.batch_slots, "graphs": {STEM: spec}}


def export_batch_dynamic(cfg: Config, progress: Progress = print) -> Path:
    """The batched dynamic export of cfg's target (made once under a lock; redone when the checkpoint,
    a shape, B or the returned hidden states change). Returns its folder."""
    from spec_edge.graphs import weights

    if cfg.graphs.batch_slots < 2:
        raise ConfigError("graphs.batch_slots=1: the B=1 dynamic graph is export.export_model(dynamic=True)")
    want = wanted(cfg, weights.fingerprint(cfg.model.target))
    out = folder(cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    return export.ensure_derived(out, want, lambda tmp: _export_into(cfg, want, tmp, progress))


def _export_into(cfg: Config, want: dict, out_dir: Path, progress: Progress) -> None:
    from spec_edge.graphs import weights

    started, g = time.monotonic(), cfg.graphs
    progress(f"[export] batched dynamic target (B={g.batch_slots}): loading {cfg.model.target} ...")
    model_cfg, state, tokenizer, store = export.load_into(cfg, cfg.model.target, out_dir)
    spec = want["graphs"][STEM]
    export_graph(model_cfg, state, out_dir / f"{STEM}.onnx", store, batch=g.batch_slots, max_context=g.max_context,
                 dtype=g.dtype, hidden_layers=tuple(spec.get("hidden_layers", ())),
                 embed_input=bool(spec.get("embed_input")))
    manifest = dict(want, model=model_cfg.name)
    if spec.get("embed_input"):  # the table is stored once, for the embed_table input
        manifest[shared_table.KEY] = shared_table.store(
            state[shared_table.TENSOR].to(export.torch_dtype(g.dtype)), store, g.dtype)
    store.close()
    weights.write_side_files(out_dir, model_cfg, tokenizer)
    manifest.update(weights_bytes=store.size, export_seconds=round(time.monotonic() - started, 1))
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[export] batched dynamic target: {STEM}.onnx in {manifest['export_seconds']} s")


def export_graph(model_cfg, state: dict, path: Path, store: export.WeightStore, *, batch: int, max_context: int,
                 dtype: str = "float32", hidden_layers: tuple[int, ...] = (), embed_input: bool = False) -> None:
    """Trace DynamicBatchCaches with n in [1, batch] and T in [1, max_context] symbolic; check the I/O contract."""
    import torch

    from spec_edge.graphs import model as model_mod

    tdtype = export.torch_dtype(dtype)
    module = model_mod.build(model_cfg, state, dtype=tdtype, hidden_layers=hidden_layers, cls=module_class())
    module.table_input = embed_input
    n_example = 2 if batch == 2 else 3  # torch.export specialises example sizes 0 and 1
    layer = (n_example, model_cfg.n_kv_heads, max_context, model_cfg.head_dim)  # (n, Hkv, S, D)
    args = (torch.zeros(n_example, 4, dtype=torch.int64), torch.zeros(n_example, dtype=torch.int64))
    inputs = [io_names.TOKENS, io_names.POSITION]
    if embed_input:
        args = args + (torch.zeros(model_cfg.vocab_size, model_cfg.hidden_size, dtype=tdtype),)
        inputs.append(io_names.EMBED_TABLE)
    caches = tuple(torch.zeros(layer, dtype=tdtype) for _ in range(2 * model_cfg.n_layers))
    args = args + caches
    inputs += io_names.cache_inputs(model_cfg.n_layers)
    rows = torch.export.Dim(ROWS, min=1, max=batch)
    width = torch.export.Dim(WIDTH, min=1, max=max_context)
    shapes = torch.export.ShapesCollection()  # by tensor: forward(tokens, position, *rest)
    shapes[args[0]] = {0: rows, 1: width}
    shapes[args[1]] = {0: rows}
    for cache in caches:
        shapes[cache] = {0: rows}
    outputs = list(io_names.GRAPH_OUTPUTS) + ([io_names.HIDDEN] if hidden_layers else [])
    graph = export.trace(module, args, inputs, outputs, shapes)
    check_io(graph, path.name, model_cfg, max_context, len(hidden_layers) * model_cfg.hidden_size, embed_input)
    export.save(graph, path, store)


def check_io(graph, name: str, model_cfg, max_context: int, hidden_width: int = 0, embed_input: bool = False) -> None:
    """The batched dynamic I/O contract: n and T symbolic exactly where the module docstring says, n the
    same symbol everywhere, T another one; everything else static."""
    def dims(value):
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in value.type.tensor_type.shape.dim]

    have = {v.name: dims(v) for v in list(graph.graph.input) + list(graph.graph.output)}
    tokens = have.get(io_names.TOKENS, [])
    if len(tokens) != 2 or not all(isinstance(d, str) and d for d in tokens) or tokens[0] == tokens[1]:
        raise RuntimeError(f"{name}: tokens is {tokens}, want two different symbolic dimensions (n, T)")
    n, t = tokens
    m, layers = model_cfg, model_cfg.n_layers
    want = {io_names.TOKENS: [n, t], io_names.POSITION: [n], io_names.LOGITS: [n, t, m.vocab_size],
            io_names.K_NEW: [layers, n, m.n_kv_heads, t, m.head_dim],
            io_names.V_NEW: [layers, n, m.n_kv_heads, t, m.head_dim]}
    want.update({c: [n, m.n_kv_heads, max_context, m.head_dim] for c in io_names.cache_inputs(layers)})
    if hidden_width:
        want[io_names.HIDDEN] = [n, t, hidden_width]
    if embed_input:
        want[io_names.EMBED_TABLE] = [m.vocab_size, m.hidden_size]
    extra = sorted(set(have) - set(want))
    wrong = {k: have.get(k) for k, v in want.items() if have.get(k) != v}
    if extra:
        raise RuntimeError(f"{name}: batched dynamic export has I/O tensors {extra} unnamed here")
    if wrong:
        raise RuntimeError(f"{name}: batched dynamic export has unexpected I/O shapes {wrong}, expected "
                           f"{ {k: want[k] for k in wrong} }")
