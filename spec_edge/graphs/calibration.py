"""Calibration for the Q/DQ forms (graphs/qdq.py): the activations every linear layer of the target
sees on the user's own prompts, measured by ONNX Runtime on the fp32 export.

graphs.calibration names a prompt file in the format `spec-edge tune` and `bench` read (.jsonl with
a "prompt" per line, or plain text, one prompt per line; blank and # lines skipped); "" is the
shipped set bench/calibration.jsonl (kept apart from bench/prompts.jsonl, the held-out prompts of
the accuracy table). Each prompt is tokenized as text and run through the fp32 prefill graph chunk
by chunk (the cache carried between chunks, padding rows dropped); for the input x (T, K) of every
linear weight the pass keeps

    amax       max |x|                      fp8's static activation scale (amax / 448)
    mean_abs   (K,) mean |x| per channel     AWQ's activation statistic
    rows       (<= MAX_ROWS, K) rows of x    AWQ's search scores each alpha on them

The set's hash (sha256 of the prompt texts) goes into the quantized folder's manifest.
"""
from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError
from spec_edge.graphs import io_names

DEFAULT_SET = Path(__file__).resolve().parents[2] / "bench" / "calibration.jsonl"
MAX_ROWS = 512      # rows of x kept per linear input for the AWQ search
MAX_TOKENS = 256    # tokens of one prompt calibrated (the rest is cut)


@dataclass
class Stats:
    amax: float = 0.0
    abs_sum: np.ndarray | None = None  # (K,)
    count: int = 0
    rows: list = field(default_factory=list)

    def add(self, x: np.ndarray) -> None:  # x (T, K)
        self.amax = max(self.amax, float(np.abs(x).max()))
        total = np.abs(x).astype(np.float64).sum(axis=0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += x.shape[0]
        kept = sum(r.shape[0] for r in self.rows)
        if kept < MAX_ROWS:
            self.rows.append(np.array(x[:MAX_ROWS - kept], np.float32))

    @property
    def mean_abs(self) -> np.ndarray:
        return (self.abs_sum / max(self.count, 1)).astype(np.float32)

    def sample(self) -> np.ndarray:
        return np.concatenate(self.rows)


@dataclass
class Calibration:
    sha256: str
    n_prompts: int
    n_tokens: int
    source: str
    by_weight: dict[str, Stats]  # linear weight initializer name -> stats of its input

    def describe(self) -> dict:
        return {"calibration_sha256": self.sha256, "calibration_prompts": self.n_prompts,
                "calibration_tokens": self.n_tokens, "calibration_set": self.source}


def read_texts(path: str | Path = "") -> tuple[list[str], str]:
    """(prompts, what they are) from graphs.calibration's prompt file ('' = the shipped set)."""
    path = Path(path) if path else DEFAULT_SET
    if not path.is_file():
        raise ConfigError(f"graphs.calibration: prompt file {path} does not exist")
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if path.suffix == ".jsonl" or line.startswith("{"):
            try:
                prompt = json.loads(line).get("prompt")
            except (json.JSONDecodeError, AttributeError):
                raise ConfigError(f"graphs.calibration: {path}:{number} is not a JSON object with a 'prompt'") from None
        else:
            prompt = line
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"graphs.calibration: {path}:{number} has no prompt text")
        texts.append(prompt)
    if not texts:
        raise ConfigError(f"graphs.calibration: {path} holds no prompts")
    return texts, str(path)


def texts_sha256(texts: list[str]) -> str:
    return hashlib.sha256("\n\0".join(texts).encode("utf-8")).hexdigest()


