"""The decoder protocol the one scheduler (runtime/scheduler.py) drives, and the sink a request's output goes to."""
from __future__ import annotations

from typing import Protocol

from spec_edge.config import Config
from spec_edge.runtime.front import Front, Prepared
from spec_edge.runtime.requests import GenerateResult


class Sink(Protocol):
    """One request's way out of a decoder: on_text(delta, n_tokens) gets each piece of safe-to-show text (from any
    thread); cancel_reason() is asked between decode calls (None: go on; else the finish reason); done(result) is
    called once as it ends, or failed(err) when the decoder failed on it alone (a RequestError: refused)."""

    def on_text(self, delta: str, n_tokens: int) -> None: ...

    def cancel_reason(self) -> str | None: ...

    def done(self, result: GenerateResult) -> None: ...

    def failed(self, err: Exception) -> None: ...


class Decoder(Protocol):
    """What the scheduler drives: engine.Engine (the slot loop over ONNX Runtime) or edgellm.EdgeLLMEngine (NVIDIA's
    Edge-LLM runtime). front: its Front (its Capabilities; prepare). capacity: requests it runs at once; occupied:
    those in it; waiting: those queued outside it (its caller sets it; the load policy's load is occupied +
    waiting). add(prepared, sink) starts a request while occupied < capacity (RequestError: refused, nothing
    run); iterate() moves the requests in it on (one loop iteration; Edge-LLM: waits a poll for one to end) and
    calls their sinks' done from the caller's thread; an exception out of iterate leaves every request in it
    unanswered, and clear() drops them."""

    cfg: Config
    front: Front
    capacity: int
    waiting: int

    @property
    def occupied(self) -> int: ...

    def add(self, prepared: Prepared, sink: Sink) -> None: ...

    def iterate(self) -> None: ...

    def clear(self) -> None: ...

    def warm(self, system_prompt: str = "") -> int: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...

