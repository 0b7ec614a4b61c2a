"""ONNX Runtime runners of the draft heads' static graphs: EAGLE-3 (spec_edge/heads/eagle3.py), its
parallel-drafting variant (spec_edge/heads/peagle.py) and Medusa heads (spec_edge/heads/medusa.py).

EAGLE-3 / P-EAGLE:

State, allocated once:
  k_cache, v_cache  (slots, Hkv, S, D) float32   the head's own resident cache, one region per slot
                                             (slots = 1 but for the batched node's per-slot heads;
                                             (., Hkv, S + W, D) with fused attention: the graphs
                                             write it in place); per slot one IO binding per graph
  embed_table       (V, H) float32           the target's token embedding: a read-only memory map of
                                             the target's weights.bin (no copy), bound as an input
  per graph: tokens (1, W), hidden (W, 3Ht) or (1, H), position, last_index, logits (1, Vd),
             k_new / v_new (1, Hkv, W, D), hidden_out (1, H)
  P-EAGLE draft graphs: tokens (1, 1), hidden (1, 3Ht), position, logits (k, Vd), k_new / v_new (1, Hkv, k, D)
Medusa: hidden (1, H) in, logits (n_heads, Vd) out; no cache.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.graphs import io_names
from spec_edge.heads.eagle3_layouts import read_head_config
from spec_edge.runtime.backends.base import BackendError, resident_zeros
from spec_edge.runtime.backends.onnxruntime import graph_session


@dataclass
class _HeadGraph:
    session: object
    bindings: list          # [slot]: the IO binding with that slot's cache region bound
    tokens: np.ndarray      # (1, W) int64
    hidden: np.ndarray      # (W, 3Ht) ingest / (1, H) step
    position: np.ndarray    # (1,) int64
    last_index: np.ndarray  # (1,) int64
    logits: np.ndarray      # (1, Vd)
    k_new: np.ndarray | None  # (1, Hkv, W, D); None for fused attention (the graph writes the cache)
    v_new: np.ndarray | None
    hidden_out: np.ndarray  # (1, H)


def target_embedding(target_graph_dir: Path, name: str = "model.embed_tokens.weight") -> np.ndarray:
    """The target's (V, H) embedding as a read-only memory map of its weights.bin (found through
    the external-data record of the step graph, step_1.onnx), so the head shares the target's pages."""
    import onnx

    step = Path(target_graph_dir) / "step_1.onnx"
    graph = onnx.load(str(step), load_external_data=False)
    for tensor in graph.graph.initializer:
        if tensor.name == name or tensor.name.endswith("embed_tokens.weight"):
            if tensor.data_location != onnx.TensorProto.EXTERNAL or tensor.data_type != onnx.TensorProto.FLOAT:
                break
            info = {entry.key: entry.value for entry in tensor.external_data}
            shape = tuple(tensor.dims)
            return np.memmap(Path(target_graph_dir) / info["location"], dtype=np.float32, mode="r",
                             offset=int(info["offset"]), shape=shape)
    raise BackendError(f"{step}: no float32 external embedding table found "
                       f"(the EAGLE-3 head reads the target's embedding from weights.bin)")


