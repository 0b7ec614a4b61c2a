"""An EAGLE-3 head on TensorRT: one engine, its own fixed KV cache, the same interface as the ONNX
Runtime head (ort_heads.OrtEagle3Head: ingest / step / draft_ids / max_context / cfg), so the eagle3
and hybrid drafters (runtime/drafters/) run on either backend, plus greedy_chain: a whole greedy
draft chain on the device, k target ids to the host once.

The engine (manifest role HEAD_ROLE, built by `spec-edge build` from heads/eagle3_export.py's
dynamic head graph, specs.head_spec) has one optimization profile per ingest width W in (1, each
k+1, C) and one more width-1 profile for the draft step; its entry's "profiles" maps profile_key:
"<W>" for the ingest widths, "step" for the draft step, to the profile index.

Engine I/O (graphs/io_names.py; eagle3_export.dynamic_head_module is the graph):
  tokens      (1, W) int64     ingest: token i of pair i; step: the last drafted token (target id)
  hidden      (W, 3Ht)         the target's hidden rows (ingest); zeros in the step (fc has no bias)
  hidden_draft (W, H)          the head's own hidden from its previous call (step); zeros in an ingest.
                               The head row is fc(hidden) + hidden_draft, so one graph holds both
  position    (1,) int64       position of pair 0; head cache rows >= position are masked
  last_index  (1,) int64       row of the last real pair (a short chunk is padded at the end)
  k_cache, v_cache (1, Hkv, S, D)  the head's own resident cache (read only; bound once)
  embed_table (V, H)           the target's token embedding on the device, bound by address (only
                               when the engine takes it; a head with its own embedding has it inside)
  -> logits   (1, Vd) float32  draft-vocabulary logits of the last real row (sampling only)
     draft_token (1,) int64    d2t[argmax(logits)], a target id, computed in the engine
     k_new, v_new (1, Hkv, W, D)  written into the cache at [position, position + n_valid)
     hidden_out (1, H)         the head's own hidden state of the last real row

Buffers: the outputs of the last row (logits, draft_token, hidden_out) are shared by every profile
(the same shapes); k_new / v_new are views of one widest buffer. The step runs as a captured CUDA
graph: hidden_draft <- hidden_out, tokens <- draft_token, execute, cache write at position, position += 1,
so a chain of k drafts is one ingest and k - 1 replays with no host round trip.

The embedding table: the target runner's `embed_table` when its engine takes one (one copy for
both engines); otherwise trt_memory.load_embed_table from the target's export (logged: that is a
second copy on the device).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from spec_edge.device.builder import context_memory_size
from spec_edge.device.engine_file import load_engine
from spec_edge.device.manifest import ManifestError
from spec_edge.graphs import io_names
from spec_edge.heads.eagle3_export import read_head_config
from spec_edge.runtime.backends.base import BackendError
from spec_edge.runtime.backends.trt_memory import bind_buffers, capture_cuda_graph, load_embed_table, torch_dtype

log = logging.getLogger(__name__)

HEAD_ROLE = "eagle3"          # the head engine's role in manifest.json


def profile_key(kind: str, width: int) -> str:
    """Key of a head profile in the manifest entry's "profiles" (specs.EngineSpec.profile_shapes):
    the width for an ingest ('5'), 'step' for the draft step (width 1)."""
    return "step" if kind == "step" else str(width)


# TensorRT members used on objects (test/test_tensorrt_api.py checks them against the 10.13 bindings)
TENSORRT_API = {
    "ICudaEngine": ("num_io_tensors", "get_tensor_name", "get_tensor_dtype", "create_execution_context",
                    "device_memory_size_v2"),
    "IExecutionContext": ("set_optimization_profile_async", "set_input_shape", "get_tensor_shape",
                          "set_tensor_address", "execute_async_v3"),
}
TENSORRT_RECEIVERS = {"engine": "ICudaEngine", "context": "IExecutionContext", "call.context": "IExecutionContext",
                      "step.context": "IExecutionContext"}


@dataclass
class _HeadCall:
    kind: str          # ingest | step
    width: int
    context: Any
    tokens: Any        # (1, W) int64 device
    hidden: Any        # (W, 3Ht): the target's rows (ingest) / zeros (step)
    hidden_draft: Any  # (W, H): zeros (ingest) / the head's previous hidden_out (step)
    k_new: Any         # (1, Hkv, W, D): view of the widest buffer
    v_new: Any
    index: Any         # (W,) int64: position + arange(W)
    host_tokens: Any   # pinned (1, W) int64
    graph: Any = None  # the step's CUDA graph
    eager: bool = False


class TensorRTEagle3Head:
    held: tuple[int, ...] = ()  # ids whose pairs rows 0..len-2 hold validly (drafters/head.py: CachedHeadDrafter)

    def __init__(self, target, cuda_graphs: bool = True):
        """target: the TensorRTRunner whose manifest has the head engine; the head shares its
        stream, scratch and (when it has one) embedding table."""
        self.trt, self.torch, self.target = target.trt, target.torch, target
        trt, torch = self.trt, self.torch
        entries = [e for e in target.manifest["engines"].values() if e["role"] == HEAD_ROLE]
        if len(entries) != 1:
            raise ManifestError(f"{target.directory}: {len(entries)} {HEAD_ROLE} head engines in the manifest, "
                                f"want 1: set speculative.eagle3_head and rebuild with `spec-edge build`")
        entry = self.entry = entries[0]
        head_dir = Path(entry["onnx"]).parent  # the head's export: head.json, draft_ids.npy
        try:
            self.cfg = read_head_config(head_dir)
            self.draft_ids = np.load(head_dir / "draft_ids.npy")  # (Vd,) draft id -> target id
        except FileNotFoundError as err:
            raise ManifestError(f"the head engine's export folder {head_dir} lacks {Path(err.filename).name}: "
                                f"rebuild with `spec-edge build`") from err
        path = target.directory / entry["file"]
        self.engine = engine = load_engine(trt, target.runtime, path)
        if engine is None:
            raise ManifestError(f"TensorRT cannot deserialize {path}: rebuild with `spec-edge build`")
        self.stream, self.scratch, self.use_cuda_graphs = target.stream, target.scratch, cuda_graphs
        self.scratch.reserve(int(engine.device_memory_size_v2))
        self.scratch.on_realloc.append(self._drop_graphs)
        names = {engine.get_tensor_name(i) for i in range(engine.num_io_tensors)}
        c = self.cfg
        self.max_context = int(target.max_context)
        profiles = entry.get("profiles", {})
        self.ingest_widths = sorted(int(k) for k in profiles if k.isdigit())
        if not self.ingest_widths or profile_key("step", 1) not in profiles:
            raise ManifestError(f"{path}: the manifest lists profiles {sorted(profiles)}, want the ingest widths "
                                f"and 'step': rebuild with `spec-edge build`")
        widest = self.ingest_widths[-1]
        dtype = lambda n: torch_dtype(trt, torch, engine.get_tensor_dtype(n))  # noqa: E731
        cuda = {"device": "cuda"}
        with torch.cuda.stream(self.stream):
            cache = (1, c.n_kv_heads, self.max_context, c.head_dim)
            self.k_cache = torch.zeros(cache, dtype=dtype(io_names.K_CACHE), **cuda)
            self.v_cache = torch.zeros(cache, dtype=dtype(io_names.V_CACHE), **cuda)
            self.position = torch.zeros((1,), dtype=torch.int64, **cuda)
            self.last_index = torch.zeros((1,), dtype=torch.int64, **cuda)
            self.logits = torch.zeros((1, c.draft_vocab_size), dtype=dtype(io_names.LOGITS), **cuda)
            self.draft_token = torch.zeros((1,), dtype=torch.int64, **cuda)
            self.hidden_out = torch.zeros((1, c.hidden_size), dtype=dtype(io_names.HIDDEN_OUT), **cuda)
            self._new = [torch.zeros((c.n_kv_heads * widest * c.head_dim,), dtype=dtype(io_names.K_NEW), **cuda),
                         torch.zeros((c.n_kv_heads * widest * c.head_dim,), dtype=dtype(io_names.V_NEW), **cuda)]
            self._arange = torch.arange(widest, dtype=torch.int64, **cuda)
            self.embed_table = self._embed_table() if io_names.EMBED_TABLE in names else None
            self._ingest_calls = {w: self._make_call(names, "ingest", w, int(profiles[profile_key("ingest", w)]))
                                  for w in self.ingest_widths}
            self._step = self._make_call(names, "step", 1, int(profiles[profile_key("step", 1)]))
        self.stream.synchronize()
        if cuda_graphs:
            self._capture_step()  # now: its warm-up run overwrites the shared outputs

    # -- setup ---------------------------------------------------------------------------------

    def _embed_table(self):
        """(V, H) on the device: the target's own when its engine takes one, else loaded once."""
        if getattr(self.target, "embed_table", None) is not None:
            return self.target.embed_table
        targets = [e for e in self.target.manifest["engines"].values() if e["role"] == "target"]
        table = load_embed_table(Path(targets[0]["onnx"]).parent)
        log.warning("the EAGLE-3 head loaded its own copy of the embedding table (%.0f MiB): the target "
                    "engine does not take %s as an input", table.numel() * table.element_size() / 2**20,
                    io_names.EMBED_TABLE)
        return table

    def _make_call(self, names: set[str], kind: str, width: int, profile: int) -> _HeadCall:
        trt, torch, engine, c = self.trt, self.torch, self.engine, self.cfg
        context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
        if context is None:
            raise BackendError(f"cannot create an execution context for the head engine ({kind} {width})")
        if not context.set_optimization_profile_async(profile, self.stream.cuda_stream):
            raise BackendError(f"head engine: cannot select optimization profile {profile} ({kind} {width})")
        inputs = {io_names.TOKENS: (1, width), io_names.HIDDEN: (width, 3 * c.target_hidden_size),
                  io_names.HIDDEN_DRAFT: (width, c.hidden_size)}
        for name, shape in inputs.items():
            if not context.set_input_shape(name, shape):
                raise BackendError(f"head engine: {name} {shape} is outside profile {profile} ({kind} {width})")
        self.scratch.register(context, context_memory_size(engine, profile))
        cuda = {"device": "cuda"}
        new_shape = (1, c.n_kv_heads, width, c.head_dim)
        n_new = int(np.prod(new_shape))
        call = _HeadCall(
            kind=kind, width=width, context=context,
            tokens=torch.zeros((1, width), dtype=torch.int64, **cuda),
            hidden=torch.zeros(inputs[io_names.HIDDEN], dtype=torch_dtype(
                trt, torch, engine.get_tensor_dtype(io_names.HIDDEN)), **cuda),
            hidden_draft=torch.zeros(inputs[io_names.HIDDEN_DRAFT], dtype=torch_dtype(
                trt, torch, engine.get_tensor_dtype(io_names.HIDDEN_DRAFT)), **cuda),
            k_new=self._new[0][:n_new].view(new_shape), v_new=self._new[1][:n_new].view(new_shape),
            index=torch.zeros((width,), dtype=torch.int64, **cuda),
            host_tokens=torch.zeros((1, width), dtype=torch.int64).pin_memory())
        buffers = {io_names.TOKENS: call.tokens, io_names.HIDDEN: call.hidden, io_names.HIDDEN_DRAFT: call.hidden_draft,
                   io_names.POSITION: self.position, io_names.LAST_INDEX: self.last_index,
                   io_names.K_CACHE: self.k_cache, io_names.V_CACHE: self.v_cache,
                   io_names.EMBED_TABLE: self.embed_table, io_names.LOGITS: self.logits,
                   io_names.DRAFT_TOKEN: self.draft_token,
                   io_names.K_NEW: call.k_new, io_names.V_NEW: call.v_new, io_names.HIDDEN_OUT: self.hidden_out}
        bind_buffers(context, sorted(names), buffers, f"head engine ({kind} {width})")
        missing = sorted(set(buffers) - names - {io_names.EMBED_TABLE})
        if missing:
            raise BackendError(f"the head engine lacks {missing}: rebuild it from the current export")
        return call

    def _drop_graphs(self) -> None:
        if getattr(self, "_step", None) is not None:
            self._step.graph = None

    # -- calls ---------------------------------------------------------------------------------

    def _execute(self, call: _HeadCall, n_valid: int) -> None:
        """execute, then write the n_valid new rows into the cache at [position, position + n_valid)."""
        if not call.context.execute_async_v3(self.stream.cuda_stream):
            raise BackendError(f"TensorRT head execution failed ({call.kind} {call.width})")
        index = self.torch.add(self._arange[:n_valid], self.position, out=call.index[:n_valid])
        self.k_cache.index_copy_(2, index, call.k_new[:, :, :n_valid])
        self.v_cache.index_copy_(2, index, call.v_new[:, :, :n_valid])

    def _step_body(self) -> None:
        """The chained draft step: feed back the previous call's outputs, run, advance the position."""
        step = self._step
        step.hidden_draft.copy_(self.hidden_out)  # step.hidden stays zeros: fc(0) = 0
        step.tokens.view(-1).copy_(self.draft_token)
        self._execute(step, 1)
        self.position.add_(1)

    def _capture_step(self) -> None:
        """Capture the chained step (one plain run first: TensorRT finishes its shape-dependent
        setup; that run overwrites the shared outputs logits / draft_token / hidden_out but never the
        cache, so it must not run between an ingest and its chain). A failed capture leaves the
        step eager, logged once."""
        step = self._step
        try:
            step.graph = capture_cuda_graph(self.torch, self.stream, step.context, self._step_body)
        except RuntimeError as err:
            log.warning("CUDA graph capture of the head's draft step failed (%s); running it eagerly", err)
            step.graph, step.eager = None, True

    def _set_position(self, position: int, last: int) -> None:
        """On the stream, values as kernel arguments: no pinned buffer to race with."""
        self.position.fill_(position)
        self.last_index.fill_(last)

    def _ingest(self, tokens: Sequence[int], hidden, position: int) -> None:
        """Feed the pairs in chunks of the ingest widths; leaves the last pair's outputs in the
        shared buffers (logits, draft_token, hidden_out); call.hidden_draft stays zeros."""
        torch = self.torch
        n = len(tokens)
        if n == 0:
            raise BackendError("ingest needs at least one pair")
        if position < 0 or position + n > self.max_context:
            raise BackendError(f"head positions [{position}, {position + n}) do not fit its "
                               f"{self.max_context}-row cache")
        if not torch.is_tensor(hidden):
            hidden = torch.as_tensor(np.ascontiguousarray(hidden))
        start, widest = 0, self.ingest_widths[-1]
        with torch.cuda.stream(self.stream):
            while start < n:
                left = n - start
                width = next((w for w in self.ingest_widths if w >= left), widest)
                take = min(left, width)
                call = self._ingest_calls[width]
                self.stream.synchronize()  # the pinned tokens of the previous chunk are copied
                call.host_tokens.zero_()
                call.host_tokens[0, :take] = torch.as_tensor(list(tokens[start:start + take]), dtype=torch.int64)
                call.tokens.copy_(call.host_tokens, non_blocking=True)
                call.hidden[:take].copy_(hidden[start:start + take], non_blocking=True)
                call.hidden[take:].zero_()
                self._set_position(position + start, take - 1)
                self._execute(call, take)
                start += take

    def ingest(self, tokens: Sequence[int], hidden, position: int):
        """As OrtEagle3Head.ingest: (draft logits (Vd,) on the host, the head's hidden (device, valid
        until the next call)) after the last pair. hidden: (n, 3Ht) device tensor or array."""
        self._ingest(tokens, hidden, position)
        with self.torch.cuda.stream(self.stream):
            logits = self.logits[0].float().to("cpu")
        return logits.numpy(), self.hidden_out

    def step(self, token: int, hidden, position: int):
        """As OrtEagle3Head.step, for a host-chosen token (sampling): (logits (Vd,), own hidden)."""
        torch, step = self.torch, self._step
        if position < 0 or position + 1 > self.max_context:
            raise BackendError(f"head position {position} does not fit its {self.max_context}-row cache")
        with torch.cuda.stream(self.stream):
            self.stream.synchronize()
            step.host_tokens[0, 0] = int(token)
            step.tokens.copy_(step.host_tokens, non_blocking=True)
            step.hidden_draft.copy_(hidden if torch.is_tensor(hidden) else torch.as_tensor(np.asarray(hidden)))
            self._set_position(position, 0)
            self._execute(step, 1)
            logits = self.logits[0].float().to("cpu")
        return logits.numpy(), self.hidden_out

    def greedy_chain(self, tokens: Sequence[int], hidden, position: int, k: int) -> np.ndarray:
        """Greedy drafts 1..k (target ids, (k,) int64) after ingesting the pairs: the draft-vocabulary
        argmax and d2t map run in the engine, draft i+1 is fed from draft i on the device, and only
        the k ids cross to the host (one copy, one sync)."""
        torch = self.torch
        last = position + len(tokens)  # the first draft step's position
        if last + k - 1 > self.max_context:
            raise BackendError(f"head positions up to {last + k - 1} do not fit its {self.max_context}-row cache")
        if k > 1 and self.use_cuda_graphs and self._step.graph is None and not self._step.eager:
            self._capture_step()  # dropped by a scratch re-bind: again, before the ingest
        self._ingest(tokens, hidden, position)
        chain = torch.empty((k,), dtype=torch.int64, device="cuda")
        with torch.cuda.stream(self.stream):
            chain[0:1].copy_(self.draft_token)
            self._set_position(last, 0)
            for i in range(1, k):
                if self._step.graph is not None:
                    self._step.graph.replay()
                else:
                    self._step_body()
                chain[i:i + 1].copy_(self.draft_token)
            host = chain.to("cpu")
        return host.numpy()

    def close(self) -> None:
        """Release the graph and contexts now; the contexts leave the shared scratch."""
        self.stream.synchronize()
        for call in list(self._ingest_calls.values()) + [self._step]:
            call.graph = None
            self.scratch.unregister(call.context)
            call.context = None
        if self._drop_graphs in self.scratch.on_realloc:
            self.scratch.on_realloc.remove(self._drop_graphs)
        self._ingest_calls, self.engine = {}, None


__all__ = ["TensorRTEagle3Head", "HEAD_ROLE", "profile_key"]
