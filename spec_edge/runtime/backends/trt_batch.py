"""TensorRT on the device for graphs.batch_slots = B > 1: the batched target engine (`spec-edge build` from
graphs/batch_dynamic.py's (n, T) graph) around one resident cache, with the CPU BatchRunner's contract:
batch, max_context, prefill_chunk, widths, step_width, check_width, held (one tuple per slot),
forward(slots, tokens (m, T), positions (m,)) -> logits (m, T, V), argmax(...) -> (m, T),
prefill(slot, ids, position), prefill_chunk_at(slot, part, position) -> the last token's logits (V,).

State, allocated once (torch CUDA tensors, bound to TensorRT by name and address):
  k_store, v_store  (L, B Hkv S + spare, D) graphs.dtype; k_cache / v_cache: its (L, B, Hkv, S, D) view.
                    Layer i's slots [b0, b0 + n) are one contiguous (n, Hkv, S, D) block, bound as
                    k_cache_<i> / v_cache_<i>; the spare rows after each layer's regions (Hkv x widest T,
                    padded to 256 bytes) take the writes of idle rows and are never read
  hidden_store      (B S + widest T, nH) when the engine returns hidden states; hidden: its (B, S, nH) view
  embed_table       (V, H) when the engine takes it (trt_memory.load_embed_table)
  outputs           one flat device buffer each for logits (n, T, V) float32, k_new / v_new (L, n, Hkv, T, D)
                    and hidden (n, T, nH), sized for the largest call (B rows of the widest decode width, or
                    the chunk C): every context binds offset 0 (calls are serialised on one stream)
  per width         an execution context (its profile selected once), a staged int64 block (device +
                    pinned host): tokens (nmax, T), position, dest, step, hdest (nmax,) each; ids (nmax T,)
  scratch           trt_memory.Scratch: the USER_MANAGED context memory every context shares

A decode call (width 1 or k+1; batch_rows.py): rows [0, n) = slots [0, n), n from RowCount; one pinned
host -> device copy of the staged block; execute_async_v3; the new keys/values go into the store with
one index_copy_ per K and V at dest[r] + step[r] * h + t (a called slot: (slot Hkv + h) S + position + t;
an idle row: the spare rows), hidden rows likewise; argmax on the device. Only the called slots' ids
(argmax) or logits (forward) cross to the host. While a width's n stays, its call is one captured CUDA
graph (execute + cache write + argmax); a new n is a new input shape, so that call runs eagerly (the
plain execution TensorRT wants after a shape change) and is captured for the next ones.
A prefill chunk runs the width-C context with n = 1, its cache inputs bound to the joining slot's block
(set_tensor_address), eagerly like the B=1 runner's prefill; rows past the chunk's real tokens are not
written. Needs tensorrt and CUDA; importable without either (both are imported when a runner is made).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from spec_edge.config import Config
from spec_edge.device.builder import context_memory_size, gpu_identity, import_tensorrt
from spec_edge.device.engine_file import load_engine
from spec_edge.device.manifest import ManifestError, check_engines, profile_dir
from spec_edge.graphs import io_names
from spec_edge.runtime.backends import tensorrt
from spec_edge.runtime.backends.base import BackendError, prefill_in_chunks
from spec_edge.runtime.backends.batch_rows import RowCount, check_call, check_chunk, plan_call, store_targets
from spec_edge.runtime.backends.trt_memory import (Scratch, bind_buffers, capture_cuda_graph, load_embed_table,
                                                   torch_cuda, torch_dtype)

log = logging.getLogger(__name__)
ALIGN = 256  # bytes: every tensor address bound to TensorRT
TENSORRT_API = tensorrt.TENSORRT_API  # the same members as the B=1 runner (test/test_tensorrt_api.py)
TENSORRT_RECEIVERS = {"engine": "ICudaEngine", "self.engine": "ICudaEngine", "context": "IExecutionContext",
                      "call.context": "IExecutionContext", "self.runtime": "Runtime"}


def cache_store(torch, n_layers: int, batch: int, n_kv: int, max_context: int, head_dim: int, widest: int,
                dtype, device: str = "cuda"):
    """(store (L, B Hkv S + spare, D), cache (L, B, Hkv, S, D) view of it, spare_step): one K or V store; the
    spare rows after each layer's B regions (>= Hkv x widest, padded so every layer starts 256-byte aligned)
    take idle rows' writes (batch_rows.store_targets). Refuses a slot region that is not 256-byte aligned."""
    region, elem = n_kv * max_context, torch.empty((), dtype=dtype).element_size()
    if (region * head_dim * elem) % ALIGN:
        raise BackendError(f"a slot's cache block is {region * head_dim * elem} bytes, not a multiple of {ALIGN}: "
                           f"use a graphs.max_context that is a multiple of 256")
    row_bytes = head_dim * elem
    spare = n_kv * widest
    while (spare * row_bytes) % ALIGN:  # the next layer's regions start aligned too
        spare += 1
    store = torch.zeros((n_layers, batch * region + spare, head_dim), dtype=dtype, device=device)
    return store, store[:, :batch * region].view(n_layers, batch, n_kv, max_context, head_dim), widest


