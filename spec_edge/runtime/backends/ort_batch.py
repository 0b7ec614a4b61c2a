"""ONNX Runtime over the batched graphs (graphs/batch_export.py): B static slots, one resident cache.

State, allocated once:
  k_cache, v_cache   (L, B, Hkv, R, D) float32   slot b's region is [:, b]; R = S (+ C with fused attention)
  per width T: tokens (B, T) int64, position (B,) int64, logits (B, T, V), k_new / v_new (L, B, Hkv, T, D)
Every (B, T) call runs all B rows: a row whose slot is not active gets token 0 at that slot's own
position, where its keys/values land in rows no call reads before writing them again (rollback is
moving the position, as for B=1), so an idle or prefilling slot's cache is never disturbed. Prefill
is the B=1 prefill graph, bound once per slot to that slot's region ((1, Hkv, R, D) fused,
(Hkv, S, D) otherwise): a joining request's chunk runs alone between the others' decode calls.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.graphs.export import read_model_config
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.onnxruntime import _init_thread_pool, cpu_session


@dataclass
class _Call:
    session: object
    binding: object
    tokens: np.ndarray        # (B, T) int64, or (1, C) for the prefill graph
    position: np.ndarray      # (B,) int64, or (1,)
    logits: np.ndarray        # (B, T, V), or (1, V)
    k_new: np.ndarray | None  # (L, B, Hkv, T, D) (prefill: (L, Hkv, C, D)); None with fused attention
    v_new: np.ndarray | None
    last_index: np.ndarray | None = None  # (1,) prefill only

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


class BatchRunner:
    """The target's batched graphs around one (L, B, Hkv, R, D) cache; forward() runs all slots at once."""

    def __init__(self, graph_dir: str | Path, threads: int = 0):
        import onnxruntime as ort

        self.graph_dir = Path(graph_dir)
        path = self.graph_dir / "manifest.json"
        if not path.is_file():
            raise BackendError(f"{self.graph_dir} holds no batched export (manifest.json missing): set "
                               f"graphs.batch_slots and run `spec-edge export`")
        self.manifest = json.loads(path.read_text())
        if int(self.manifest.get("batch_slots", 1)) < 2:
            raise BackendError(f"{self.graph_dir} is not a batched export (no batch_slots >= 2 in its manifest)")
        self.model_cfg = cfg = read_model_config(self.graph_dir)
        self.batch = int(self.manifest["batch_slots"])
        self.max_context = int(self.manifest["max_context"])
        self.prefill_chunk = int(self.manifest["prefill_chunk"])
        self.vocab_size = cfg.vocab_size
        self.fused = self.manifest.get("attention") == "fused"
        self.cache_rows = int(self.manifest.get("cache_rows", self.max_context))
        self.threads = _init_thread_pool(threads)
        self._value = ort.OrtValue.ortvalue_from_numpy
        shape = (cfg.n_layers, self.batch, cfg.n_kv_heads, self.cache_rows, cfg.head_dim)  # (L, B, Hkv, R, D)
        self.k_cache = np.zeros(shape, np.float32)
        self.v_cache = np.zeros(shape, np.float32)
        self._calls: dict[int, _Call] = {}
        self._prefill: list[_Call] = []
        single: dict[tuple[str, int], list[_Call]] = {}  # (kind, width) -> the B=1 graph bound to each slot
        for stem, spec in self.manifest["graphs"].items():
            session = self._session(stem)
            if "batch" not in spec:
                calls = [self._bind_single(session, spec["kind"], spec["width"], slot) for slot in range(self.batch)]
                if spec["kind"] == "prefill":
                    self._prefill = calls
                else:
                    single[(spec["kind"], spec["width"])] = calls
            else:
                self._calls[spec["width"]] = self._bind_batch(session, spec["width"])
        self.widths = frozenset(self._calls)
        # int8 activations (q4): a step is the width-2 call [pending, pending] (as graphs/two_rows.py does for
        # B=1), so each slot's step row equals the B=1 step and the verify rows bit for bit
        self.step_width = 2 if int(self.manifest.get("accuracy_level", 0)) == 4 and 2 in self.widths else 1
        # one active slot runs the B=1 graph of the call's width (a verify, else the step: q4's B=1 step
        # graph computes two rows itself), bound to that slot: the single-request speed, the same rows
        self._single = {width: single.get(("verify", width)) or single.get(("step", 1)) for width in self.widths
                        if ("verify", width) in single or (width == self.step_width and ("step", 1) in single)}
        if self.fused and max(self.widths) > self.cache_rows - self.max_context:
            raise BackendError(f"{self.graph_dir}: a width-{max(self.widths)} call of an idle slot needs "
                               f"{max(self.widths)} spare cache rows, the fused graphs have "
                               f"{self.cache_rows - self.max_context}: set graphs.prefill_chunk >= {max(self.widths)}")

    def _session(self, stem: str):
        path = self.graph_dir / f"{stem}.onnx"
        if not path.is_file():
            raise BackendError(f"graph file {path} is missing: re-run `spec-edge export`")
        try:
            return cpu_session(str(path), self.threads)
        except Exception as err:  # onnxruntime raises several unrelated types for a bad file
            raise BackendError(f"ONNX Runtime cannot load {path}: {err}; re-run `spec-edge export`") from err

    def _bind_caches(self, call: _Call, slot: int | None) -> None:
        """Bind the per-layer cache inputs (and, fused, the in-place outputs): the whole layer
        (B, Hkv, R, D), each slot's own input (io_names.slot_name, fused graphs of width > 1), or,
        for the prefill graph, one slot's region."""
        inputs = {value.name for value in call.session.get_inputs()}
        per_slot = slot is None and io_names.slot_name(io_names.k_cache(0), 0) in inputs
        for layer in range(self.model_cfg.n_layers):
            if per_slot:
                views = [(self.k_cache[layer, b:b + 1], self.v_cache[layer, b:b + 1], b) for b in range(self.batch)]
            elif slot is None:
                views = [(self.k_cache[layer], self.v_cache[layer], None)]  # (B, Hkv, R, D)
            elif self.fused:
                views = [(self.k_cache[layer, slot:slot + 1], self.v_cache[layer, slot:slot + 1], None)]  # (1, Hkv, R, D)
            else:
                views = [(self.k_cache[layer, slot], self.v_cache[layer, slot], None)]  # (Hkv, S, D)
            for k, v, b in views:
                def name(base: str) -> str:
                    return base if b is None else io_names.slot_name(base, b)
                k, v = self._value(k), self._value(v)
                call.binding.bind_ortvalue_input(name(io_names.k_cache(layer)), k)
                call.binding.bind_ortvalue_input(name(io_names.v_cache(layer)), v)
                if self.fused:
                    call.binding.bind_ortvalue_output(name(io_names.k_present(layer)), k)
                    call.binding.bind_ortvalue_output(name(io_names.v_present(layer)), v)

    def _bind_batch(self, session, width: int) -> _Call:
        cfg, batch = self.model_cfg, self.batch
        new = (cfg.n_layers, batch, cfg.n_kv_heads, width, cfg.head_dim)
        call = _Call(session, session.io_binding(), np.zeros((batch, width), np.int64), np.zeros((batch,), np.int64),
                     np.zeros((batch, width, cfg.vocab_size), np.float32),
                     None if self.fused else np.zeros(new, np.float32), None if self.fused else np.zeros(new, np.float32))
        self._bind_io(call, slot=None)
        return call

    def _bind_single(self, session, kind: str, width: int, slot: int) -> _Call:
        """A B=1 graph (prefill, step, verify) bound to slot's region of the cache."""
        cfg, prefill = self.model_cfg, kind == "prefill"
        new = (cfg.n_layers, cfg.n_kv_heads, width, cfg.head_dim)
        call = _Call(session, session.io_binding(), np.zeros((1, width), np.int64), np.zeros((1,), np.int64),
                     np.zeros((1 if prefill else width, cfg.vocab_size), np.float32),
                     None if self.fused else np.zeros(new, np.float32), None if self.fused else np.zeros(new, np.float32),
                     last_index=np.zeros((1,), np.int64) if prefill else None)
        self._bind_io(call, slot=slot)
        if prefill:
            call.binding.bind_ortvalue_input(io_names.LAST_INDEX, self._value(call.last_index))
        return call

    def _bind_io(self, call: _Call, slot: int | None) -> None:
        bind = call.binding
        bind.bind_ortvalue_input(io_names.TOKENS, self._value(call.tokens))
        bind.bind_ortvalue_input(io_names.POSITION, self._value(call.position))
        self._bind_caches(call, slot)
        bind.bind_ortvalue_output(io_names.LOGITS, self._value(call.logits))
        if not self.fused:
            bind.bind_ortvalue_output(io_names.K_NEW, self._value(call.k_new))
            bind.bind_ortvalue_output(io_names.V_NEW, self._value(call.v_new))

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no batched graph of width {width} (k={width - 1}); exported for k in {ks}: "
                               f"re-export with graphs.k_values including {width - 1}")

    def forward(self, tokens: np.ndarray, positions: Sequence[int], active: Sequence[bool]) -> np.ndarray:
        """One (B, T) call. tokens (B, T) int64 (inactive rows: anything), positions (B,) each slot's
        position (inactive slots: where their next real row goes), active (B,) bool. Writes the T rows
        of every active slot at [position, position + T); returns logits (B, T, V) (a view, valid until
        the next call of this width; inactive rows are garbage)."""
        tokens = np.asarray(tokens, np.int64)
        batch, width = tokens.shape
        if batch != self.batch:
            raise BackendError(f"a batched call takes {self.batch} rows, got {batch}")
        self.check_width(width)
        call = self._calls[width]
        rows = [slot for slot in range(batch) if active[slot]]
        if len(rows) == 1 and width in self._single:
            return self._forward_one(rows[0], tokens, int(positions[rows[0]]), call)
        for slot in range(batch):
            pos = int(positions[slot])
            if active[slot]:
                if pos < 0 or pos + width > self.max_context:
                    raise BackendError(f"slot {slot}: positions [{pos}, {pos + width}) do not fit the "
                                       f"{self.max_context}-token cache")
                call.tokens[slot] = tokens[slot]
            else:
                pos = min(max(pos, 0), self.max_context)  # fused: lands in rows nobody reads yet
                call.tokens[slot] = 0
            call.position[slot] = pos
        call.run()
        if not self.fused:
            for slot in range(batch):
                if active[slot]:
                    pos = int(call.position[slot])
                    self.k_cache[:, slot, :, pos:pos + width] = call.k_new[:, slot]
                    self.v_cache[:, slot, :, pos:pos + width] = call.v_new[:, slot]
        return call.logits

    def _forward_one(self, slot: int, tokens: np.ndarray, pos: int, batched: _Call) -> np.ndarray:
        """forward() with one active slot: its B=1 graph; the logits land in row slot of the batched buffer."""
        width = tokens.shape[1]
        call = self._single[width][slot]
        n = call.tokens.shape[1]  # the B=1 step graph of q4 takes the pending token once
        if pos < 0 or pos + width > self.max_context:
            raise BackendError(f"slot {slot}: positions [{pos}, {pos + width}) do not fit the "
                               f"{self.max_context}-token cache")
        call.tokens[0] = tokens[slot, :n]
        call.position[0] = pos
        call.run()
        if not self.fused:
            self.k_cache[:, slot, :, pos:pos + n] = call.k_new
            self.v_cache[:, slot, :, pos:pos + n] = call.v_new
        batched.logits[slot, :n] = call.logits
        return batched.logits

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray:
        """All of token_ids into slot's region at [position, ...) in chunks of C; the last token's logits (V,)."""
        n_tokens = len(token_ids)
        if n_tokens == 0:
            raise BackendError("prefill needs at least one token")
        if position < 0 or position + n_tokens > self.max_context:
            raise BackendError(f"positions [{position}, {position + n_tokens}) do not fit the "
                               f"{self.max_context}-token cache")
        logits = None
        for start in range(0, n_tokens, self.prefill_chunk):
            logits = self.prefill_chunk_at(slot, token_ids[start:start + self.prefill_chunk], position + start)
        return logits

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int) -> np.ndarray:
        """One chunk (at most C tokens) into slot's region at position; its last token's logits (V,)."""
        call, n_valid = self._prefill[slot], len(part)
        if not 1 <= n_valid <= self.prefill_chunk:
            raise BackendError(f"a prefill chunk holds 1..{self.prefill_chunk} tokens, got {n_valid}")
        call.tokens[0, :n_valid] = part
        call.tokens[0, n_valid:] = part[-1]  # padding at the end: causal masking keeps it out of the real rows
        call.position[0] = position
        call.last_index[0] = n_valid - 1
        call.run()
        if not self.fused:
            self.k_cache[:, slot, :, position:position + n_valid] = call.k_new[:, :, :n_valid]
            self.v_cache[:, slot, :, position:position + n_valid] = call.v_new[:, :, :n_valid]
        return call.logits[0]
