"""What the TensorRT runners (tensorrt.py: a model; trt_head.py: an EAGLE-3 head) share on the
device: torch with CUDA for the buffers, TensorRT -> torch dtypes, the token-embedding table an
engine takes as an input (io_names.EMBED_TABLE), binding buffers to an execution context, and Scratch, the one execution-context memory
buffer every context of every runner binds (TensorRT USER_MANAGED context memory; calls are
serialised on one stream, so one buffer serves them all).
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from spec_edge.graphs import io_names
from spec_edge.runtime.backends.base import BackendError

log = logging.getLogger(__name__)

# TensorRT members used on objects (test/test_tensorrt_api.py checks them against the 10.13 bindings)
TENSORRT_API = {"IExecutionContext": ("set_device_memory", "device_memory", "execute_async_v3", "get_tensor_shape",
                                      "set_tensor_address")}
TENSORRT_RECEIVERS = {"context": "IExecutionContext"}  # expressions that always hold that class here


def torch_cuda():
    try:
        import torch
    except ImportError as err:
        raise BackendError("the TensorRT backend needs torch with CUDA for its device buffers") from err
    if not torch.cuda.is_available():
        raise BackendError("the TensorRT backend needs a CUDA device; use runtime.backend: onnxruntime here")
    return torch


def torch_dtype(trt, torch, dtype):
    table = {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
             trt.int64: torch.int64, trt.int32: torch.int32, trt.int8: torch.int8, trt.bool: torch.bool,
             trt.uint8: torch.uint8}
    if dtype not in table:
        raise BackendError(f"engine I/O dtype {dtype} has no torch equivalent")
    return table[dtype]


def load_embed_table(export_dir: Path):
    """The (V, H) table an engine takes as io_names.EMBED_TABLE, on the device: the shared table the
    export at export_dir (the ONNX folder the target engine was built from) recorded in its manifest
    (graphs/shared_table.py: a span of its weights.bin, read through a memory map). Loaded once per
    runner family and bound by address to every engine that takes it (the target's, the head's), so
    the embedding exists once on the device."""
    from spec_edge.graphs import shared_table

    if shared_table.record(export_dir) is None:
        raise BackendError(f"the engine takes {io_names.EMBED_TABLE} as an input but its export {export_dir} "
                           f"records no shared table: rebuild with `spec-edge build`")
    return shared_table.table_tensor(export_dir).to("cuda").contiguous()


def bind_buffers(context, names, buffers: dict[str, Any], engine: str) -> None:
    """Set the address of every I/O tensor in names to its buffer in buffers (contiguous, of the shape the
    context reports for its current input shapes); engine names the engine in the errors."""
    for name in names:
        buffer = buffers.get(name)
        if buffer is None:
            raise BackendError(f"{engine} has an I/O tensor '{name}' this runner does not know (io_names.py): "
                               f"rebuild it from the current export")
        want = tuple(context.get_tensor_shape(name))
        if tuple(buffer.shape) != want:
            raise BackendError(f"{engine}: '{name}' is {want}, the buffer is {tuple(buffer.shape)}")
        if not buffer.is_contiguous():
            raise BackendError(f"{engine}: the '{name}' buffer is not contiguous")
        context.set_tensor_address(name, buffer.data_ptr())


def capture_cuda_graph(torch, stream, context, body, warm_up: bool = True):
    """The CUDA graph of body() (enqueued on stream, not run). TensorRT wants one plain execution of
    the context first (it finishes its shape-dependent setup); that warm-up writes only the call's
    own outputs, never a resident cache. warm_up=False: the caller has just run the context eagerly at
    these shapes and addresses. Raises RuntimeError when either step fails."""
    if warm_up:
        with torch.cuda.stream(stream):
            if not context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("warm-up execution failed")
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        body()  # recorded, not run
    return graph


class Scratch:
    """The execution-context memory shared by every context registered here. Sized up front
    (`size`: the largest context memory of every engine that will bind it, from the manifest, or
    reserve() with an engine's device_memory_size_v2 before its contexts are made), so contexts
    are bound once. A context asking for more than reserved grows it: every context is re-bound and
    captured CUDA graphs are dropped (they hold the old address); logged, since the manifest was
    then wrong."""

    def __init__(self, torch, device: str = "cuda", size: int = 0):
        self.torch, self.device = torch, device
        self.buffer = None
        self.size = 0
        self.contexts: list[Any] = []
        self.on_realloc: list[Any] = []
        if size:
            self.reserve(size)

    def reserve(self, size: int) -> None:
        """Make the buffer at least `size` bytes (before binding contexts: then nothing re-binds)."""
        if size > self.size or self.buffer is None:
            self.size = max(int(size), self.size)
            self.buffer = self.torch.empty(max(self.size, 256), dtype=self.torch.uint8, device=self.device)
            for ctx in self.contexts:
                self._bind(ctx)
            for callback in list(self.on_realloc):
                callback()

    def register(self, context, size: int) -> None:
        self.contexts.append(context)
        if size > self.size or self.buffer is None:
            if self.buffer is not None:
                log.warning("context memory %d B is more than the %d B reserved: re-binding every context",
                            size, self.size)
            self.reserve(size)  # binds every context, this one included
        else:
            self._bind(context)

    def unregister(self, context) -> None:
        self.contexts = [ctx for ctx in self.contexts if ctx is not context]

    def _bind(self, context) -> None:
        ptr = self.buffer.data_ptr()  # torch allocations are 512-byte aligned (TensorRT needs 256)
        try:
            context.set_device_memory(ptr, self.buffer.numel())
        except (AttributeError, TypeError):  # TensorRT 10.0: the one-argument property form
            context.device_memory = ptr
