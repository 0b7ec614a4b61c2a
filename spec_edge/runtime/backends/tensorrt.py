"""TensorRT on the device: the engines `spec-edge build` made, run around a resident KV cache.

State, allocated once per runner (torch CUDA tensors, bound to TensorRT by name and address):
  k_cache, v_cache   (L, Hkv, S, D) graphs.dtype   resident cache; never leaves the device; bound
                                                    one layer view per input (k_cache_<i>, v_cache_<i>)
  hidden             (S, n * H) engine dtype: the hidden states the graphs return for a head
                     (io_names.HIDDEN), written like the cache; only when the engine has them
  embed_table        (V, H): when the engines take the embedding as an input (trt_memory), bound
                     to them and to the EAGLE-3 head's engine: one copy on the device
  per width T:       tokens (1, T) int64, position (1,) int64, [last_index (1,) int64: static prefill]
                     logits (T, V) float32 [(1, V) static prefill], k_new / v_new (L, Hkv, T, D),
                     [hidden (T, n * H)], index (T,) int64 = position + arange(T),
                     ids (T,) int64 = argmax(logits), pinned host copies of tokens, position and ids
  scratch            trt_memory.Scratch, shared by every context of every runner (one stream): sized
                     from the manifest by load_runners, reserve(device_memory_size_v2) per engine

A call: tokens/position host -> device (pinned, async) -> execute_async_v3 -> k_new/v_new into the
cache at [position, position + T) (index_copy_) -> argmax on the device -> T ids (argmax) or T x V
logits (forward) to the host. Fixed-width calls (step 1, verify k+1) run as one captured CUDA graph
each. greedy_chain (greedy drafts of the draft model / layer-skip) replays the step graph n times,
its token and position advanced on the device, and copies the n ids to the host once.
Engines are streamed from disk (device/engine_file.py); the manifest check at start is the quick
one (sizes + stamps), `spec-edge build --check` hashes every byte.

Engine layouts (memory.py): 'shared' - one engine per model, one optimization profile per width,
one execution context per width with its profile selected once; 'per_graph' - one engine per
width. Prefill in the shared layout uses the width-C profile and takes the last real row on the
device; in per_graph it runs the exported prefill graph with last_index.

layer_skip(n) returns a runner over the layer-skip engine whose caches are views of this runner's
first n cache layers (the first n layers compute the same keys/values, so the verify pass simply
overwrites what the drafter wrote).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spec_edge.config import Config
from spec_edge.device.builder import context_memory_size, gpu_identity, import_tensorrt
from spec_edge.device.engine_file import load_engine
from spec_edge.device.manifest import ManifestError, check_engines, profile_dir
from spec_edge.graphs import io_names
from spec_edge.runtime.backends.base import BackendError, Runner
from spec_edge.runtime.backends.trt_memory import (Scratch, bind_buffers, capture_cuda_graph, load_embed_table,
                                                   torch_cuda, torch_dtype)

log = logging.getLogger(__name__)
# TensorRT members used on objects (test/test_tensorrt_api.py checks them against the 10.13 bindings)
TENSORRT_API = {
    "Runtime": (),
    "ICudaEngine": ("num_io_tensors", "get_tensor_name", "get_tensor_shape", "get_tensor_dtype",
                    "create_execution_context", "device_memory_size_v2"),
    "IExecutionContext": ("set_optimization_profile_async", "set_input_shape", "get_tensor_shape",
                          "set_tensor_address", "execute_async_v3"),
}
# expressions that always hold that TensorRT class here: every attribute used on them must exist on it
TENSORRT_RECEIVERS = {"engine": "ICudaEngine", "first": "ICudaEngine", "context": "IExecutionContext",
                      "call.context": "IExecutionContext", "self.runtime": "Runtime"}


@dataclass
class _Call:
    """One width's execution context and buffers."""
    width: int
    kind: str                       # prefill | step | verify | layerskip
    context: Any
    tokens: Any                     # (1, T) int64 device
    position: Any                   # (1,) int64 device
    last_index: Any | None          # (1,) int64 device, static prefill only
    logits: Any                     # (T, V) or (1, V) float32 device
    k_new: Any                      # (L, Hkv, T, D) device
    v_new: Any
    index: Any                      # (T,) int64 device: position + arange(T)
    ids: Any                        # (T,) int64 device: argmax of logits
    host_tokens: Any                # pinned (1, T) int64
    host_position: Any              # pinned (1,) int64
    host_ids: Any                   # pinned (T,) int64
    hidden: Any = None              # (T, n * H) device: the head's hidden states, when returned
    staged: Any = None              # CUDA event: the last host -> device copy of the pinned inputs
    graph: Any = None               # torch.cuda.CUDAGraph of execute + cache write + argmax
    eager: bool = False             # capture failed once: run without a graph


