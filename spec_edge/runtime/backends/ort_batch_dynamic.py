"""ONNX Runtime over the batched dynamic graph TensorRT is given for graphs.batch_slots = B > 1
(graphs/batch_dynamic.py, onnx/target_dynamic_b<B>/dynamic.onnx), with TensorRTBatchRunner's contract
and row binding (batch_rows.py), so CPUs check the exact file and the exact way the device runs it.

State, allocated once, laid out as TensorRTBatchRunner's (trt_batch.cache_store, float32 on the CPU):
  k_store, v_store  (L, B Hkv S + spare, D); k_cache / v_cache: their (L, B, Hkv, S, D) views; a call binds
                    layer i's block of slots [b0, b0 + n), (n, Hkv, S, D), as k_cache_<i> (a view, no copy)
  hidden_store      (B S + widest T, nH) when the graph returns hidden states; hidden: its (B, S, nH) view
  embed_table       (V, H) read-only memory map of weights.bin when the graph takes it
  held              one tuple of token ids per slot (prefix reuse records; the caller keeps them)
A decode call (width 1 or k+1) runs rows [0, n) = slots [0, n) (idle rows for slots not called) and
writes its new rows through the device runner's own arithmetic (batch_rows.store_targets,
trt_batch.store_index: called slots at their positions, idle rows into the spare rows); a prefill chunk
runs n = 1 bound to its slot's block. float32 files only (numpy has no bfloat16).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from spec_edge.graphs import export, io_names
from spec_edge.graphs.batch_dynamic import STEM
from spec_edge.runtime.backends.base import BackendError, prefill_in_chunks
from spec_edge.runtime.backends.batch_rows import RowCount, check_call, check_chunk, plan_call, store_targets
from spec_edge.runtime.backends.ort_dynamic import _manifest, _session, shared_embed_table
from spec_edge.runtime.backends.trt_batch import cache_store, store_index


class OrtBatchDynamicRunner:
    """B slots over one (L, B, Hkv, S, D) cache through the batched dynamic graph; decode widths `widths`."""

    step_width = 1

    def __init__(self, graph_dir: str | Path, widths: Iterable[int], threads: int = 0):
        self.graph_dir = Path(graph_dir)
        self.manifest = _manifest(self.graph_dir)
        self.batch = int(self.manifest.get("batch_slots", 1))
        spec = self.manifest.get("graphs", {}).get(STEM, {})
        if self.batch < 2 or spec.get("batch") != self.batch:
            raise BackendError(f"{self.graph_dir} is not a batched dynamic export (graphs/batch_dynamic.py)")
        self.model_cfg = cfg = export.read_model_config(self.graph_dir)
        self.max_context = int(self.manifest["max_context"])
        self.prefill_chunk = int(self.manifest["prefill_chunk"])
        self.vocab_size = cfg.vocab_size
        import torch

        self.widths = frozenset(widths)
        widest = max(self.widths | {self.prefill_chunk})
        geometry = (cfg.n_layers, self.batch, cfg.n_kv_heads, self.max_context, cfg.head_dim, widest, torch.float32)
        stores = [cache_store(torch, *geometry, device="cpu") for _ in range(2)]
        (self.k_store, self.k_cache), (self.v_store, self.v_cache) = [(s.numpy(), c.numpy()) for s, c, _ in stores]
        self.spare_step = stores[0][2]
        n_hidden = len(spec.get("hidden_layers", ())) * cfg.hidden_size
        self.hidden_store = (np.zeros((self.batch * self.max_context + widest, n_hidden), np.float32)
                             if n_hidden else None)
        self.hidden = None if self.hidden_store is None else \
            self.hidden_store[:self.batch * self.max_context].reshape(self.batch, self.max_context, n_hidden)
        self.embed_table = shared_embed_table(self.graph_dir) if spec.get("embed_input") else None
        self.session = _session(self.graph_dir / f"{STEM}.onnx", threads)
        self.held: list[tuple[int, ...]] = [() for _ in range(self.batch)]
        self.rows = {w: RowCount(self.batch) for w in self.widths}
        self.calls = {"decode": 0, "prefill": 0, "idle_rows": 0}

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no batched width {width} (k={width - 1}); exported for k in {ks}")

    def _run(self, base: int, tokens: np.ndarray, positions: np.ndarray) -> dict[str, np.ndarray]:
        """One session run over rows = slots [base, base + n); returns the outputs by name."""
        n = tokens.shape[0]
        binding = self.session.io_binding()
        binding.bind_cpu_input(io_names.TOKENS, np.ascontiguousarray(tokens))
        binding.bind_cpu_input(io_names.POSITION, np.ascontiguousarray(positions))
        if self.embed_table is not None:
            binding.bind_cpu_input(io_names.EMBED_TABLE, self.embed_table)
        for layer in range(self.model_cfg.n_layers):  # (n, Hkv, S, D): a view of the block, no copy
            binding.bind_cpu_input(io_names.k_cache(layer), self.k_cache[layer, base:base + n])
            binding.bind_cpu_input(io_names.v_cache(layer), self.v_cache[layer, base:base + n])
        names = list(io_names.GRAPH_OUTPUTS) + ([io_names.HIDDEN] if self.hidden is not None else [])
        for name in names:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu()))


    def forward(self, slots: Sequence[int], tokens, positions: Sequence[int]) -> np.ndarray:
        """Rows `slots` of an (n, T) call: writes each slot's T rows at its position; logits (m, T, V)."""
        slots, tokens, positions = check_call(self.batch, self.max_context, self.widths, slots, tokens, positions)
        width = tokens.shape[1]
        call = plan_call(slots, tokens, positions, self.rows[width].rows_for(max(slots) + 1))
        out = self._run(0, call.tokens, call.positions)
        dest, step, hdest = store_targets(call, self.model_cfg.n_kv_heads, self.max_context, self.batch,
                                          self.spare_step)
        index = store_index(dest, step, np.arange(self.model_cfg.n_kv_heads), np.arange(width), width)
        layers, head_dim = self.model_cfg.n_layers, self.model_cfg.head_dim
        self.k_store[:, index] = out[io_names.K_NEW].reshape(layers, -1, head_dim)  # (L, n Hkv T, D)
        self.v_store[:, index] = out[io_names.V_NEW].reshape(layers, -1, head_dim)
        if self.hidden_store is not None:
            rows = (hdest.reshape(-1, 1) + np.arange(width).reshape(1, width)).reshape(-1)
            self.hidden_store[rows] = out[io_names.HIDDEN].reshape(call.n * width, -1)
        self.calls["decode"] += 1
        self.calls["idle_rows"] += call.n - len(slots)
        return out[io_names.LOGITS][list(slots)]

    def argmax(self, slots: Sequence[int], tokens, positions: Sequence[int]) -> np.ndarray:
        """Greedy token after each position of each called slot, (m, T) int64."""
        return np.argmax(self.forward(slots, tokens, positions), axis=-1)

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None:
        """Slot target's cache rows [0, n_rows) := slot source's (BatchEngine.warm)."""
        self.k_cache[:, target, :, :n_rows] = self.k_cache[:, source, :, :n_rows]
        self.v_cache[:, target, :, :n_rows] = self.v_cache[:, source, :, :n_rows]
        if self.hidden is not None:
            self.hidden[target, :n_rows] = self.hidden[source, :n_rows]

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray:
        """All of token_ids into slot's region at [position, ...) in chunks of C; the last token's logits (V,)."""
        return prefill_in_chunks(lambda part, at: self.prefill_chunk_at(slot, part, at), self.prefill_chunk,
                                 self.max_context, token_ids, position)

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int) -> np.ndarray:
        """One chunk (1..C tokens) into slot at position, run alone (n = 1, the slot's block); its last logits (V,)."""
        check_chunk(self.batch, self.max_context, self.prefill_chunk, slot, part, position)
        n_valid = len(part)
        tokens = np.asarray([list(part) + [part[-1]] * (self.prefill_chunk - n_valid)], np.int64)  # padded at the end
        out = self._run(slot, tokens, np.asarray([position], np.int64))
        end = position + n_valid  # the chunk's real rows only, as TensorRTBatchRunner.prefill_chunk_at
        self.k_cache[:, slot, :, position:end] = out[io_names.K_NEW][:, 0, :, :n_valid]
        self.v_cache[:, slot, :, position:end] = out[io_names.V_NEW][:, 0, :, :n_valid]
        if self.hidden is not None:
            self.hidden[slot, position:end] = out[io_names.HIDDEN][0, :n_valid]
        self.calls["prefill"] += 1
        return out[io_names.LOGITS][0, n_valid - 1]

    def hidden_states(self, slot: int, start: int, stop: int) -> np.ndarray:
        if self.hidden is None:
            raise BackendError(f"{self.graph_dir}: the batched graph returns no hidden states (no head configured)")
        return self.hidden[slot, start:stop]