def linear_inputs(model) -> dict[str, str]:
    """weight initializer name -> its input tensor, for every Gemm(x, W, transB=1) of a graph."""
    inits = {t.name for t in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        trans_b = any(a.name == "transB" and a.i == 1 for a in node.attribute)
        if node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in inits and trans_b:
            found[node.input[1]] = node.input[0]
    return found


def _session(path: str, threads: int):
    """A CPU session with its own threads; on the process's global pool once the runtime made one
    (ONNX Runtime then refuses per-session pools; the runtime passes its own factory instead)."""
    import onnxruntime as ort

    def make(per_session: bool):
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.use_per_session_threads = per_session
        if per_session:
            options.intra_op_num_threads = threads
        return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    try:
        return make(True)
    except RuntimeError as err:
        if "global thread pool" not in str(err):
            raise
        return make(False)


def calibrate(fp32_dir: Path, texts: list[str], source: str, weights: set[str], threads: int = 0,
              session_factory=None) -> Calibration:
    """Run the fp32 prefill graph of an exported target folder on texts; stats for every weight in `weights`.
    session_factory(path) -> InferenceSession, when the caller's process needs its own kind of session."""
    import onnx
    from tokenizers import Tokenizer

    fp32_dir = Path(fp32_dir)
    manifest = json.loads((fp32_dir / "manifest.json").read_text())
    if manifest.get("layout") != "static" or manifest.get("attention") == "fused" or manifest.get("dtype") != "float32":
        raise ConfigError(f"{fp32_dir}: calibration runs the static float32 export (spec-edge export), not this folder")
    stem = next(s for s, spec in manifest["graphs"].items() if spec["kind"] == "prefill")
    chunk = int(manifest["prefill_chunk"])
    model = onnx.load(str(fp32_dir / f"{stem}.onnx"), load_external_data=False)
    wanted = {w: x for w, x in linear_inputs(model).items() if w in weights}
    missing = sorted(weights - set(wanted))
    if missing:
        raise ConfigError(f"{fp32_dir}/{stem}.onnx: no Gemm reads {missing[:3]}: not a spec_edge export of format 2")
    tensors = sorted(set(wanted.values()))
    have_outputs = {o.name for o in model.graph.output}
    for name in tensors:
        if name not in have_outputs:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    # the augmented graph, briefly beside the export's weights.bin (ONNX Runtime reads external data
    # only from the model's own folder); a hidden name no reader of the folder looks at
    with tempfile.NamedTemporaryFile(dir=fp32_dir, prefix=".calibrate-", suffix=".onnx") as tmp:
        onnx.save_model(model, tmp.name)
        del model
        session = (session_factory or (lambda path: _session(path, threads)))(tmp.name)
    tokenizer = Tokenizer.from_file(str(fp32_dir / "tokenizer.json"))
    cfg = json.loads((fp32_dir / "model.json").read_text())
    n_layers, hkv, d = int(cfg["n_layers"]), int(cfg["n_kv_heads"]), int(cfg["head_dim"])
    max_context = int(manifest["max_context"])
    out_names = [io_names.K_NEW, io_names.V_NEW] + tensors
    by_tensor = {name: Stats() for name in tensors}
    n_tokens = 0
    for text in texts:
        ids = tokenizer.encode(text).ids[:min(MAX_TOKENS, max_context)]
        if not ids:
            continue
        n_tokens += len(ids)
        k_cache = np.zeros((n_layers, hkv, max_context, d), np.float32)  # (L, Hkv, S, D)
        v_cache = np.zeros_like(k_cache)
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            n_valid = len(part)
            tokens = np.array([part + [part[-1]] * (chunk - n_valid)], np.int64)  # (1, C)
            feeds = {io_names.TOKENS: tokens, io_names.POSITION: np.array([start], np.int64),
                     io_names.LAST_INDEX: np.array([n_valid - 1], np.int64)}
            for i in range(n_layers):
                feeds[io_names.k_cache(i)], feeds[io_names.v_cache(i)] = k_cache[i], v_cache[i]
            k_new, v_new, *acts = session.run(out_names, feeds)  # k_new (L, Hkv, C, D)
            stop = min(start + n_valid, max_context)
            k_cache[:, :, start:stop] = k_new[:, :, :stop - start]
            v_cache[:, :, start:stop] = v_new[:, :, :stop - start]
            for name, x in zip(tensors, acts):
                by_tensor[name].add(x.reshape(-1, x.shape[-1])[:n_valid])  # (T, K), padding dropped
    if n_tokens == 0:
        raise ConfigError(f"graphs.calibration: {source} tokenizes to no tokens")
    return Calibration(texts_sha256(texts), len(texts), n_tokens, source,
                       {w: by_tensor[x] for w, x in wanted.items()})