def store_index(dest, step, heads, arange, width: int):
    """(n Hkv T,) store rows dest[r] + step[r] h + t in k_new's (n, Hkv, T) order (torch tensors on one device,
    or numpy arrays: ort_batch_dynamic.py writes through the same arithmetic)."""
    n = dest.shape[0]
    return (dest.reshape(n, 1, 1) + step.reshape(n, 1, 1) * heads.reshape(1, -1, 1)
            + arange[:width].reshape(1, 1, width)).reshape(-1)


@dataclass
class _Call:
    """One width's execution context, its staged inputs and its current rows."""
    width: int
    context: Any
    nmax: int                  # the profile's most rows
    staged: Any                # (nmax (T + 4),) int64 device: tokens | position | dest | step | hdest
    host: Any                  # its pinned host copy
    copied: Any                # CUDA event: the last copy out of `host` is done
    ids: Any                   # (nmax T,) int64 device
    host_ids: Any              # (nmax T,) pinned
    rows: RowCount
    n: int = 0                 # rows of the current input shape
    base: int = -1             # first slot of the bound cache block
    views: Any = None          # views of the buffers at (n, width): see _shape
    graph: Any = None          # torch.cuda.CUDAGraph of execute + cache write + argmax at (n, base 0)
    eager: bool = False        # a capture failed: this width runs eagerly from now on


