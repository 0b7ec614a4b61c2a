"""open_decoder: the one factory of the configured decoder (serving.Decoder), by runtime.backend."""
from __future__ import annotations

from collections.abc import Callable

from spec_edge.config import Config
from spec_edge.runtime.serving import Decoder


def open_decoder(cfg: Config, progress: Callable[[str], None] = print) -> Decoder:
    """Load the decoder of cfg from the files the build made (a missing one is refused with the command that makes
    it): onnxruntime, engine.Engine over the exported graphs; tensorrt, backends/edgellm.py's over the engines
    `spec-edge build` made; remote, backends/remote.py's over an OpenAI-compatible server (remote.fallback local:
    with this profile's own onnxruntime decoder beside it)."""
    if cfg.runtime.backend == "tensorrt":
        from spec_edge.runtime.backends.edgellm import EdgeLLMEngine

        return EdgeLLMEngine.from_config(cfg, progress)
    if cfg.runtime.backend == "remote":
        from spec_edge.runtime.backends.remote import RemoteDecoder

        local = cfg.replace(**{"runtime.backend": "onnxruntime"}) if cfg.remote.fallback else None
        return RemoteDecoder.open(cfg, open_decoder(local, progress) if local else None, progress)
    from spec_edge.runtime.engine import Engine

    return Engine.from_config(cfg, progress)
