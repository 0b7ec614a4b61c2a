"""Quantized ONNX for both backends: graphs.weights int4_awq | int4_gguf | fp8 | nvfp4 as Q/DQ nodes.

A post-export pass like quantize.py and ort_attention.py: every decoder linear layer of the target,
an exported Gemm(x, W, transB=1) reading model.layers.<i>.{self_attn,mlp}.*_proj.weight, becomes
MatMul(x', DequantizeLinear(codes, scale)) with the codes stored as W.T (K, N), blocks along K = the
DQ's axis 0: TensorRT's weight-only pattern (DQ -> MatMul), and the one ONNX Runtime's CPU fuses
into MatMulNBits (0.7 ms instead of 15 ms for a 576 x 1536 INT4 weight with Gemm(transB=1) over an
axis-1 DQ, measured here). graphs/qdq_formats.py holds the numbers. Embeddings, the LM head and the
norms stay in the graph's dtype. Nothing else
changes: inputs, outputs, their names (io_names.py) and shapes (static, or the dynamic T of the
TensorRT graphs) are the export's.

    int4_awq   x' = x * pre (AWQ)          W.T = DQ(INT4 codes, scale, axis=0, block_size=B)
    int4_gguf                              W.T = DQ(INT4 q - 8, d, axis=0, block_size=32);
                                           y += BlockSum32(x) @ (m + 8 d)   (the GGUF's Q4_1 bits)
    fp8        x' = DQ(Q(x, s_x))          W.T = DQ(FLOAT8E4M3FN codes, per-column scale, axis=1)
    nvfp4                                  W.T = DQ(FLOAT4E2M1 codes, DQ(FP8 block scales, global), axis=0,
                                                    block_size=16)   (weights only: see docs/tensorrt.md)

Each weight is rounded once and shared by every graph of the folder (one weights.bin), so the
prefill, step and verify graphs multiply by the very same numbers: speculative output stays equal
to the quantized target's own. The folder's manifest records the method, block size and
calibration set (graphs/calibration.py); backends compare it with the profile (check_profile).

    <src>_<weights>/   same stems, plus "weights": <form> and "quantization": {...}

ONNX Runtime 1.32's CPU kernels run the INT4 files as they are (fused into MatMulNBits). They have no
FLOAT4E2M1 kernel, and run an FP8 weight DQ unfused on every call, so for nvfp4 and fp8 ONNX Runtime
runs <src>_<form>_decoded/: the same folder with every weight DQ evaluated in numpy from the folder's
own stored codes and scales (the same values, in float32); fp8's activation Q/DQ nodes stay.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spec_edge.config import QDQ_WEIGHTS, ConfigError
from spec_edge.graphs import qdq_formats as qf

QDQ_FORMAT = 2  # 2: MatMul over (K, N) codes, DQ axis 0 (ONNX Runtime fuses it into MatMulNBits)
Progress = Callable[[str], None]
LINEAR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
OPSET = {"int4_awq": 21, "int4_gguf": 21, "fp8": 21, "nvfp4": 23}  # blocked DQ: 21; FLOAT4E2M1: 23


def _float_type(dtype: str):
    import ml_dtypes
    from onnx import TensorProto

    return {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16),
            "bfloat16": (ml_dtypes.bfloat16, TensorProto.BFLOAT16)}[dtype]


def rewrite_model(model, forms: dict[str, qf.QuantWeight], act_scales: dict[str, float], dtype: str,
                  weights: str) -> int:
    """Give every Gemm(x, W, transB=1) whose W is in `forms` its Q/DQ weight, in place; returns the count."""
    import onnx
    from onnx import helper, numpy_helper

    np_float, _ = _float_type(dtype)
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    new_nodes, new_inits, done = [], [], 0
    block_sums: dict[str, str] = {}

    def add(array, name):
        new_inits.append(numpy_helper.from_array(array, name))
        return name

    for node in graph.node:
        trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
        weight = node.input[1] if node.op_type == "Gemm" and len(node.input) >= 2 else None
        if weight not in forms or weight not in inits or not trans_b:
            new_nodes.append(node)
            continue
        form, base, x = forms[weight], weight.replace("/", "_"), node.input[0]
        if form.pre is not None:  # AWQ: x * (1 / s)
            new_nodes.append(helper.make_node("Mul", [x, add(form.pre.astype(np_float), f"{base}_awq_pre")],
                                              [f"{base}_awq_x"], name=f"{node.name}_awq"))
            x = f"{base}_awq_x"
        if weight in act_scales:  # fp8 activations: static per-tensor Q/DQ
            scale = add(np.array(act_scales[weight], np_float), f"{base}_act_scale")
            zero = add(np.zeros((), form.codes.dtype), f"{base}_act_zero")
            new_nodes.append(helper.make_node("QuantizeLinear", [x, scale, zero], [f"{base}_act_q"],
                                              name=f"{node.name}_act_q", saturate=1))
            new_nodes.append(helper.make_node("DequantizeLinear", [f"{base}_act_q", scale, zero], [f"{base}_act_dq"],
                                              name=f"{node.name}_act_dq"))
            x = f"{base}_act_dq"
        codes = add(np.ascontiguousarray(form.codes.T), f"{base}_{form.kind}")  # (K, N): MatMul's B
        if form.kind == "nvfp4":
            new_nodes.append(helper.make_node(
                "DequantizeLinear", [add(np.ascontiguousarray(form.scale.T), f"{base}_fp8_scale"),
                                     add(np.array(form.global_scale, np_float), f"{base}_global_scale")],
                [f"{base}_block_scale"], name=f"{node.name}_scale_dq"))
            scale, attrs = f"{base}_block_scale", {"axis": 0, "block_size": form.block}
        elif form.kind == "fp8":
            scale, attrs = add(form.scale.astype(np_float), f"{base}_scale"), {"axis": 1}
        else:
            scale = add(np.ascontiguousarray(form.scale.T).astype(np_float), f"{base}_scale")
            attrs = {"axis": 0, "block_size": form.block}
        new_nodes.append(helper.make_node("DequantizeLinear", [codes, scale], [f"{base}_dq"],
                                          name=f"{node.name}_weight_dq", **attrs))
        out = node.output[0] if form.mins is None else f"{base}_main"
        new_nodes.append(helper.make_node("MatMul", [x, f"{base}_dq"], [out], name=node.name))
        if form.mins is not None:  # int4_gguf: + BlockSum32(x) @ (m + 8 d)
            raw = node.input[0]
            if raw not in block_sums:
                shape = add(np.array([0, -1, qf.Q4_1_BLOCK], np.int64), f"{base}_bs_shape")
                axes = add(np.array([-1], np.int64), f"{base}_bs_axes")
                new_nodes.append(helper.make_node("Reshape", [raw, shape], [f"{base}_bs_blocks"],
                                                  name=f"{node.name}_bs_r"))
                new_nodes.append(helper.make_node("ReduceSum", [f"{base}_bs_blocks", axes], [f"{base}_blocksum"],
                                                  name=f"{node.name}_bs", keepdims=0))
                block_sums[raw] = f"{base}_blocksum"
            mins = add(form.mins.astype(np_float), f"{base}_mins")
            new_nodes.append(helper.make_node("MatMul", [block_sums[raw], mins], [f"{base}_minterm"],
                                              name=f"{node.name}_mins"))
            new_nodes.append(helper.make_node("Add", [out, f"{base}_minterm"], [node.output[0]],
                                              name=f"{node.name}_add"))
        done += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    used = {name for n in graph.node for name in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep + new_inits)
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx"):
            opset.version = max(opset.version, OPSET[weights])
    model.ir_version = max(model.ir_version, 11 if weights == "nvfp4" else 10)
    del graph.value_info[:]  # stale shapes of rewritten tensors; inputs and outputs keep theirs
    onnx.checker.check_model(model, full_check=False)
    return done


# ---------------------------------------------------------------------------------------------
# Rounding every linear weight of a folder once


def make_forms(weights: str, arrays: dict[str, np.ndarray], block: int, calibration=None,
               gguf_blocks: Callable[[str], object] | None = None) -> tuple[dict, dict, dict]:
    """(forms, fp8 activation scales, AWQ alphas) for the linear weights in arrays (name -> (N, K) f32)."""
    forms, act_scales, alphas = {}, {}, {}
    for name, w in arrays.items():
        if weights == "int4_awq":
            stats = calibration.by_weight[name]
            forms[name], alphas[name] = qf.int4_awq(w, stats.mean_abs, stats.sample(), block)
        elif weights == "int4_gguf":
            q = gguf_blocks(name)
            if q is None:
                raise qf.QdqError(f"{name} has no Q4_1 blocks in the GGUF: graphs.weights int4_gguf needs every "
                                  f"decoder linear weight stored as Q4_1 (use int4_awq)")
            forms[name] = qf.int4_from_q4_1(q.codes, q.d, q.m)
        elif weights == "fp8":
            forms[name] = qf.fp8_weight(w)
            act_scales[name] = qf.fp8_activation_scale(calibration.by_weight[name].amax)
        else:
            forms[name] = qf.nvfp4_weight(w)
    return forms, act_scales, alphas


def wanted_record(cfg, weights: str, calibration_sha: str | None) -> dict:
    """What the manifest's "quantization" holds for a profile (compared by check_profile)."""
    g = cfg.graphs
    record = {"weights": weights, "format": QDQ_FORMAT}
    if weights == "int4_awq":
        record.update(method="awq_lite", block_size=g.int4_block)
    elif weights == "int4_gguf":
        record.update(method="gguf_q4_1", block_size=qf.Q4_1_BLOCK)
    elif weights == "fp8":
        record.update(method="max", block_size=0, activations="fp8 per-tensor static")
    else:
        record.update(method="max", block_size=qf.NVFP4_BLOCK, activations="not quantized")
    if weights in ("int4_awq", "fp8"):
        record["calibration_sha256"] = calibration_sha
    return record