class TensorRTBatchRunner:
    step_width = 1

    def __init__(self, cfg: Config, *, manifest: dict | None = None, scratch: Scratch | None = None, stream=None,
                 cuda_graphs: bool = True, verify: str = "quick"):
        self.trt = trt = import_tensorrt()
        self.torch = torch = torch_cuda()
        self.cfg, self.directory = cfg, profile_dir(cfg)
        if manifest is None:
            manifest = check_engines(cfg, trt_version=trt.__version__, gpu=gpu_identity(), verify=verify)
        entries = [e for e in manifest["engines"].values() if e["role"] == "target"]
        if len(entries) != 1 or int(entries[0].get("batch", 1)) != cfg.graphs.batch_slots:
            raise ManifestError(f"{self.directory}: no target engine built for graphs.batch_slots="
                                f"{cfg.graphs.batch_slots}: rebuild with `spec-edge build`")
        self.manifest, entry = manifest, entries[0]
        self.batch = int(entry["batch"])
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        path = self.directory / entry["file"]
        self.engine = engine = load_engine(trt, self.runtime, path)  # streamed: no whole host copy
        if engine is None:
            raise ManifestError(f"TensorRT cannot deserialize {path}: rebuild with `spec-edge build`")
        self.stream = stream or torch.cuda.Stream()
        self.scratch = scratch or Scratch(torch, size=int(entry.get("context_memory", 0)))
        self.scratch.reserve(int(engine.device_memory_size_v2))
        self.scratch.on_realloc.append(self._drop_graphs)
        self.use_cuda_graphs = cuda_graphs
        self.names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.n_layers = sum(n.startswith(io_names.K_CACHE_PREFIX) for n in self.names)
        layer = tuple(engine.get_tensor_shape(io_names.k_cache(0)))  # (-1, Hkv, S, D): the rows n dynamic
        _, self.n_kv, self.max_context, head_dim = (int(d) for d in layer)
        self.cache_dtype = torch_dtype(trt, torch, engine.get_tensor_dtype(io_names.k_cache(0)))
        self.vocab_size = int(engine.get_tensor_shape(io_names.LOGITS)[-1])
        self.prefill_chunk = int(manifest["prefill_chunk"])
        widths = [int(w) for w in entry["widths"]]
        k_values = set(manifest.get("k_values", []))
        self.widths = frozenset(w for w in widths if w == 1 or w - 1 in k_values)
        rows = {int(w): tuple(r) for w, r in entry["rows"].items()}
        self.held: list[tuple[int, ...]] = [() for _ in range(self.batch)]
        most = max(rows[w][2] * w for w in widths)  # rows x T of the largest call
        cuda = {"device": "cuda"}
        with torch.cuda.stream(self.stream):
            geometry = (self.n_layers, self.batch, self.n_kv, self.max_context, head_dim, max(widths), self.cache_dtype)
            self.k_store, self.k_cache, self.spare_step = cache_store(torch, *geometry)  # k_cache (L, B, Hkv, S, D)
            self.v_store, self.v_cache, _ = cache_store(torch, *geometry)
            self.hidden = self.hidden_store = None
            n_hidden = int(engine.get_tensor_shape(io_names.HIDDEN)[-1]) if io_names.HIDDEN in self.names else 0
            if n_hidden:
                self.hidden_store = torch.zeros((self.batch * self.max_context + max(widths), n_hidden),
                                                dtype=torch_dtype(trt, torch, engine.get_tensor_dtype(io_names.HIDDEN)),
                                                **cuda)
                self.hidden = self.hidden_store[:self.batch * self.max_context].view(self.batch, self.max_context, -1)
            self.embed_table = (load_embed_table(Path(entry["onnx"]).parent) if io_names.EMBED_TABLE in self.names
                                else None)
            dtype = lambda n: torch_dtype(trt, torch, engine.get_tensor_dtype(n))  # noqa: E731
            self.out = {io_names.LOGITS: torch.zeros((most * self.vocab_size,), dtype=dtype(io_names.LOGITS), **cuda),
                        io_names.K_NEW: torch.zeros((self.n_layers * most * self.n_kv * head_dim,),
                                                    dtype=dtype(io_names.K_NEW), **cuda),
                        io_names.V_NEW: torch.zeros((self.n_layers * most * self.n_kv * head_dim,),
                                                    dtype=dtype(io_names.V_NEW), **cuda)}
            if n_hidden:
                self.out[io_names.HIDDEN] = torch.zeros((most * n_hidden,), dtype=dtype(io_names.HIDDEN), **cuda)
            self.head_dim, self.n_hidden = head_dim, n_hidden
            self._heads = torch.arange(self.n_kv, dtype=torch.int64, **cuda)
            self._arange = torch.arange(max(widths), dtype=torch.int64, **cuda)
            self._calls = {int(w): self._make_call(int(w), int(p), rows[int(w)][2])
                           for w, p in entry["profiles"].items()}
        self._prefill = self._calls[self.prefill_chunk]
        self.stream.synchronize()

    # -- setup ---------------------------------------------------------------------------------

    def _make_call(self, width: int, profile: int, nmax: int) -> _Call:
        torch, trt, engine = self.torch, self.trt, self.engine
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise BackendError(f"cannot create an execution context for the batched engine (width {width})")
        if not context.set_optimization_profile_async(profile, self.stream.cuda_stream):
            raise BackendError(f"batched engine: cannot select optimization profile {profile} (width {width})")
        self.scratch.register(context, context_memory_size(engine, profile))
        size = nmax * (width + 4)
        call = _Call(width=width, context=context, nmax=nmax,
                     staged=torch.zeros((size,), dtype=torch.int64, device="cuda"),
                     host=torch.zeros((size,), dtype=torch.int64).pin_memory(), copied=torch.cuda.Event(),
                     ids=torch.zeros((nmax * width,), dtype=torch.int64, device="cuda"),
                     host_ids=torch.zeros((nmax * width,), dtype=torch.int64).pin_memory(), rows=RowCount(nmax))
        self._shape(call, nmax, 0)
        bound = {io_names.TOKENS: call.views.tokens, io_names.POSITION: call.views.position,
                 io_names.EMBED_TABLE: self.embed_table, **{name: call.views.out[name] for name in self.out}}
        caches = set(io_names.cache_inputs(self.n_layers))  # bound by _shape, per block
        bind_buffers(context, [name for name in self.names if name not in caches], bound,
                     f"the batched engine (width {width}, {nmax} rows)")
        return call

    def _shape(self, call: _Call, n: int, base: int) -> None:
        """Input shapes for n rows and the cache block of slots [base, base + n); drops the call's CUDA graph
        when either changes (a graph holds shapes and addresses)."""
        if (n, base) == (call.n, call.base):
            return
        context, width = call.context, call.width
        if n != call.n:
            layer = (n, self.n_kv, self.max_context, self.head_dim)
            shapes = {io_names.TOKENS: (n, width), io_names.POSITION: (n,),
                      **{name: layer for name in io_names.cache_inputs(self.n_layers)}}
            for name, shape in shapes.items():
                if not context.set_input_shape(name, shape):
                    raise BackendError(f"batched engine: '{name}' {shape} is outside the width-{width} profile")
            call.views = self._views(call, n)
        for layer in range(self.n_layers):  # (n, Hkv, S, D) from slot base: one contiguous block, no copy
            context.set_tensor_address(io_names.k_cache(layer), self.k_cache[layer, base].data_ptr())
            context.set_tensor_address(io_names.v_cache(layer), self.v_cache[layer, base].data_ptr())
        call.n, call.base, call.graph = n, base, None

    def _views(self, call: _Call, n: int) -> SimpleNamespace:
        w, nmax, L, hkv, d = call.width, call.nmax, self.n_layers, self.n_kv, self.head_dim
        s = call.staged
        at = nmax * w  # tokens | position | dest | step | hdest, at fixed offsets (addresses do not move with n)
        out = {io_names.LOGITS: self.out[io_names.LOGITS][:n * w * self.vocab_size].view(n, w, self.vocab_size),
               io_names.K_NEW: self.out[io_names.K_NEW][:L * n * hkv * w * d].view(L, n, hkv, w, d),
               io_names.V_NEW: self.out[io_names.V_NEW][:L * n * hkv * w * d].view(L, n, hkv, w, d)}
        if io_names.HIDDEN in self.out:
            out[io_names.HIDDEN] = self.out[io_names.HIDDEN][:n * w * self.n_hidden].view(n, w, self.n_hidden)
        return SimpleNamespace(tokens=s[:n * w].view(n, w), position=s[at:at + n], dest=s[at + nmax:at + nmax + n],
                               step=s[at + 2 * nmax:at + 2 * nmax + n], hdest=s[at + 3 * nmax:at + 3 * nmax + n],
                               ids=call.ids[:n * w].view(n, w), out=out)

    def _drop_graphs(self) -> None:
        for call in getattr(self, "_calls", {}).values():
            call.graph = None

    # -- a decode call -------------------------------------------------------------------------

    def _stage(self, call: _Call, tokens: np.ndarray, positions: np.ndarray, dest, step, hdest) -> None:
        """The call's int64 inputs into the pinned block, one async copy to the device."""
        call.copied.synchronize()  # the previous copy out of the pinned block is done
        host, n, w, at, nmax = call.host.numpy(), tokens.shape[0], call.width, call.nmax * call.width, call.nmax
        host[:n * w] = tokens.reshape(-1)
        for i, values in enumerate((positions, dest, step, hdest)):
            host[at + i * nmax:at + i * nmax + n] = values
        call.staged.copy_(call.host, non_blocking=True)
        call.copied.record(self.stream)

    def _enqueue(self, call: _Call) -> None:
        """execute + the called rows' keys/values (and hidden rows) into the store + argmax, on self.stream."""
        torch, v, n, w = self.torch, call.views, call.n, call.width
        if not call.context.execute_async_v3(self.stream.cuda_stream):
            raise BackendError(f"TensorRT execution failed (batched, width {w}, {n} rows)")
        index = store_index(v.dest, v.step, self._heads, self._arange, w)  # (n Hkv T,) rows of the store
        self.k_store.index_copy_(1, index, v.out[io_names.K_NEW].view(self.n_layers, -1, self.head_dim))
        self.v_store.index_copy_(1, index, v.out[io_names.V_NEW].view(self.n_layers, -1, self.head_dim))
        if self.hidden_store is not None:
            rows = (v.hdest.view(n, 1) + self._arange[:w].view(1, w)).view(-1)
            self.hidden_store.index_copy_(0, rows, v.out[io_names.HIDDEN].view(n * w, -1))
        torch.argmax(v.out[io_names.LOGITS], dim=-1, out=v.ids)

    def _decode(self, slots: Sequence[int], tokens, positions: Sequence[int]) -> tuple[_Call, tuple[int, ...]]:
        slots, tokens, positions = check_call(self.batch, self.max_context, self.widths, slots, tokens, positions)
        call = self._calls[tokens.shape[1]]
        rows = plan_call(slots, tokens, positions, call.rows.rows_for(max(slots) + 1))
        dest, step, hdest = store_targets(rows, self.n_kv, self.max_context, self.batch, self.spare_step)
        with self.torch.cuda.stream(self.stream):
            self._shape(call, rows.n, 0)
            self._stage(call, rows.tokens, rows.positions, dest, step, hdest)
            if call.graph is not None:
                call.graph.replay()
                return call, slots
            self._enqueue(call)  # eager: the first call at this shape is TensorRT's plain execution
        if self.use_cuda_graphs and not call.eager:
            try:
                call.graph = capture_cuda_graph(self.torch, self.stream, call.context, lambda: self._enqueue(call),
                                                warm_up=False)
            except RuntimeError as err:
                log.warning("CUDA graph capture of batched width %d failed (%s); running it eagerly", call.width, err)
                call.graph, call.eager = None, True
        return call, slots

    def argmax(self, slots: Sequence[int], tokens, positions: Sequence[int]) -> np.ndarray:
        """Greedy token after each position of each called slot, (m, T) int64: only the ids cross to the host."""
        call, slots = self._decode(slots, tokens, positions)
        n, w = call.n, call.width
        with self.torch.cuda.stream(self.stream):
            call.host_ids[:n * w].copy_(call.ids[:n * w], non_blocking=True)
        self.stream.synchronize()
        return call.host_ids[:n * w].numpy().reshape(n, w)[list(slots)].copy()

    def forward(self, slots: Sequence[int], tokens, positions: Sequence[int]) -> np.ndarray:
        """The called slots' logits (m, T, V) float32; each slot's T new rows are in its cache at its position."""
        call, slots = self._decode(slots, tokens, positions)
        logits = call.views.out[io_names.LOGITS]
        with self.torch.cuda.stream(self.stream):
            picked = logits if slots == tuple(range(call.n)) else logits[list(slots)]
            host = picked.to("cpu")
        return host.numpy()

    def copy_prefix(self, source: int, target: int, n_rows: int) -> None:
        """Slot target's cache rows [0, n_rows) := slot source's, on the device (BatchEngine.warm)."""
        with self.torch.cuda.stream(self.stream):
            self.k_cache[:, target, :, :n_rows].copy_(self.k_cache[:, source, :, :n_rows])
            self.v_cache[:, target, :, :n_rows].copy_(self.v_cache[:, source, :, :n_rows])
            if self.hidden is not None:
                self.hidden[target, :n_rows].copy_(self.hidden[source, :n_rows])

    # -- prefill ---------------------------------------------------------------------------------

    def prefill(self, slot: int, token_ids: Sequence[int], position: int) -> np.ndarray:
        """All of token_ids into slot's region at [position, ...) in chunks of C; the last token's logits (V,)."""
        return prefill_in_chunks(lambda part, at: self.prefill_chunk_at(slot, part, at), self.prefill_chunk,
                                 self.max_context, token_ids, position)

    def prefill_chunk_at(self, slot: int, part: Sequence[int], position: int) -> np.ndarray:
        """One chunk (1..C tokens) into slot at position, alone (n = 1, the slot's own block); its last logits (V,)."""
        check_chunk(self.batch, self.max_context, self.prefill_chunk, slot, part, position)
        call, n_valid, chunk = self._prefill, len(part), self.prefill_chunk
        tokens = np.asarray([list(part) + [part[-1]] * (chunk - n_valid)], np.int64)  # padded at the end
        zero = np.zeros((1,), np.int64)
        end = position + n_valid
        with self.torch.cuda.stream(self.stream):
            self._shape(call, 1, slot)
            self._stage(call, tokens, np.asarray([position], np.int64), zero, zero, zero)
            if not call.context.execute_async_v3(self.stream.cuda_stream):
                raise BackendError("TensorRT execution of a batched prefill chunk failed")
            out = call.views.out
            self.k_cache[:, slot, :, position:end].copy_(out[io_names.K_NEW][:, 0, :, :n_valid])
            self.v_cache[:, slot, :, position:end].copy_(out[io_names.V_NEW][:, 0, :, :n_valid])
            if self.hidden is not None:
                self.hidden[slot, position:end].copy_(out[io_names.HIDDEN][0, :n_valid])
            logits = out[io_names.LOGITS][0, n_valid - 1].to("cpu")
        return logits.numpy()

    # -- the rest --------------------------------------------------------------------------------

    def check_width(self, width: int) -> None:
        if width not in self.widths:
            ks = sorted(w - 1 for w in self.widths if w > 1)
            raise BackendError(f"no batched engine profile of width {width} (k={width - 1}); built for k in {ks}: "
                               f"rebuild with graphs.k_values including {width - 1}")

    def hidden_states(self, slot: int, start: int, stop: int):
        """Slot's hidden-state rows [start, stop), (stop - start, nH), a device view (a head reads it there)."""
        if self.hidden is None:
            raise BackendError(f"the batched engine in {self.directory} returns no hidden states: set "
                               f"speculative.eagle3_head in the profile and rebuild with `spec-edge build`")
        return self.hidden[slot, start:stop]

    def close(self) -> None:
        """Release graphs and contexts now (explicit; nothing is done in __del__); the contexts leave the scratch."""
        self.stream.synchronize()
        for call in self._calls.values():
            call.graph = None
            self.scratch.unregister(call.context)
            call.context = None
        if self._drop_graphs in self.scratch.on_realloc:
            self.scratch.on_realloc.remove(self._drop_graphs)
        self._calls, self.widths = {}, frozenset()


__all__ = ["TensorRTBatchRunner"]
