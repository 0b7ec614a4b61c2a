"""The ONNX Runtime runner: a graph folder's graphs around one resident cache of B static slots, for every
slot count (B=1 is a batch of one), target and draft model alike.

State, allocated once (and written once, so no slot's pages are faulted in by its first request):
  k_cache, v_cache   (L, B [+ 1], Hkv, R, D) float32  slot b's region is [:, b]; [:, B] is the scratch region
                                                       of the padding rows of m-row calls, there only when the
                                                       runner has graphs of m > 1 rows (R = S + C for fused
                                                       attention: room for a padded prefill chunk; else S)
  hidden             (B, S, n * H) float32 or None    graphs exported with draft heads configured: the
                                                       hidden states of each slot's positions, written
                                                       like the cache (rows [pos, pos + T) per call)
  per (width T, row count m): tokens (m, T) int64, position (m,) int64, logits (m, T, V)
                                [, hidden out (m, T, n * H) / (T, n * H)] [, k_new / v_new (L, Hkv, T, D)]
  held               B tuples: the token ids whose rows each slot's region holds (prefix reuse, base.py)

A call names the slots it runs: forward(slots, tokens (n, T), positions) computes those n rows only,
each writing its T keys/values at [pos, pos + T) of its own slot's region; no other region is
touched, and idle or prefilling slots are never in a call:

  - one row: the folder's rows=1 graph of that width, bound to the slot's region. Fused attention
    (graphs.ort_attention: fused, graphs/ort_attention.py) writes the rows in place (its k_present
    outputs bound to the same (1, Hkv, R, D) view as its k_cache inputs); the exported attention
    (graphs.ort_attention: graph) reads the slot's (Hkv, S, D) layers and returns k_new / v_new, whose
    rows the runner copies into the region. int8 activations (q4, graphs/two_rows.py): the step is
    the width-2 call [pending, pending] on the step graph, which computes both rows itself and
    returns row 0 (a width-1 one-row call runs the same graph);
  - n >= 2 rows (the target with B > 1, fused attention only): the graph of the smallest row count
    m >= n (plan.row_counts(B)). Its rows have one GroupQueryAttention node each, with a cache input
    per row (gqa_rewrite.rewrite_rows), so row j is bound to slot slots[j]'s region; the m - n padding
    rows run token 0 at position 0 bound to the scratch region, garbage nobody reads; their rows
    equal the one-row calls' bit for bit;
  - the IO binding of a (width, m, slots) triple is made on its first call and kept (LRU,
    BINDINGS): a repeated subset rebinds nothing, a new one costs one binding (2 L m cache views).
Why calls name their slots rather than running all B rows: docs/bench.md, "Calls over a subset of the slots".

Prefill is the rows=1 prefill graph bound to one slot's region, in chunks of C (the last one padded
at its end: causal masking keeps the padding out of the real rows, and only the real rows reach the
cache): a joining request's chunk runs alone between the others' decode calls.

Sessions: one per graph, on the process's one thread pool, all loading the folder's weights once
(onnxruntime.graph_session). One slot of the runner alone: slot_views.SlotRunner (b1_runner).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spec_edge.graphs import io_names, plan
from spec_edge.runtime.backends.base import BackendError, prefill_in_chunks, resident_zeros
from spec_edge.runtime.backends.onnxruntime import _init_thread_pool, graph_session, packed_graphs
from spec_edge.runtime.backends.slot_views import SlotRunner

BINDINGS = 512  # IO bindings kept per runner (least recently used dropped): every subset of 8 slots x 2 widths


@dataclass
class _Graph:
    """One session with the buffers its calls share: tokens (m, T) / (1, C), position (m,) / (1,),
    logits (m, T, V) / (T, V) / (1, V), last_index (1,) for prefill. The graph writes its logits
    output into logits[:out_rows] (q4's step graph: row 0 of the two-row step only), its hidden
    states (graphs with draft heads) into hidden, (m, T, n * H) or (rows, n * H) as the graph declares;
    a graph with the exported attention its new keys/values into k_new / v_new (L, Hkv, T, D)."""
    session: object
    tokens: np.ndarray
    position: np.ndarray
    logits: np.ndarray
    last_index: np.ndarray | None = None
    out_rows: int | None = None
    hidden: np.ndarray | None = None
    k_new: np.ndarray | None = None
    v_new: np.ndarray | None = None
    image_rows: np.ndarray | None = None  # prefill_image: (C, hidden) the chunk's image rows
    image_mask: np.ndarray | None = None  # (C,) bool: the rows that take them


class OrtRunner:
    """A graph folder's graphs around one (L, B [+ 1], Hkv, R, D) cache (B = slots); forward() runs the
    named slots. The Slotted protocol (slot_views.py) the loop drives."""

    def __init__(self, graph_dir: str | Path, threads: int = 0, *, slots: int):
        import onnxruntime as ort

        self.graph_dir = Path(graph_dir)
        path = self.graph_dir / "manifest.json"
        if not path.is_file():
            raise BackendError(f"{self.graph_dir} holds no exported model (manifest.json missing): run `spec-edge export`")
        self.manifest = json.loads(path.read_text())
        if slots < 1:
            raise BackendError(f"slots={slots}: a runner runs at least one slot")
        self.model_cfg = cfg = plan.read_model_config(self.graph_dir)
        self.batch = slots
        self.max_context = int(self.manifest["max_context"])
        self.prefill_chunk = int(self.manifest["prefill_chunk"])
        self.vocab_size = cfg.vocab_size
        self.fused = self.manifest.get("attention") == "fused"
        self.cache_rows = int(self.manifest.get("cache_rows", self.max_context))  # fused: S + C
        self.threads = _init_thread_pool(threads)
        self._value = ort.OrtValue.ortvalue_from_numpy
        # the target's graphs of m > 1 rows for B slots; a draft model's folder has none: every call one row
        self.row_counts = plan.row_counts(slots) if self.manifest.get("role") == "target" else ()
        if self.row_counts and not self.fused:
            raise BackendError(f"{self.graph_dir}: {slots} batch slots run calls of several rows, which bind each "
                               f"row to its slot's cache region with fused attention only: set "
                               f"graphs.ort_attention: fused, or graphs.batch_slots: 1")
        self.scratch = self.batch if self.row_counts else None  # the padding rows' region
        regions = self.batch + (1 if self.row_counts else 0)
        shape = (cfg.n_layers, regions, cfg.n_kv_heads, self.cache_rows, cfg.head_dim)  # (L, B [+ 1], Hkv, R, D)
        self.k_cache = resident_zeros(shape)
        self.v_cache = resident_zeros(shape)
        self.held: list[tuple[int, ...]] = [()] * self.batch  # per slot, the prefix records (base.py)
        specs = packed_graphs(self.graph_dir)  # what the build made for this machine: the plan's, earlier plans'
        # int8 activations (q4): a step is the width-2 call [pending, pending] (graphs/two_rows.py), so each
        # slot's step row equals the verify rows bit for bit
        two_row = int(self.manifest.get("accuracy_level", 0)) == 4
        self.step_width = 2 if two_row else 1
        # the folder's form says which hidden states its graphs return (graphs/folders.py: one form per folder);
        # a graph of another form there (made by an older version) is not loaded, never a reason to fail
        form = list(self.manifest.get("hidden_layers", ()))
        specs = {stem: spec for stem, spec in specs.items() if spec.get("rows", 1) in (1, *self.row_counts)
                 and (spec["kind"] == "layerskip" or list(spec.get("hidden_layers", ())) == form)}
        verify_widths = {spec["width"] for spec in specs.values() if spec["kind"] == "verify" and spec.get("rows", 1) == 1}
        have = {(spec["width"], spec["rows"]) for spec in specs.values() if spec.get("rows", 1) > 1}
        # the widths the folder serves at every row count (a k exported for B=1 only is not one of them)
        self.widths = frozenset(w for w in {self.step_width} | {w for w in verify_widths if w > 1}
                                if w == self.step_width or all((w, m) in have for m in self.row_counts))
        specs = {stem: spec for stem, spec in specs.items() if spec["kind"] != "layerskip"}
        hidden_width = len(form) * cfg.hidden_size
        self.hidden = resident_zeros((self.batch, self.max_context, hidden_width)) if hidden_width else None
        self.n_layers = cfg.n_layers  # the layers of the cache this runner's graphs read and write
        self._batched: dict[tuple[int, int], _Graph] = {}   # (width, m) -> graph
        self._single: dict[int, _Graph] = {}                # width -> the rows=1 graph of a one-row call
        self._prefill: _Graph | None = None
        self._prefill_image: _Graph | None = None  # a vision model's prefill with image rows (graphs/vision.py)
        for stem, spec in specs.items():
            kind, width, rows = spec["kind"], int(spec["width"]), int(spec.get("rows", 1))
            if kind == "prefill":
                self._prefill = self._graph(stem, (1, width), (1, cfg.vocab_size), prefill=True)
            elif kind == "prefill_image":
                self._prefill_image = graph = self._graph(stem, (1, width), (1, cfg.vocab_size), prefill=True)
                graph.image_rows = np.zeros((width, cfg.hidden_size), np.float32)
                graph.image_mask = np.zeros((width,), np.bool_)
            elif rows > 1 and width in self.widths:
                self._batched[(width, rows)] = self._graph(stem, (rows, width), (rows, width, cfg.vocab_size))
            elif rows == 1 and kind == "step":  # logits room for the step width's rows (q4: row 0 written)
                self._single[1] = self._graph(stem, (1, 1), (self.step_width, cfg.vocab_size), out_rows=1)
            elif rows == 1 and kind == "verify" and width in self.widths:
                self._single[width] = self._graph(stem, (1, width), (width, cfg.vocab_size))
        # T of the one-row calls that compute all their rows: 1 and the verify widths (slot_views.SlotRunner)
        self.single_widths = frozenset(w for w, graph in self._single.items() if graph.tokens.shape[1] == w)
        if self.step_width not in self._single and 1 in self._single:
            self._single[self.step_width] = self._single[1]  # q4 without k = 1: the step graph's two rows
        missing = [(w, m) for w in self.widths for m in self.row_counts if (w, m) not in self._batched]
        missing += [(w, 1) for w in self.widths if w not in self._single]
        if self._prefill is None or missing:
            raise BackendError(f"{self.graph_dir}: graphs missing for (width, rows) {missing}"
                               f"{'' if self._prefill else ' and the prefill graph'}: run `spec-edge export` with "
                               f"graphs.batch_slots: {slots}")
        self._bindings: OrderedDict[tuple, object] = OrderedDict()
        self.calls: dict[tuple[int, int], int] = {}  # (width, graph rows) -> calls so far (tests, benchmarks)
        self._layer_skips: dict[int, OrtRunner] = {}

    def _graph(self, stem: str, tokens: tuple[int, ...], logits: tuple[int, ...], prefill: bool = False,
               out_rows: int | None = None) -> _Graph:
        path = self.graph_dir / f"{stem}.onnx"
        session = graph_session(self.graph_dir, stem, self.threads)  # the folder's weights, shared by its sessions
        hidden = None
        if self.hidden is not None:  # the graph's own declared (static) shape of its hidden output
            (declared,) = [out.shape for out in session.get_outputs() if out.name == io_names.HIDDEN] or [None]
            if declared is None:
                raise BackendError(f"{path} returns no hidden states while its manifest says it does: re-export")
            hidden = np.zeros(tuple(declared), np.float32)
        graph = _Graph(session, np.zeros(tokens, np.int64), np.zeros(tokens[:1], np.int64),
                       np.zeros(logits, np.float32), np.zeros((1,), np.int64) if prefill else None, out_rows, hidden)
        if not self.fused:  # (L, Hkv, T, D): the rows the runner copies into the slot's region
            cfg = self.model_cfg
            graph.k_new = np.zeros((self.n_layers, cfg.n_kv_heads, tokens[1], cfg.head_dim), np.float32)
            graph.v_new = np.zeros_like(graph.k_new)
        return graph

    # -- bindings --------------------------------------------------------------------------------

    def _binding(self, key: tuple, graph: _Graph, regions: Sequence[int], per_row: bool):
        """The IO binding of graph with row j's cache bound to region regions[j] (a slot or the
        scratch), made once per key and kept. per_row: the m-row graphs' <cache>_s<j> inputs; else
        the rows=1 graph's one input per layer: (1, Hkv, R, D) in place (fused), or (Hkv, S, D) read
        with its k_new / v_new outputs (the exported attention)."""
        binding = self._bindings.get(key)
        if binding is not None:
            self._bindings.move_to_end(key)
            return binding
        binding = graph.session.io_binding()
        binding.bind_ortvalue_input(io_names.TOKENS, self._value(graph.tokens))
        binding.bind_ortvalue_input(io_names.POSITION, self._value(graph.position))
        if graph.last_index is not None:
            binding.bind_ortvalue_input(io_names.LAST_INDEX, self._value(graph.last_index))
        if graph.image_rows is not None:
            binding.bind_ortvalue_input(io_names.IMAGE_ROWS, self._value(graph.image_rows))
            binding.bind_ortvalue_input(io_names.IMAGE_MASK, self._value(graph.image_mask))
        binding.bind_ortvalue_output(io_names.LOGITS, self._value(graph.logits[:graph.out_rows]))
        if graph.hidden is not None:
            binding.bind_ortvalue_output(io_names.HIDDEN, self._value(graph.hidden))
        if graph.k_new is not None:
            binding.bind_ortvalue_output(io_names.K_NEW, self._value(graph.k_new))
            binding.bind_ortvalue_output(io_names.V_NEW, self._value(graph.v_new))
        for layer in range(self.n_layers):
            for j, region in enumerate(regions):
                def name(base: str) -> str:
                    return io_names.slot_name(base, j) if per_row else base
                if graph.k_new is not None:  # (Hkv, S, D), read only
                    binding.bind_ortvalue_input(name(io_names.k_cache(layer)), self._value(self.k_cache[layer, region]))
                    binding.bind_ortvalue_input(name(io_names.v_cache(layer)), self._value(self.v_cache[layer, region]))
                    continue
                k = self._value(self.k_cache[layer, region:region + 1])  # (1, Hkv, R, D)
                v = self._value(self.v_cache[layer, region:region + 1])
                binding.bind_ortvalue_input(name(io_names.k_cache(layer)), k)
                binding.bind_ortvalue_input(name(io_names.v_cache(layer)), v)
                binding.bind_ortvalue_output(name(io_names.k_present(layer)), k)  # in place
                binding.bind_ortvalue_output(name(io_names.v_present(layer)), v)
        self._bindings[key] = binding
        if len(self._bindings) > BINDINGS:
            self._bindings.popitem(last=False)
        return binding

    def _run_one(self, graph: _Graph, binding, slot: int, position: int, n_valid: int) -> None:
        """Run a rows=1 graph bound to slot's region; its first n_valid rows' keys/values (the exported
        attention's k_new / v_new) and hidden states go to rows [position, position + n_valid) of the slot's."""
        graph.session.run_with_iobinding(binding)
        if graph.k_new is not None:
            self.k_cache[:, slot, :, position:position + n_valid] = graph.k_new[:, :, :n_valid]
            self.v_cache[:, slot, :, position:position + n_valid] = graph.v_new[:, :, :n_valid]
        if graph.hidden is not None:
            self.hidden[slot, position:position + n_valid] = graph.hidden[:n_valid]

    # -- calls -----------------------------------------------------------------------------------

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no graph of width {width} (k={width - 1}); exported for k in {ks}: "
                               f"re-export with graphs.k_values including {width - 1}")

    def rows_for(self, n: int) -> int:
        """The row count of the graph an n-row call runs (1: the rows=1 graphs)."""
        if n > 1 and not self.row_counts:
            raise BackendError(f"{self.graph_dir} runs one slot per call here (graphs of several rows: the "
                               f"target's, with graphs.batch_slots > 1)")
        return 1 if n == 1 else min(m for m in self.row_counts if m >= n)

    def forward(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        """Run the n slots `slots` only: tokens (n, T) int64 (row j: slot slots[j]'s T tokens),
        positions (n,) each row's first position. Writes row j's T keys/values at [positions[j],
        positions[j] + T) of slot slots[j]'s region; no other slot's region is touched. Returns logits
        (n, T, V) (a view, valid until the next call of this width and row count). A two-row step
        (step_width 2: [pending, pending]) is read at row 0 only."""
        tokens = np.asarray(tokens, np.int64)
        n, width = tokens.shape
        slots = tuple(int(slot) for slot in slots)
        if not (n == 1 and width in self.single_widths):
            self.check_width(width)
        if len(slots) != n or len(positions) != n or n == 0:
            raise BackendError(f"a call takes one row of tokens and one position per slot, got {len(slots)} slots, "
                               f"{n} token rows, {len(positions)} positions")
        if len(set(slots)) != n or not all(0 <= slot < self.batch for slot in slots):
            raise BackendError(f"slots must be distinct, in [0, {self.batch}), got {list(slots)}")
        for slot, pos in zip(slots, positions):
            if pos < 0 or pos + width > self.max_context:
                raise BackendError(f"slot {slot}: positions [{pos}, {pos + width}) do not fit the "
                                   f"{self.max_context}-token cache")
        m = self.rows_for(n)
        self.calls[(width, m)] = self.calls.get((width, m), 0) + 1
        if m == 1:
            graph = self._single[width]
            binding = self._binding(("single", width, slots), graph, slots, per_row=False)
            t = graph.tokens.shape[1]
            graph.tokens[0] = tokens[0, :t]  # q4's step graph takes the pending token once
            graph.position[0] = positions[0]
            self._run_one(graph, binding, slots[0], int(positions[0]), min(width, t))
            return graph.logits[None, :width]
        graph = self._batched[(width, m)]
        binding = self._binding((width, m, slots), graph, slots + (self.scratch,) * (m - n), per_row=True)
        graph.tokens[:n] = tokens
        graph.tokens[n:] = 0
        graph.position[:n] = positions
        graph.position[n:] = 0  # padding rows: [0, T) of the scratch region
        graph.session.run_with_iobinding(binding)
        if graph.hidden is not None:  # (m, T, n * H): row j's T states at [pos, pos + T) of its slot's
            for j, (slot, pos) in enumerate(zip(slots, positions)):
                self.hidden[slot, pos:pos + width] = graph.hidden[j]
        return graph.logits[:n]

    def hidden_states(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Slot's target hidden states (stop - start, n * H) at positions [start, stop) as the latest calls
        wrote them (a view, valid until a call rewrites them): slot_views.SlotRunner.hidden_states."""
        if self.hidden is None:
            raise BackendError(f"{self.graph_dir} was exported without hidden-state outputs: set speculative."
                               f"eagle3_head (or medusa_head / peagle_head) for the drafters that read the target's "
                               f"hidden states")
        return self.hidden[slot, start:stop]

    def argmax(self, slots: Sequence[int], tokens: np.ndarray, positions: Sequence[int]) -> np.ndarray:
        """Greedy token after each position, (n, T) int64. A device runner overrides this so only
        the n x T ids cross to the host."""
        return np.argmax(self.forward(slots, tokens, positions), axis=-1)

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray:
        """All of token_ids into slot's region at [position, ...) in chunks of C; the last token's logits (V,)."""
        return prefill_in_chunks(lambda part, at: self.prefill_chunk_at(slot, part, at), self.prefill_chunk,
                                 self.max_context, token_ids, position)

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int, image_rows: np.ndarray | None = None,
                         image_mask: np.ndarray | None = None) -> np.ndarray:
        """One chunk (at most C tokens) into slot's region at position; its last token's logits (V,). image_rows
        (n, hidden) and image_mask (n,) bool: the rows of the chunk's image tokens (a vision model), which replace
        those tokens' embeddings."""
        images = image_mask is not None and bool(image_mask.any())
        graph, n_valid = self._prefill_image if images else self._prefill, len(part)
        if images and graph is None:
            raise BackendError(f"{self.graph_dir} has no prefill_image graph: a vision model's prompt with images "
                               f"needs one (re-run `spec-edge export` with the vision model as model.target)")
        if graph is None:
            raise BackendError("this runner has no prefill graph (a layer-skip runner: the target's prefill writes its layers)")
        if not 1 <= n_valid <= self.prefill_chunk:
            raise BackendError(f"a prefill chunk holds 1..{self.prefill_chunk} tokens, got {n_valid}")
        if not 0 <= slot < self.batch:
            raise BackendError(f"slot must be in [0, {self.batch}), got {slot}")
        if position < 0 or position + n_valid > self.max_context:
            raise BackendError(f"positions [{position}, {position + n_valid}) do not fit the "
                               f"{self.max_context}-token cache")
        binding = self._binding(("prefill_image" if images else "prefill", slot), graph, (slot,), per_row=False)
        if images:
            graph.image_rows[:n_valid], graph.image_mask[:n_valid], graph.image_mask[n_valid:] = image_rows, image_mask, False
        graph.tokens[0, :n_valid] = part
        graph.tokens[0, n_valid:] = part[-1]  # padding at the end: causal masking keeps it out of the real rows
        graph.position[0] = position
        graph.last_index[0] = n_valid - 1
        self._run_one(graph, binding, slot, position, n_valid)
        return graph.logits[0]

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None:
        """Slot target's cache rows [0, n_rows) := slot source's (the same bytes a prefill of the same
        tokens there writes: warming every slot with one prefill)."""
        self.k_cache[:, target, :, :n_rows] = self.k_cache[:, source, :, :n_rows]
        self.v_cache[:, target, :, :n_rows] = self.v_cache[:, source, :, :n_rows]
        if self.hidden is not None:  # the heads read these rows as the prefill wrote them
            self.hidden[target, :n_rows] = self.hidden[source, :n_rows]

    def layer_skip(self, n_layers: int) -> "OrtRunner":
        """The first n_layers + final norm + head over the same slot regions (views of this cache's first
        n_layers, no copy): the layer-skip self-drafter of each slot. One-row calls of width 1 on the
        folder's rows=1 layer-skip graph (its prefill is the target's); made once per n_layers and
        shared by the slots."""
        import copy

        if not 1 <= n_layers < self.model_cfg.n_layers:
            raise BackendError(f"layer-skip needs 1 <= n_layers < {self.model_cfg.n_layers}, got {n_layers}")
        if n_layers in self._layer_skips:
            return self._layer_skips[n_layers]
        stems = [stem for stem, spec in self.manifest["graphs"].items()
                 if spec["kind"] == "layerskip" and spec.get("n_layers") == n_layers and spec.get("rows", 1) == 1]
        if not stems:
            have = sorted({spec.get("n_layers") for spec in self.manifest["graphs"].values()} - {None})
            raise BackendError(f"{self.graph_dir} has no layer-skip graph with {n_layers} layers (have {have}): set "
                               f"graphs.layer_skip_layers={n_layers} and re-export")
        view = copy.copy(self)
        view.n_layers, view.k_cache, view.v_cache = n_layers, self.k_cache[:n_layers], self.v_cache[:n_layers]
        view.hidden, view.row_counts, view.step_width = None, (), 1
        view.widths = view.single_widths = frozenset({1})
        view._prefill, view._batched, view._bindings, view.calls, view._layer_skips = None, {}, OrderedDict(), {}, {}
        view._single = {1: view._graph(stems[0], (1, 1), (1, self.vocab_size), out_rows=1)}
        self._layer_skips[n_layers] = view
        return view


def b1_runner(graph_dir: str | Path, threads: int = 0) -> SlotRunner:
    """A SlotRunner over graph_dir: slot 0 of a one-slot OrtRunner (a draft model's or a target's, for
    tools and tests; the runner itself is .runner)."""
    return SlotRunner(OrtRunner(graph_dir, threads, slots=1), 0)