def check_profile(cfg, manifest: dict, folder: Path, rebuild: str) -> None:
    """Refuse a graph / engine folder whose quantization is not the profile's graphs.weights."""
    want = cfg.graphs.weights if cfg.graphs.weights in QDQ_WEIGHTS else "none"
    have_record = manifest.get("quantization") or {}
    have = have_record.get("weights", "none")
    problem = None
    if have != want:
        problem = f"holds {have} weights but the profile asks graphs.weights={cfg.graphs.weights}"
    elif want != "none":
        block = cfg.graphs.int4_block if want == "int4_awq" else have_record.get("block_size")
        if have_record.get("block_size") != block:
            problem = f"was quantized with block size {have_record.get('block_size')}, the profile asks {block}"
        elif want in ("int4_awq", "fp8"):
            from spec_edge.graphs import calibration as calib

            texts, source = calib.read_texts(cfg.graphs.calibration)
            if have_record.get("calibration_sha256") != calib.texts_sha256(texts):
                problem = f"was calibrated on another prompt set than {source} (graphs.calibration)"
    if problem:
        raise ConfigError(f"{folder} {problem}: rebuild it with `{rebuild}`")


def folder_for(src_dir: Path, weights: str) -> Path:
    return src_dir.parent / f"{src_dir.name}_{weights}"


