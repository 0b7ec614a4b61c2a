"""The float32 twin of a Q/DQ folder, for the forms ONNX Runtime's CPU cannot run well: nvfp4 (ONNX
Runtime 1.32 implements neither DequantizeLinear nor Cast for FLOAT4E2M1) and fp8 (its weight DQ runs
unfused on every call: ~2 s a step of the embedded default here). Activation Q/DQ (fp8) stays.

Every DequantizeLinear whose inputs are all initializers (or outputs of such DQs: NVFP4's block
scales) is evaluated here, in numpy, from the codes and scales stored in the Q/DQ folder's own
weights.bin, and replaced by its float32 result. The values are exact: an FP4 code times an FP8
scale times the global scale is what TensorRT's DQ produces. So ONNX Runtime runs the same bits the
TensorRT file carries; only the storage is wider.

    <src>_nvfp4/  ->  <src>_nvfp4_decoded/   same stems and manifest, plus "decoded": true (fp8 alike)
"""
from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spec_edge.graphs import two_rows

DECODE_FORMAT = 2  # 2: fp8 step graphs run as two rows (two_rows.py)
OPSET_AFTER = 21  # nothing below FLOAT4E2M1 needs more
Progress = Callable[[str], None]


def dequantize(codes: np.ndarray, scale: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """DequantizeLinear (no zero point) in float32: per tensor, per axis, or blocked along axis."""
    x = codes.astype(np.float32)
    s = np.asarray(scale).astype(np.float32)
    if s.ndim == 0:
        return x * s
    axis = axis % x.ndim
    if block_size:
        s = np.repeat(s, block_size, axis=axis)
    else:
        shape = [1] * x.ndim
        shape[axis] = -1
        s = s.reshape(shape)
    return x * s


def fold_weight_dq(model) -> int:
    """Replace, in place, every DequantizeLinear over constants by its float32 initializer."""
    from onnx import helper, numpy_helper

    consts = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    kept, folded = [], 0
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and all(i in consts for i in node.input if i):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if len(node.input) > 2 and node.input[2]:
                raise ValueError(f"{node.name}: a zero point in a weight DQ is not a spec_edge Q/DQ form")
            consts[node.output[0]] = dequantize(consts[node.input[0]], consts[node.input[1]],
                                                int(attrs.get("axis", 1)), int(attrs.get("block_size", 0)))
            folded += 1
        else:
            kept.append(node)
    used = {name for node in kept for name in node.input}
    del model.graph.node[:]
    model.graph.node.extend(kept)
    del model.graph.initializer[:]
    model.graph.initializer.extend(numpy_helper.from_array(v, k)  # as stored: 0-d stays 0-d
                                   for k, v in consts.items() if k in used)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = OPSET_AFTER
    return folded


def ensure_decoded(qdq_dir: Path, progress: Progress = print) -> Path:
    from spec_edge.graphs.export import ensure_derived, source_stamp

    qdq_dir = Path(qdq_dir)
    stamp = source_stamp(qdq_dir)
    return ensure_derived(qdq_dir.parent / f"{qdq_dir.name}_decoded", {"decoded_source_stamp": stamp,
                                                                      "decode_format": DECODE_FORMAT},
                          lambda tmp: _convert(qdq_dir, tmp, stamp, progress))


def _convert(src: Path, dst: Path, stamp: str, progress: Progress) -> None:
    import onnx

    from spec_edge.graphs import export

    started = time.monotonic()
    manifest = json.loads((src / "manifest.json").read_text())
    dst.mkdir(parents=True)
    store = export.WeightStore(dst / "weights.bin")
    for stem in manifest["graphs"]:
        model = onnx.load(str(src / f"{stem}.onnx"), load_external_data=True)
        folded = fold_weight_dq(model)
        # activations rounded in the graph (fp8): a one-row call must run the kernels of a multi-row one,
        # or a ~1e-6 difference flips a rounding and the step drifts from the verify rows (two_rows.py)
        rounded = any(node.op_type == "QuantizeLinear" for node in model.graph.node)
        widened = rounded and two_rows.is_fused_step(model, int(manifest["graphs"][stem].get("width", 0)))
        if widened:
            two_rows.widen(model)
        export.save(model, dst / f"{stem}.onnx", store)
        progress(f"[decode]   {stem}: {folded} DequantizeLinear nodes evaluated" + (", run as two rows" if widened else ""))
    store.close()
    for name in ("model.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dst / name)
    manifest.update(decoded=True, decoded_source_stamp=stamp, decode_format=DECODE_FORMAT, weights_bytes=store.size,
                    decode_seconds=round(time.monotonic() - started, 1))
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
