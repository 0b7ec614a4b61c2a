"""Keys spec_edge once read and no longer does: config.from_params refuses a config that still sets
one, with a message naming what replaced it (the value to write instead where there is one)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spec_edge import speculation_policy

_FOLDED = {"none": "fp32", "fp8": "fp8", "nvfp4": "nvfp4"}  # the old graphs.quantization -> graphs.weights


def message(params: dict[str, Any], weights: Sequence[str], default_k: int) -> str | None:
    """The refusal of the first retired key in params (flat 'section.field' keys), or None; weights: the
    values of graphs.weights, default_k: speculative.k's default (config.py passes both)."""
    if "graphs.quantization" in params:
        return (f"graphs.quantization is gone: the quantized forms are values of graphs.weights now "
                f"(graphs.quantization: {params['graphs.quantization']} -> graphs.weights: "
                f"{_FOLDED.get(params['graphs.quantization'], 'fp32')}; values: {', '.join(weights)})")
    for key in ("graphs.int4_block", "graphs.calibration", "memory.workspace_gb"):
        if key in params:
            return (f"{key} is gone: it shaped spec_edge's own TensorRT graphs and engines, retired for TensorRT "
                    f"Edge-LLM (docs/tensorrt.md): Edge-LLM's quantizer and builder pick their own INT4 block, "
                    f"calibration set and workspace; delete the key")
    if params.get("graphs.weights") == "int4_gguf":
        return ("graphs.weights: int4_gguf is gone (its Q4_1 minimum term has no TensorRT form; docs/tensorrt.md): "
                "on TensorRT use int4_awq, nvfp4 or fp8 (Edge-LLM's forms), on ONNX Runtime q4 (the same GGUF bits)")
    if "serve.speculate_max_queue" in params:
        old, k = params["serve.speculate_max_queue"], params.get("speculative.k", default_k)
        new = speculation_policy.from_max_queue(old, k) if isinstance(old, int) and isinstance(k, int) else "[k, .., 0]"
        return (f"serve.speculate_max_queue is gone: the load policy is {speculation_policy.KEY} now, the k to "
                f"verify at each load (0 = no speculation). speculate_max_queue: {old} is {speculation_policy.KEY}: "
                f"{new} ([] = speculative.k at every load; [k] * m + [0] = k up to m requests, none beyond; "
                f"TensorRT only: on ONNX Runtime speculative.k: auto chooses k)")
    return None