def ensure_qdq(cfg, src_dir: Path, calib_dir: Path, progress: Progress = print, session_factory=None) -> Path:
    """The Q/DQ copy of src_dir (an exported or fused target folder) for cfg.graphs.weights; calib_dir:
    the static float32 export calibration runs (int4_awq, fp8). Made once; redone when src_dir, the
    block size or the calibration set changes."""
    from spec_edge.graphs import calibration as calib
    from spec_edge.graphs.export import ensure_derived, source_stamp

    weights = cfg.graphs.weights
    src_dir = Path(src_dir)
    texts, source, sha = None, None, None
    if weights in ("int4_awq", "fp8"):
        texts, source = calib.read_texts(cfg.graphs.calibration)
        sha = calib.texts_sha256(texts)
    record = wanted_record(cfg, weights, sha)
    stamp = source_stamp(src_dir)

    def make(tmp: Path) -> None:
        calibration = None
        if texts is not None:
            progress(f"[{weights}] calibrating on {len(texts)} prompts from {source} ...")
            calibration = calib.calibrate(calib_dir, texts, source, _linear_names(src_dir), cfg.runtime.threads,
                                          session_factory)
        _convert(cfg, src_dir, tmp, record, stamp, calibration, progress)

    return ensure_derived(folder_for(src_dir, weights), {"qdq_source_stamp": stamp, "quantization": record}, make)


def _linear_names(folder: Path) -> set[str]:
    import onnx

    manifest = json.loads((folder / "manifest.json").read_text())
    names = set()
    for stem in manifest["graphs"]:
        model = onnx.load(str(folder / f"{stem}.onnx"), load_external_data=False)
        names |= {t.name for t in model.graph.initializer if LINEAR.match(t.name)}
    return names


def _gguf_lookup(cfg) -> Callable[[str], object]:
    from spec_edge.graphs.gguf_blocks import GgufBlocks, gguf_name, match_rows, take_rows
    from spec_edge.graphs.weights import resolve

    source = resolve(cfg.model.target)
    if source.suffix != ".gguf":
        raise ConfigError(f"graphs.weights=int4_gguf carries a GGUF's Q4_1 blocks; the target '{cfg.model.target}' "
                          f"is not a GGUF file (use int4_awq)")
    gguf = GgufBlocks(source)

    def lookup(name: str, weight: np.ndarray):
        gname = gguf_name(name)
        if gname is None or gguf.kind(gname) != "Q4_1":
            return None
        q = gguf.get(gname)
        return take_rows(q, match_rows(weight, q.dequantize()))  # bit-identical rows, or refused

    return lookup


