"""The RequestBackend protocol the CLI, the ROS node and the tools call (runtime/scheduler.py drives it)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from spec_edge.config import Config
from spec_edge.runtime.front import Front, Prepared
from spec_edge.runtime.requests import GenerateRequest, GenerateResult
from spec_edge.runtime.speculative import BatchLoop


class RequestBackend(Protocol):
    """What the CLI, the ROS node and the tools call: a whole request in, its result out. Two kinds
    satisfy it: engine.Engine (ONNX Runtime: the speculative loop here, over step-level Runners) and
    edgellm.EdgeLLMEngine (runtime.backend tensorrt: NVIDIA's Edge-LLM runtime serves the request end to
    end). front.prepare checks a request (requests.RequestError: refused, nothing run); generate is front.prepare
    then serve; on_text(delta, n_tokens) gets each piece of safe-to-show text; cancel() is polled and its
    non-empty answer becomes the finish reason; queued: requests in the caller's queue as it starts, itself
    included (the load policy). concurrent: serve may be called from several threads at once (else the caller
    serialises). loop: the Engine's speculative loop (runtime/speculative.BatchLoop), which a caller serving
    many requests drives itself (Engine.start, loop.add, loop.iterate: runtime/scheduler.py); None for a
    backend that serves whole requests only (Edge-LLM)."""

    cfg: Config
    front: Front
    concurrent: bool
    loop: BatchLoop | None

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult: ...

    def serve(self, prepared: Prepared, on_text: Callable[[str, int], None] | None = None,
              cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult: ...

    def warm(self, system_prompt: str = "") -> int: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...
