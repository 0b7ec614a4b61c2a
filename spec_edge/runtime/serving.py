"""The decoder protocol the one scheduler (runtime/scheduler.py) drives, the sink a request's output goes to, and
the front a decoder's requests go through (front_of: built from what the decoder declares, owned by the scheduler).
A decoder is opened by runtime/decoders.py's open_decoder, the one factory."""
from __future__ import annotations

from typing import Any, Protocol

from spec_edge.config import Config
from spec_edge.runtime.front import Capabilities, Front, Prepared
from spec_edge.runtime.requests import GenerateResult
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.runtime.tool_format import ToolFormat


class Sink(Protocol):
    """One request's way out of a decoder: on_text(delta, n_tokens) gets each piece of safe-to-show text (from any
    thread); cancel_reason() is asked between decode calls (None: go on; else the finish reason); done(result) is
    called once as it ends, or failed(err) when the decoder failed on it alone."""

    def on_text(self, delta: str, n_tokens: int) -> None: ...

    def cancel_reason(self) -> str | None: ...

    def done(self, result: GenerateResult) -> None: ...

    def failed(self, err: Exception) -> None: ...


class Decoder(Protocol):
    """What the scheduler drives: engine.Engine (the slot loop over ONNX Runtime), edgellm.EdgeLLMEngine (NVIDIA's
    Edge-LLM runtime) or remote.RemoteDecoder (an OpenAI-compatible server). What it declares (fixed at load):
    capabilities (what it serves; the front refuses the rest), tokenizer (the front renders, tokenizes and
    detokenizes with it), guide / tool_guide (its compiled grammar of a request's json_schema / grammar / regex, of
    a request's tool calls; RequestError for what it cannot enforce) and capacity (requests it runs at once).
    occupied: the requests in it. add(prepared, sink, waiting) starts a request the front prepared while occupied <
    capacity (nothing refuses it there); iterate(waiting) moves the requests in it on (one loop iteration; Edge-LLM:
    waits a poll for one to end) and calls their sinks' done from the caller's thread; waiting: the requests queued
    outside it (its load is occupied + waiting). An exception out of iterate leaves every request in it unanswered,
    and clear() drops them. warm(prefix_ids) puts a chat prefix many requests share into its cache."""

    cfg: Config
    capabilities: Capabilities
    tokenizer: Tokenizer | None  # None: it renders and counts a chat itself (capabilities.renders: a remote server)
    capacity: int

    def guide(self, kind: str, text: str) -> Any: ...

    def tool_guide(self, fmt: ToolFormat, schemas: dict[str, dict], choice: str, parallel: bool) -> Any: ...

    @property
    def occupied(self) -> int: ...

    def add(self, prepared: Prepared, sink: Sink, waiting: int) -> None: ...

    def iterate(self, waiting: int) -> None: ...

    def clear(self) -> None: ...

    def warm(self, prefix_ids: list[int]) -> None: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


def front_of(decoder: Decoder) -> Front:
    """The front of decoder's requests: every check against its capabilities, its tokenizer, its grammars."""
    return Front(decoder.cfg, decoder.tokenizer, decoder.capabilities, decoder.guide, decoder.tool_guide)
