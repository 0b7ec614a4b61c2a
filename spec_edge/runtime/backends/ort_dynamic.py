"""ONNX Runtime over the dynamic-width graphs TensorRT is given (`spec-edge build --export-only`):
the target's `dynamic.onnx` (+ its layer-skip graph) and the EAGLE-3 head's `eagle3_dynamic.onnx`,
run only at the widths the engines get optimization profiles for. This is how CPUs (CI, this repo's
tests, `scripts/measure_dynamic.py`) check the exact files the TensorRT builder reads.

State, allocated once (the same contract as onnxruntime.py, one session per file):
  target   k_cache, v_cache (L, Hkv, S, D) float32, bound one view per layer; hidden (S, n * H) rows;
           embed_table (V, H): a read-only memory map of weights.bin (manifest "embed_table") when the
           graph takes the table as an input (profiles with a head)
           per width T: tokens (1, T), position (1,), logits (T, V), k_new / v_new (L, Hkv, T, D), hidden (T, n * H)
  head     k_cache, v_cache (1, Hkv, S, D); per ingest width W and for the draft step: tokens (1, W),
           hidden (W, 3Ht), hidden_draft (W, H), position, last_index, logits (1, Vd), draft_token (1,),
           k_new / v_new (1, Hkv, W, D), hidden_out (1, H)
float32 graphs only (numpy has no bfloat16): export with graphs.dtype float32 to run them here.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from spec_edge.graphs import export, io_names, shared_table
from spec_edge.heads.eagle3_export import DYNAMIC_HEAD_STEM, read_head_config
from spec_edge.runtime.backends.base import BackendError, Runner
from spec_edge.runtime.backends.onnxruntime import cpu_session


def _manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise BackendError(f"{folder} holds no export (manifest.json missing): run `spec-edge build PROFILE "
                           f"--export-only`")
    manifest = json.loads(path.read_text())
    if manifest.get("dtype") != "float32":
        raise BackendError(f"{folder} was exported in {manifest.get('dtype')}: ONNX Runtime runs the float32 "
                           f"dynamic graphs only (set graphs.dtype: float32 to check them here)")
    return manifest


def _session(path: Path, threads: int):
    if not path.is_file():
        raise BackendError(f"graph file {path} is missing: run `spec-edge build PROFILE --export-only`")
    try:
        return cpu_session(str(path), threads)
    except Exception as err:  # onnxruntime raises several unrelated types for a bad file
        raise BackendError(f"ONNX Runtime cannot load {path}: {err}") from err


def _bind(session, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]):
    import onnxruntime as ort

    binding = session.io_binding()
    for name, array in inputs.items():
        if isinstance(array, np.memmap) or not array.flags.writeable:
            binding.bind_cpu_input(name, array)  # by pointer: a memory map stays a memory map
        else:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    for name, array in outputs.items():
        binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
    return binding


def shared_embed_table(graph_dir: Path) -> np.ndarray:
    """The (V, H) float32 table of an export whose graphs take embed_table, as a read-only memory map."""
    record = shared_table.record(graph_dir)
    if record is None:
        raise BackendError(f"{graph_dir}: the export records no shared embedding table (manifest "
                           f"'{shared_table.KEY}'): export it with a head configured")
    if record["dtype"] != "float32":
        raise BackendError(f"{graph_dir}: the shared embedding table is {record['dtype']}; ONNX Runtime reads float32")
    return np.memmap(Path(graph_dir) / record["file"], dtype=np.float32, mode="r", offset=int(record["offset"]),
                     shape=tuple(record["shape"]))


class OrtDynamicRunner(Runner):
    """A Runner over a dynamic-width target export at `widths` (1 and each k+1) + prefill chunks of C."""

    def __init__(self, graph_dir: str | Path, widths: Iterable[int], threads: int = 0, *,
                 _shared_from: "OrtDynamicRunner | None" = None, _n_layers: int | None = None):
        self.graph_dir = Path(graph_dir)
        self.manifest = _manifest(self.graph_dir)
        if self.manifest.get("layout") != "shared":
            raise BackendError(f"{self.graph_dir} holds static graphs: OrtDynamicRunner runs dynamic-width exports")
        self.model_cfg = cfg = export.read_model_config(self.graph_dir)
        self.max_context = int(self.manifest["max_context"])
        self.prefill_chunk = int(self.manifest["prefill_chunk"])
        self.vocab_size = cfg.vocab_size
        self.threads = threads
        kind = "dynamic" if _shared_from is None else "layerskip"
        stems = [s for s, spec in self.manifest["graphs"].items() if spec["kind"] == kind
                 and (_n_layers is None or spec.get("n_layers") == _n_layers)]
        if not stems:
            raise BackendError(f"{self.graph_dir}: no {kind} graph" + (f" of {_n_layers} layers" if _n_layers else ""))
        self.spec = self.manifest["graphs"][stems[0]]
        if _shared_from is None:
            self.n_layers = cfg.n_layers
            shape = (cfg.n_layers, cfg.n_kv_heads, self.max_context, cfg.head_dim)  # (L, Hkv, S, D)
            self.k_cache, self.v_cache = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        else:  # layer-skip: views of the target's first n layers
            self.n_layers = _n_layers
            self.k_cache, self.v_cache = _shared_from.k_cache[:_n_layers], _shared_from.v_cache[:_n_layers]
        n_hidden = len(self.spec.get("hidden_layers", ())) * cfg.hidden_size
        self.hidden = np.zeros((self.max_context, n_hidden), np.float32) if n_hidden else None  # (S, n * H)
        self.embed_table = shared_embed_table(self.graph_dir) if self.spec.get("embed_input") else None
        self.session = _session(self.graph_dir / f"{stems[0]}.onnx", threads)
        self.widths = frozenset(widths)
        self._calls = {w: self._make_call(w) for w in sorted(self.widths | {self.prefill_chunk})}

    def _make_call(self, width: int) -> dict:
        cfg = self.model_cfg
        call = {"width": width, io_names.TOKENS: np.zeros((1, width), np.int64),
                io_names.POSITION: np.zeros((1,), np.int64),
                io_names.LOGITS: np.zeros((width, cfg.vocab_size), np.float32),
                io_names.K_NEW: np.zeros((self.n_layers, cfg.n_kv_heads, width, cfg.head_dim), np.float32),
                io_names.V_NEW: np.zeros((self.n_layers, cfg.n_kv_heads, width, cfg.head_dim), np.float32)}
        inputs = {io_names.TOKENS: call[io_names.TOKENS], io_names.POSITION: call[io_names.POSITION]}
        for layer in range(self.n_layers):
            inputs[io_names.k_cache(layer)] = self.k_cache[layer]
            inputs[io_names.v_cache(layer)] = self.v_cache[layer]
        if self.embed_table is not None:
            inputs[io_names.EMBED_TABLE] = self.embed_table
        outputs = {n: call[n] for n in (io_names.LOGITS, io_names.K_NEW, io_names.V_NEW)}
        if self.hidden is not None:
            call[io_names.HIDDEN] = outputs[io_names.HIDDEN] = np.zeros((width, self.hidden.shape[1]), np.float32)
        call["binding"] = _bind(self.session, inputs, outputs)
        return call

    def _run(self, width: int, token_ids: Sequence[int], position: int, n_valid: int) -> dict:
        call = self._calls[width]
        call[io_names.TOKENS][0, :len(token_ids)] = token_ids
        call[io_names.TOKENS][0, len(token_ids):] = token_ids[-1]  # a short prefill chunk: padding at the end
        call[io_names.POSITION][0] = position
        self.session.run_with_iobinding(call["binding"])
        self.k_cache[:, :, position:position + n_valid] = call[io_names.K_NEW][:, :, :n_valid]
        self.v_cache[:, :, position:position + n_valid] = call[io_names.V_NEW][:, :, :n_valid]
        if self.hidden is not None:
            self.hidden[position:position + n_valid] = call[io_names.HIDDEN][:n_valid]
        return call

    def forward(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        width = len(token_ids)
        self.check_width(width)
        self.check_room(position, width)
        return self._run(width, token_ids, position, width)[io_names.LOGITS]

    def prefill(self, token_ids: Sequence[int], position: int) -> np.ndarray:
        n_tokens, chunk = len(token_ids), self.prefill_chunk
        if n_tokens == 0:
            raise BackendError("prefill needs at least one token")
        self.check_room(position, n_tokens)
        for start in range(0, n_tokens, chunk):  # padding rows past S are never written to the cache
            part = list(token_ids[start:start + chunk])
            call = self._run(chunk, part, position + start, len(part))
        return call[io_names.LOGITS][len(part) - 1]  # the dynamic graph returns every row: take the last real one

    def hidden_states(self, start: int, stop: int) -> np.ndarray:
        if self.hidden is None:
            raise BackendError(f"{self.graph_dir}: the dynamic graph returns no hidden states (no head configured)")
        return self.hidden[start:stop]

    def layer_skip(self, n_layers: int) -> "OrtDynamicRunner":
        return OrtDynamicRunner(self.graph_dir, self.widths & {1}, self.threads, _shared_from=self, _n_layers=n_layers)


class OrtDynamicHead:
    """The EAGLE-3 head's dynamic graph at its ingest widths and the draft step: OrtEagle3Head's interface
    (ingest, step, draft_ids, cfg, max_context), so drafters/eagle3.py and hybrid.py run it unchanged.
    draft_token: the graph's own d2t[argmax] of the latest call (what the TensorRT engine sends the host)."""
    held: tuple[int, ...] = ()  # ids whose pairs rows 0..len-2 hold validly (drafters/head.py: CachedHeadDrafter)

    def __init__(self, head_dir: str | Path, embed_table: np.ndarray, threads: int = 0):
        self.head_dir = Path(head_dir)
        self.manifest = _manifest(self.head_dir)
        self.cfg = c = read_head_config(self.head_dir)
        self.draft_ids = np.load(self.head_dir / "draft_ids.npy")  # (Vd,) draft id -> target id
        if tuple(embed_table.shape) != (c.target_vocab_size, c.hidden_size):
            raise BackendError(f"embedding table {tuple(embed_table.shape)} does not fit the head "
                               f"({c.target_vocab_size}, {c.hidden_size})")
        self.embed_table = embed_table
        self.max_context = int(self.manifest["max_context"])
        shape = (1, c.n_kv_heads, self.max_context, c.head_dim)  # (1, Hkv, S, D)
        self.k_cache, self.v_cache = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        self.session = _session(self.head_dir / f"{DYNAMIC_HEAD_STEM}.onnx", threads)
        self.ingest_widths = sorted(self.manifest["widths"])
        self._ingest = {w: self._make_call(w) for w in self.ingest_widths}
        self._step = self._make_call(1)  # its own buffers, as its own TensorRT profile and context
        self.draft_token = self._step[io_names.DRAFT_TOKEN]

    def _make_call(self, width: int) -> dict:
        c = self.cfg
        call = {io_names.TOKENS: np.zeros((1, width), np.int64),
                io_names.HIDDEN: np.zeros((width, 3 * c.target_hidden_size), np.float32),
                io_names.HIDDEN_DRAFT: np.zeros((width, c.hidden_size), np.float32),
                io_names.POSITION: np.zeros((1,), np.int64), io_names.LAST_INDEX: np.zeros((1,), np.int64),
                io_names.LOGITS: np.zeros((1, c.draft_vocab_size), np.float32),
                io_names.DRAFT_TOKEN: np.zeros((1,), np.int64),
                io_names.K_NEW: np.zeros((1, c.n_kv_heads, width, c.head_dim), np.float32),
                io_names.V_NEW: np.zeros((1, c.n_kv_heads, width, c.head_dim), np.float32),
                io_names.HIDDEN_OUT: np.zeros((1, c.hidden_size), np.float32)}
        inputs = {n: call[n] for n in (io_names.TOKENS, io_names.HIDDEN, io_names.HIDDEN_DRAFT, io_names.POSITION,
                                       io_names.LAST_INDEX)}
        inputs.update({io_names.K_CACHE: self.k_cache, io_names.V_CACHE: self.v_cache,
                       io_names.EMBED_TABLE: self.embed_table})
        outputs = {n: call[n] for n in (io_names.LOGITS, io_names.DRAFT_TOKEN, io_names.K_NEW, io_names.V_NEW,
                                        io_names.HIDDEN_OUT)}
        call["binding"] = _bind(self.session, inputs, outputs)
        return call

    def _run(self, call: dict, position: int, n_valid: int) -> tuple[np.ndarray, np.ndarray]:
        if position < 0 or position + n_valid > self.max_context:
            raise BackendError(f"head positions [{position}, {position + n_valid}) do not fit its "
                               f"{self.max_context}-row cache")
        call[io_names.POSITION][0] = position
        call[io_names.LAST_INDEX][0] = n_valid - 1
        self.session.run_with_iobinding(call["binding"])
        self.k_cache[:, :, position:position + n_valid] = call[io_names.K_NEW][:, :, :n_valid]
        self.v_cache[:, :, position:position + n_valid] = call[io_names.V_NEW][:, :, :n_valid]
        self.draft_token = call[io_names.DRAFT_TOKEN]
        return call[io_names.LOGITS][0], call[io_names.HIDDEN_OUT]

    def ingest(self, tokens: Sequence[int], hidden: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """Pairs (target hidden at position + i, tokens[i]); chunks by the widest ingest width (the prefill
        chunk), each chunk at the narrowest width that holds it, padded at the end."""
        n = len(tokens)
        if n == 0:
            raise BackendError("ingest needs at least one pair")
        start, result = 0, None
        while start < n:
            left = n - start
            width = next((w for w in self.ingest_widths if w >= left), self.ingest_widths[-1])
            take = min(left, width)
            call = self._ingest[width]
            call[io_names.TOKENS][0, :take] = tokens[start:start + take]
            call[io_names.TOKENS][0, take:] = 0
            call[io_names.HIDDEN][:take] = hidden[start:start + take]
            call[io_names.HIDDEN][take:] = 0.0
            result = self._run(call, position + start, take)
            start += take
        return result

    def step(self, token: int, hidden: np.ndarray, position: int) -> tuple[np.ndarray, np.ndarray]:
        """One draft step from the head's own hidden (1, H): fed as hidden_draft, the target hidden stays 0."""
        call = self._step
        call[io_names.TOKENS][0, 0] = token
        call[io_names.HIDDEN_DRAFT][:] = hidden
        return self._run(call, position, 1)