class TensorRTRunner(Runner):
    def __init__(self, cfg: Config, role: str = "target", *, manifest: dict | None = None,
                 scratch: Scratch | None = None, stream=None, cuda_graphs: bool = True,
                 verify: str = "quick", _parent: "TensorRTRunner | None" = None):
        self.trt = trt = import_tensorrt()
        self.torch = torch = torch_cuda()
        self.cfg, self.role = cfg, role
        if manifest is None:
            manifest = check_engines(cfg, trt_version=trt.__version__, gpu=gpu_identity(), verify=verify)
        self.manifest = manifest
        self.directory = profile_dir(cfg)
        entries = {name: e for name, e in manifest["engines"].items() if e["role"] == role}
        if not entries:
            raise ManifestError(f"no {role} engine in {self.directory}: rebuild with `spec-edge build`")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.stream = _parent.stream if _parent is not None else (stream or torch.cuda.Stream())
        self.scratch = scratch if scratch is not None else (_parent.scratch if _parent else Scratch(torch))
        self.scratch.on_realloc.append(self._drop_graphs)
        self.use_cuda_graphs = cuda_graphs
        self.engines = {}
        for name, entry in entries.items():
            path = self.directory / entry["file"]
            engine = load_engine(trt, self.runtime, path)  # streamed: no whole host copy of the file
            if engine is None:
                raise ManifestError(f"TensorRT cannot deserialize {path} (built by another TensorRT or "
                                    f"GPU?): rebuild with `spec-edge build`")
            self.engines[name] = engine
            self.scratch.reserve(int(engine.device_memory_size_v2))  # every profile's need, before binding
        first = next(iter(self.engines.values()))
        n_layers = sum(first.get_tensor_name(i).startswith(io_names.K_CACHE_PREFIX)
                       for i in range(first.num_io_tensors))
        if n_layers == 0:
            raise ManifestError(f"{self.directory}: the engines have no per-layer cache inputs "
                                f"({io_names.k_cache(0)}, ...): built from an older export; rebuild with "
                                f"`spec-edge build`")
        cache_shape = (n_layers,) + tuple(first.get_tensor_shape(io_names.k_cache(0)))  # (L, Hkv, S, D)
        self.n_layers, n_kv, self.max_context, head_dim = cache_shape
        self.cache_dtype = torch_dtype(trt, torch, first.get_tensor_dtype(io_names.k_cache(0)))
        self.vocab_size = int(first.get_tensor_shape(io_names.LOGITS)[-1])
        names = {first.get_tensor_name(i) for i in range(first.num_io_tensors)}
        self.hidden = None  # (S, n * H): the head's hidden states of every processed position
        self.embed_table = None  # (V, H) when the engines take it as an input (shared with the head)
        with torch.cuda.stream(self.stream):
            if io_names.EMBED_TABLE in names:
                self.embed_table = (_parent.embed_table if _parent is not None and _parent.embed_table is not None
                                    else load_embed_table(Path(next(iter(entries.values()))["onnx"]).parent))
            if io_names.HIDDEN in names:
                width = int(first.get_tensor_shape(io_names.HIDDEN)[-1])
                self.hidden = torch.zeros((self.max_context, width), device="cuda",
                                          dtype=torch_dtype(trt, torch, first.get_tensor_dtype(io_names.HIDDEN)))
            if _parent is None:
                self.k_cache = torch.zeros(cache_shape, dtype=self.cache_dtype, device="cuda")
                self.v_cache = torch.zeros(cache_shape, dtype=self.cache_dtype, device="cuda")
            else:  # layer-skip: the parent's first n layers, same storage
                if self.n_layers > _parent.n_layers or (n_kv, self.max_context, head_dim) != tuple(
                        _parent.k_cache.shape[1:]):
                    raise BackendError(f"layer-skip engine cache {cache_shape} does not fit the target's "
                                       f"{tuple(_parent.k_cache.shape)}")
                self.k_cache = _parent.k_cache[:self.n_layers]
                self.v_cache = _parent.v_cache[:self.n_layers]
            self._arange = torch.arange(max(max(e["widths"]) for e in entries.values()),
                                        dtype=torch.int64, device="cuda")
            self._calls: dict[int, _Call] = {}
            self._prefill: _Call | None = None
            for name, entry in entries.items():
                engine = self.engines[name]
                for width_s, profile in entry.get("profiles", {str(entry["widths"][0]): 0}).items():
                    width = int(width_s)
                    call = self._make_call(engine, entry, width, int(profile))
                    if call.kind == "prefill":
                        self._prefill = call
                        if call.last_index is None and width - 1 in cfg.graphs.k_values:
                            self._calls[width] = call  # a dynamic-layout prefill profile is also verify k+1
                    else:
                        self._calls[width] = call
        self.prefill_chunk = self._prefill.width if self._prefill is not None else 0
        self.widths = frozenset(self._calls)
        self.stream.synchronize()

    # -- setup ---------------------------------------------------------------------------------

    def _make_call(self, engine, entry: dict, width: int, profile: int) -> _Call:
        trt, torch = self.trt, self.torch
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise BackendError(f"cannot create an execution context for {entry['file']}")
        if entry.get("dynamic"):
            if not context.set_optimization_profile_async(profile, self.stream.cuda_stream):
                raise BackendError(f"{entry['file']}: cannot select optimization profile {profile}")
            if not context.set_input_shape(io_names.TOKENS, (1, width)):
                raise BackendError(f"{entry['file']}: tokens shape (1, {width}) is outside profile {profile}")
        self.scratch.register(context, context_memory_size(engine, profile if entry.get("dynamic") else 0))
        kind = entry["kinds"][str(width)]
        names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        static_prefill = io_names.LAST_INDEX in names
        shape = lambda n: tuple(context.get_tensor_shape(n))  # noqa: E731 - resolved for this profile
        dtype = lambda n: torch_dtype(trt, torch, engine.get_tensor_dtype(n))  # noqa: E731
        cuda = {"device": "cuda"}
        call = _Call(
            width=width, kind=kind, context=context,
            tokens=torch.zeros(shape(io_names.TOKENS), dtype=dtype(io_names.TOKENS), **cuda),
            position=torch.zeros(shape(io_names.POSITION), dtype=dtype(io_names.POSITION), **cuda),
            last_index=(torch.zeros(shape(io_names.LAST_INDEX), dtype=dtype(io_names.LAST_INDEX), **cuda)
                        if static_prefill else None),
            logits=torch.zeros(shape(io_names.LOGITS), dtype=dtype(io_names.LOGITS), **cuda),
            k_new=torch.zeros(shape(io_names.K_NEW), dtype=dtype(io_names.K_NEW), **cuda),
            v_new=torch.zeros(shape(io_names.V_NEW), dtype=dtype(io_names.V_NEW), **cuda),
            index=torch.zeros((width,), dtype=torch.int64, **cuda),
            ids=torch.zeros((shape(io_names.LOGITS)[0],), dtype=torch.int64, **cuda),
            host_tokens=torch.zeros((1, width), dtype=torch.int64).pin_memory(),
            host_position=torch.zeros((1,), dtype=torch.int64).pin_memory(),
            host_ids=torch.zeros((shape(io_names.LOGITS)[0],), dtype=torch.int64).pin_memory(),
            staged=torch.cuda.Event(),
            hidden=(torch.zeros(shape(io_names.HIDDEN), dtype=dtype(io_names.HIDDEN), **cuda)
                    if io_names.HIDDEN in names else None))
        buffers = {io_names.TOKENS: call.tokens, io_names.POSITION: call.position,
                   io_names.LAST_INDEX: call.last_index, io_names.LOGITS: call.logits,
                   io_names.K_NEW: call.k_new, io_names.V_NEW: call.v_new, io_names.HIDDEN: call.hidden,
                   io_names.EMBED_TABLE: self.embed_table}
        for layer in range(self.n_layers):  # (Hkv, S, D) views of the resident cache: contiguous, no copy
            buffers[io_names.k_cache(layer)] = self.k_cache[layer]
            buffers[io_names.v_cache(layer)] = self.v_cache[layer]
        bind_buffers(context, names, buffers, entry["file"])
        return call

    def _drop_graphs(self) -> None:
        for call in getattr(self, "_calls", {}).values():
            call.graph = None

    def _enqueue(self, call: _Call) -> None:
        """execute + cache write at [position, position + T) + argmax, all on self.stream."""
        torch = self.torch
        if not call.context.execute_async_v3(self.stream.cuda_stream):
            raise BackendError(f"TensorRT execution failed (width {call.width})")
        torch.add(self._arange[:call.width], call.position, out=call.index)
        self.k_cache.index_copy_(2, call.index, call.k_new)
        self.v_cache.index_copy_(2, call.index, call.v_new)
        if call.hidden is not None:
            self.hidden.index_copy_(0, call.index, call.hidden)
        torch.argmax(call.logits, dim=-1, out=call.ids)

    def _capture(self, call: _Call) -> None:
        """Capture a fixed-width call (execute + cache write + argmax) as a CUDA graph, at its first
        use. TensorRT wants one plain execution first (it finishes shape-dependent setup); that
        warm-up writes only k_new/v_new/logits, never the cache, so capturing mid-conversation is
        safe. A failed capture leaves the call eager (logged once)."""
        try:
            call.graph = capture_cuda_graph(self.torch, self.stream, call.context, lambda: self._enqueue(call))
        except RuntimeError as err:
            log.warning("CUDA graph capture of width %d failed (%s); running it eagerly", call.width, err)
            call.graph, call.eager = None, True

    # -- calls ---------------------------------------------------------------------------------

    def _stage(self, call: _Call, token_ids: Sequence[int], position: int) -> None:
        call.staged.synchronize()  # the previous async copy out of the pinned buffers is done
        call.host_tokens[0, :len(token_ids)] = self.torch.as_tensor(list(token_ids), dtype=self.torch.int64)
        call.host_position[0] = position
        call.tokens.copy_(call.host_tokens, non_blocking=True)
        call.position.copy_(call.host_position, non_blocking=True)
        call.staged.record(self.stream)

    def _run(self, token_ids: Sequence[int], position: int) -> _Call:
        width = len(token_ids)
        self.check_width(width)
        self.check_room(position, width)
        call = self._calls[width]
        if self.use_cuda_graphs and call.graph is None and not call.eager:
            self._capture(call)
        with self.torch.cuda.stream(self.stream):
            self._stage(call, token_ids, position)
            if call.graph is not None:
                call.graph.replay()
            else:
                self._enqueue(call)
        return call

    def argmax(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        """Greedy token after each position: only T int64 ids cross to the host."""
        call = self._run(token_ids, position)
        with self.torch.cuda.stream(self.stream):
            call.host_ids.copy_(call.ids, non_blocking=True)
        self.stream.synchronize()
        return call.host_ids.numpy().copy()

    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        call = self._run(token_ids, position)
        with self.torch.cuda.stream(self.stream):
            logits = call.logits.to("cpu", non_blocking=False)
        return logits.numpy()

    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        call = self._prefill
        if call is None:
            raise BackendError("this runner has no prefill engine")
        n_tokens = len(token_ids)
        if n_tokens == 0:
            raise BackendError("prefill needs at least one token")
        self.check_room(position, n_tokens)
        chunk, torch = call.width, self.torch
        last_row = 0
        with torch.cuda.stream(self.stream):
            for start in range(0, n_tokens, chunk):
                part = list(token_ids[start:start + chunk])
                n_valid = len(part)
                # pad a short last chunk with its last token: causal masking keeps padding out of the
                # real rows, and only the n_valid real rows are written to the cache
                self._stage(call, part + [part[-1]] * (chunk - n_valid), position + start)
                if call.last_index is not None:
                    call.last_index.fill_(n_valid - 1)
                if not call.context.execute_async_v3(self.stream.cuda_stream):
                    raise BackendError("TensorRT prefill execution failed")
                at = position + start
                self.k_cache[:, :, at:at + n_valid].copy_(call.k_new[:, :, :n_valid])
                self.v_cache[:, :, at:at + n_valid].copy_(call.v_new[:, :, :n_valid])
                if call.hidden is not None:
                    self.hidden[at:at + n_valid].copy_(call.hidden[:n_valid])
                last_row = 0 if call.last_index is not None else n_valid - 1
            logits = call.logits[last_row].to("cpu")
        return logits.numpy()

    def greedy_chain(self, token: int, position: int, n: int) -> np.ndarray:
        """n greedy tokens after `token` at `position` (the draft model's drafts): n step calls whose
        input token and position advance on the device (no host round trip between them), then
        one copy of the n ids. The cache gets token and the first n-1 ids at position.."""
        self.check_room(position, n)
        call = self._run([token], position)
        chain = self.torch.empty((n,), dtype=self.torch.int64, device="cuda")
        with self.torch.cuda.stream(self.stream):
            chain[0:1].copy_(call.ids)
            for i in range(1, n):
                call.tokens.view(-1).copy_(call.ids)
                call.position.add_(1)
                if call.graph is not None:
                    call.graph.replay()
                else:
                    self._enqueue(call)
                chain[i:i + 1].copy_(call.ids)
            host = chain.to("cpu", non_blocking=False)
        return host.numpy()

    def hidden_states(self, start: int, stop: int):
        """The head's hidden-state rows [start, stop), (stop - start, n * H), as a device tensor view
        (the TensorRT head reads it on the device; nothing crosses to the host)."""
        if self.hidden is None:
            raise BackendError(f"the {self.role} engines in {self.directory} return no hidden states: set "
                               f"speculative.eagle3_head in the profile and rebuild with `spec-edge build`")
        return self.hidden[start:stop]

    def close(self) -> None:
        """Release graphs, contexts and engines now (explicit; nothing is done in __del__); the
        contexts leave the shared scratch."""
        self.stream.synchronize()
        for call in list(self._calls.values()) + ([self._prefill] if self._prefill else []):
            call.graph = None
            if call.context is not None:
                self.scratch.unregister(call.context)
            call.context = None
        if self._drop_graphs in self.scratch.on_realloc:
            self.scratch.on_realloc.remove(self._drop_graphs)
        self._calls, self._prefill, self.engines = {}, None, {}
        self.widths = frozenset()

    def layer_skip(self, n_layers: int) -> "TensorRTRunner":
        if self.role != "target":
            raise BackendError("layer-skip runs over the target model")
        if n_layers != self.cfg.graphs.layer_skip_layers:
            raise BackendError(f"engines were built for layer-skip over {self.cfg.graphs.layer_skip_layers} "
                               f"layers, not {n_layers}: set graphs.layer_skip_layers and rebuild")
        return TensorRTRunner(self.cfg, "layerskip", manifest=self.manifest, cuda_graphs=self.use_cuda_graphs,
                              _parent=self)


def load_runners(cfg: Config, *, verify: str = "quick", cuda_graphs: bool = True
                 ) -> tuple[TensorRTRunner, TensorRTRunner | None]:
    """(target, draft or None): the engines are checked once against cfg (refusing a missing,
    corrupted or mismatched one; verify='quick': sizes + stamps, `spec-edge build --check` runs the
    full hash), all runners share one stream-ordered scratch buffer sized for every engine in the
    manifest (head and layer-skip included, loaded later) before any context is bound."""
    if cfg.graphs.batch_slots > 1:
        raise BackendError(f"graphs.batch_slots={cfg.graphs.batch_slots} runs the batched engine through "
                           f"trt_batch.TensorRTBatchRunner (BatchEngine.from_config), not load_runners")
    trt = import_tensorrt()
    manifest = check_engines(cfg, trt_version=trt.__version__, gpu=gpu_identity(), verify=verify)
    torch = torch_cuda()
    scratch = Scratch(torch, size=max((int(e.get("context_memory", 0)) for e in manifest["engines"].values()),
                                      default=0))
    target = TensorRTRunner(cfg, "target", manifest=manifest, scratch=scratch, cuda_graphs=cuda_graphs)
    draft = None
    if cfg.speculative.drafter == "draft":  # same stream: the shared scratch is never used concurrently
        draft = TensorRTRunner(cfg, "draft", manifest=manifest, scratch=scratch, stream=target.stream,
                               cuda_graphs=cuda_graphs)
    return target, draft


__all__ = ["TensorRTRunner", "load_runners", "Scratch"]