def _convert(cfg, src: Path, dst: Path, record: dict, stamp: str, calibration, progress: Progress) -> None:
    import onnx
    from onnx import numpy_helper

    from spec_edge.graphs import export

    weights = cfg.graphs.weights
    started = time.monotonic()
    manifest = json.loads((src / "manifest.json").read_text())
    dtype = manifest.get("dtype", "float32")
    lookup = _gguf_lookup(cfg) if weights == "int4_gguf" else None
    dst.mkdir(parents=True)
    store = export.WeightStore(dst / "weights.bin")
    forms: dict[str, qf.QuantWeight] = {}
    act_scales: dict[str, float] = {}
    alphas: dict[str, float] = {}
    for stem in manifest["graphs"]:
        model = onnx.load(str(src / f"{stem}.onnx"), load_external_data=True)
        arrays = {t.name: t for t in model.graph.initializer if LINEAR.match(t.name) and t.name not in forms}
        fresh = {name: numpy_helper.to_array(t).astype(np.float32) for name, t in arrays.items()}
        if fresh:
            blocks = (lambda name: lookup(name, fresh[name])) if lookup else None
            new_forms, new_scales, new_alphas = make_forms(weights, fresh, cfg.graphs.int4_block, calibration, blocks)
            forms.update(new_forms)
            act_scales.update(new_scales)
            alphas.update(new_alphas)
        count = rewrite_model(model, forms, act_scales, dtype, weights)
        if count == 0:
            raise qf.QdqError(f"{src / stem}.onnx: no Gemm reads a decoder linear weight "
                              f"(model.layers.<i>.*_proj.weight): not a spec_edge export of format 2")
        export.save(model, dst / f"{stem}.onnx", store)
        progress(f"[{weights}]   {stem}: {count} linear layers")
    store.close()
    for name in ("model.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dst / name)
    full = dict(record)
    if calibration is not None:
        full.update(calibration.describe())
    if alphas:
        full["awq_alpha_mean"] = round(float(np.mean(list(alphas.values()))), 3)
    full["linear_bytes"] = int(sum(f.nbytes for f in forms.values()))
    manifest.update(weights=weights, quantization=record, quantization_detail=full, qdq_source_stamp=stamp,
                    weights_bytes=store.size, qdq_seconds=round(time.monotonic() - started, 1))
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=1))
    progress(f"[{weights}] ready: {len(forms)} weights, weights.bin {store.size / 1e6:.1f} MB "
             f"in {manifest['qdq_seconds']} s")


# ---------------------------------------------------------------------------------------------
# What each backend runs


def for_onnxruntime(cfg, graph_dir: Path, exported: Path, progress: Progress = print, session_factory=None) -> Path:
    """The folder ONNX Runtime runs for a Q/DQ graphs.weights: the Q/DQ copy of graph_dir (exported or
    fused), calibrated on the static export `exported` (session_factory: the runtime's ONNX Runtime
    sessions); for nvfp4 and fp8 its decoded twin (qdq_decode.py)."""
    from spec_edge.graphs import qdq_decode

    folder = ensure_qdq(cfg, graph_dir, exported, progress, session_factory)
    check_profile(cfg, json.loads((folder / "manifest.json").read_text()), folder,
                  f"spec-edge export --weights {cfg.graphs.weights}")
    # nvfp4: no FLOAT4E2M1 kernel in ONNX Runtime; fp8: its weight DQ runs unfused on every call (~2 s a
    # step here). Both run the decoded twin: the same weight values, the activation Q/DQ kept.
    return qdq_decode.ensure_decoded(folder, progress) if cfg.graphs.weights in ("nvfp4", "fp8") else folder


def for_tensorrt(cfg, exported: Path, progress: Progress = print) -> Path:
    """The Q/DQ ONNX TensorRT builds from for a Q/DQ graphs.weights (written without a GPU). int4_awq
    and fp8 calibrate on a static float32 export of the target made beside it (<role>_calibration/)."""
    from spec_edge.graphs import export

    calib_dir = exported
    if cfg.graphs.weights in ("int4_awq", "fp8"):
        calib_cfg = cfg.replace(**{"graphs.dtype": "float32", "runtime.backend": "onnxruntime",
                                   "graphs.ort_attention": "graph", "graphs.weights": "fp32"})
        target = export.artifact_dir(cfg, "target")
        calib_dir = export.export_model(calib_cfg, "target", target.parent / f"{target.name}_calibration", progress)
    return ensure_qdq(cfg, exported, calib_dir, progress)