class OrtEagle3Head:
    """slots > 1: one cache region per batch slot (the batched node's per-slot drafters, each seeing its
    slot through backends/slot_views.SlotHead); the sessions and buffers are shared, every call names its
    slot (default 0)."""
    held: tuple[int, ...] = ()  # ids whose pairs rows 0..len-2 hold validly (drafters/head.py: CachedHeadDrafter)

    def __init__(self, head_dir: str | Path, embed_table: np.ndarray, threads: int = 0, slots: int = 1):
        import onnxruntime as ort

        self.head_dir = Path(head_dir)
        self.manifest = json.loads((self.head_dir / "manifest.json").read_text())
        self.cfg = read_head_config(self.head_dir)
        self.draft_ids = np.load(self.head_dir / "draft_ids.npy")  # (Vd,) draft id -> target id
        own = self.head_dir / "embed_tokens.npy"
        self.embed_table = np.load(own, mmap_mode="r") if own.is_file() else embed_table
        if self.embed_table.shape != (self.cfg.target_vocab_size, self.cfg.hidden_size):
            raise BackendError(f"embedding table {self.embed_table.shape} does not fit the head "
                               f"({self.cfg.target_vocab_size}, {self.cfg.hidden_size})")
        self.max_context = int(self.manifest["max_context"])
        self.threads = threads
        self._ort = ort
        c = self.cfg
        # fused attention (spec_edge/graphs/ort_attention.py): the graphs write their rows into the cache
        # themselves (k_present bound to the k_cache memory); spare rows take an ingest's padding
        self.fused = self.manifest.get("attention") == "fused"
        self.slots = slots
        shape = (slots, c.n_kv_heads, int(self.manifest.get("cache_rows", self.max_context)), c.head_dim)
        self.k_cache = resident_zeros(shape)  # (slots, Hkv, S [+ W], D); every page written now
        self.v_cache = resident_zeros(shape)
        # per slot one (1, Hkv, ., D) view of each, shared by all graphs
        self._k_values = [ort.OrtValue.ortvalue_from_numpy(self.k_cache[b:b + 1]) for b in range(slots)]
        self._v_values = [ort.OrtValue.ortvalue_from_numpy(self.v_cache[b:b + 1]) for b in range(slots)]
        self._ingest: dict[int, _HeadGraph] = {}
        self._draft: dict[int, _HeadGraph] = {}  # P-EAGLE draft passes by k
        self._step: _HeadGraph | None = None
        for stem, spec in self.manifest["graphs"].items():
            graph = self._load(stem, spec)
            if spec["kind"] == "ingest":
                self._ingest[spec["width"]] = graph
            elif spec["kind"] == "draft":
                self._draft[spec["width"]] = graph
            else:
                self._step = graph
        self.ingest_widths = sorted(self._ingest)
        self.draft_widths = sorted(self._draft)

    def _load(self, stem: str, spec: dict) -> _HeadGraph:
        ort = self._ort
        session = graph_session(self.head_dir, stem, self.threads)
        c, width, kind = self.cfg, spec["width"], spec["kind"]
        hidden_in = c.hidden_size if kind == "step" else 3 * c.target_hidden_size
        new_shape = (1, c.n_kv_heads, width, c.head_dim)
        draft = kind == "draft"  # P-EAGLE: one real row in, width rows of logits out
        graph = _HeadGraph(session=session, bindings=[session.io_binding() for _ in range(self.slots)],
                           tokens=np.zeros((1, 1 if draft else width), np.int64),
                           hidden=np.zeros((1 if draft else width, hidden_in), np.float32),
                           position=np.zeros((1,), np.int64), last_index=np.zeros((1,), np.int64),
                           logits=np.zeros((width if draft else 1, c.draft_vocab_size), np.float32),
                           k_new=None if self.fused else np.zeros(new_shape, np.float32),
                           v_new=None if self.fused else np.zeros(new_shape, np.float32),
                           hidden_out=np.zeros((1, c.hidden_size), np.float32))
        value = ort.OrtValue.ortvalue_from_numpy
        inputs = [(io_names.TOKENS, graph.tokens), (io_names.HIDDEN, graph.hidden),
                  (io_names.POSITION, graph.position)]
        outputs = [(io_names.LOGITS, graph.logits)]
        if not self.fused:
            outputs += [(io_names.K_NEW, graph.k_new), (io_names.V_NEW, graph.v_new)]
        if not draft:
            inputs.append((io_names.LAST_INDEX, graph.last_index))
            outputs.append((io_names.HIDDEN_OUT, graph.hidden_out))
        table = self.embed_table
        if not (isinstance(table, np.ndarray) and table.flags.c_contiguous and table.dtype == np.float32):
            table = np.ascontiguousarray(table, dtype=np.float32)
        for bind, k_value, v_value in zip(graph.bindings, self._k_values, self._v_values):
            bind.bind_ortvalue_input(io_names.K_CACHE, k_value)
            bind.bind_ortvalue_input(io_names.V_CACHE, v_value)
            if self.fused:  # same memory in and out: the node writes its rows in place
                bind.bind_ortvalue_output(io_names.K_PRESENT, k_value)
                bind.bind_ortvalue_output(io_names.V_PRESENT, v_value)
            for name, array in inputs:
                bind.bind_ortvalue_input(name, value(array))
            bind.bind_cpu_input(io_names.EMBED_TABLE, table)  # by pointer: a memory map stays a memory map
            for name, array in outputs:
                bind.bind_ortvalue_output(name, value(array))
        return graph

    def _binding(self, graph: _HeadGraph, slot: int):
        if not 0 <= slot < self.slots:
            raise BackendError(f"head slot must be in [0, {self.slots}), got {slot}")
        return graph.bindings[slot]

    def _run(self, graph: _HeadGraph, position: int, n_valid: int, slot: int) -> tuple[np.ndarray, np.ndarray]:
        if position < 0 or position + n_valid > self.max_context:
            raise BackendError(f"head positions [{position}, {position + n_valid}) do not fit its "
                               f"{self.max_context}-row cache")
        binding = self._binding(graph, slot)
        graph.position[0] = position
        graph.last_index[0] = n_valid - 1
        graph.session.run_with_iobinding(binding)
        if not self.fused:
            self.k_cache[slot:slot + 1, :, position:position + n_valid] = graph.k_new[:, :, :n_valid]
            self.v_cache[slot:slot + 1, :, position:position + n_valid] = graph.v_new[:, :, :n_valid]
        return graph.logits[0], graph.hidden_out

    def ingest(self, tokens: Sequence[int], hidden: np.ndarray, position: int,
               slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Feed pairs (target hidden at position + i, tokens[i]) for i < n into slot's cache; returns the
        draft logits (Vd,) and the head's hidden (1, H) after the last pair. Chunks by the widest graph."""
        n = len(tokens)
        if n == 0:
            raise BackendError("ingest needs at least one pair")
        start, result = 0, None
        widest = self.ingest_widths[-1]
        while start < n:
            left = n - start
            width = next((w for w in self.ingest_widths if w >= left), widest)
            take = min(left, width)
            graph = self._ingest[width]
            graph.tokens[0, :take] = tokens[start:start + take]
            graph.tokens[0, take:] = 0
            graph.hidden[:take] = hidden[start:start + take]
            graph.hidden[take:] = 0.0
            result = self._run(graph, position + start, take, slot)
            start += take
        return result

    def step(self, token: int, hidden: np.ndarray, position: int, slot: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """One draft step from the head's own hidden (1, H) and the last drafted token."""
        graph = self._step
        graph.tokens[0, 0] = token
        graph.hidden[:] = hidden
        return self._run(graph, position, 1, slot)

    def greedy_chain(self, tokens: Sequence[int], hidden: np.ndarray, position: int, k: int,
                     slot: int = 0) -> np.ndarray:
        """Greedy drafts 1..k as target ids (k,) int64: ingest the pairs, then k - 1 steps each fed
        the previous draft."""
        logits, own = self.ingest(tokens, hidden, position, slot)
        ids = [int(self.draft_ids[int(np.argmax(logits))])]
        for i in range(k - 1):
            logits, own = self.step(ids[-1], own, position + len(tokens) + i, slot)
            ids.append(int(self.draft_ids[int(np.argmax(logits))]))
        return np.asarray(ids, np.int64)

    def draft(self, token: int, hidden: np.ndarray, position: int, k: int, slot: int = 0) -> np.ndarray:
        """P-EAGLE: the pair (target hidden (1, 3Ht) at position, token) and k-1 mask rows in one
        pass; the pair's K/V is written at position of slot's region. Returns the logits (k, Vd) of
        drafts 1..k."""
        graph = self._draft.get(k)
        if graph is None:
            raise BackendError(f"no P-EAGLE draft graph for k={k} (built for k in {self.draft_widths})")
        if position < 0 or position + k > self.max_context:
            raise BackendError(f"head positions [{position}, {position + k}) do not fit its "
                               f"{self.max_context}-row cache")
        binding = self._binding(graph, slot)
        graph.tokens[0, 0] = token
        graph.hidden[:] = hidden
        graph.position[0] = position
        graph.session.run_with_iobinding(binding)
        self.k_cache[slot:slot + 1, :, position] = graph.k_new[:, :, 0]
        self.v_cache[slot:slot + 1, :, position] = graph.v_new[:, :, 0]
        return graph.logits


class OrtMedusaHeads:
    """Medusa heads on ONNX Runtime: run(hidden (1, H)) -> logits (n_heads, Vd). No cache."""

    def __init__(self, head_dir: str | Path, threads: int = 0):
        from spec_edge.heads.medusa import read_config

        self.head_dir = Path(head_dir)
        self.manifest = json.loads((self.head_dir / "manifest.json").read_text())
        self.cfg = read_config(self.head_dir)
        self.n_heads = self.cfg.n_heads
        self.draft_ids = np.load(self.head_dir / "draft_ids.npy")  # (Vd,) draft id -> target id
        (stem,) = self.manifest["graphs"]
        self.session = graph_session(self.head_dir, stem, threads)
        import onnxruntime as ort

        self.hidden = np.zeros((1, self.cfg.hidden_size), np.float32)                    # (1, H)
        self.logits = np.zeros((self.n_heads, self.cfg.draft_vocab_size), np.float32)    # (n, Vd)
        self.binding = self.session.io_binding()
        self.binding.bind_ortvalue_input(io_names.HIDDEN, ort.OrtValue.ortvalue_from_numpy(self.hidden))
        self.binding.bind_ortvalue_output(io_names.LOGITS, ort.OrtValue.ortvalue_from_numpy(self.logits))

    def run(self, hidden: np.ndarray) -> np.ndarray:
        """Logits (n_heads, Vd) of all heads for the target's final-norm hidden state (1, H)."""
        self.hidden[:] = hidden
        self.session.run_with_iobinding(self.binding)
        return self.logits
