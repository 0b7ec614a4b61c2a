"""llama.cpp's weight blocks in numpy: Q4_1 (w = d * q + m per 32 weights, 4-bit q) and Q8_0
(w = d * q, int8 q), read from a GGUF file, made from fp32 (the head's 8-bit copy), packed for
MatMulNBits, and matched row by row to the fp32 weights an export holds (graphs/quantize.py uses
them to carry the GGUF's own bits into the ONNX graphs)."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

QK = 32                  # weights per block (Q4_1, Q8_0, and our MatMulNBits block_size)
Q4_1_BYTES = 20          # fp16 d, fp16 m, 16 bytes of 4-bit codes
Q8_0_BYTES = 34          # fp16 d, 32 int8 codes


class QuantizeError(RuntimeError):
    """The graphs cannot be given 4-bit weights; the message says why."""


# ---------------------------------------------------------------------------------------------
# Block formats (pure numpy; GGUF layout: rows = output features N, blocks along K)


@dataclass(frozen=True)
class Q41:
    codes: np.ndarray   # (N, K) uint8 in [0, 15]
    d: np.ndarray       # (N, K/32) float32 (exactly the fp16 value)
    m: np.ndarray       # (N, K/32) float32

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        blocks = self.codes.reshape(n, k // QK, QK).astype(np.float32)
        return (blocks * self.d[..., None] + self.m[..., None]).reshape(n, k)


@dataclass(frozen=True)
class Q80:
    codes: np.ndarray   # (N, K) int8
    d: np.ndarray       # (N, K/32) float32

    def dequantize(self) -> np.ndarray:
        n, k = self.codes.shape
        return (self.codes.reshape(n, k // QK, QK).astype(np.float32) * self.d[..., None]).reshape(n, k)


def parse_q4_1(raw: np.ndarray) -> Q41:
    """(N, K/32 * 20) uint8 GGUF rows -> codes, d, m. Within a block, byte j holds weight j in its low
    nibble and weight j + 16 in its high nibble."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, Q4_1_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (N, nb, 32): weights 0..15, then 16..31
    return Q41(codes=codes.reshape(n, -1), d=d, m=m)


def parse_q8_0(raw: np.ndarray) -> Q80:
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, Q8_0_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., 2:].copy().view(np.int8)
    return Q80(codes=codes.reshape(n, -1), d=d)


def quantize_q4_1(w: np.ndarray) -> np.ndarray:
    """fp32 (N, K) -> GGUF Q4_1 rows (N, K/32 * 20) uint8, llama.cpp's reference rounding. Only tests
    use it (to make blocks for a tiny model); the runtime path never quantizes."""
    n, k = w.shape
    blocks = w.reshape(n, k // QK, QK).astype(np.float32)
    lo, hi = blocks.min(-1), blocks.max(-1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    inv = np.where(d.astype(np.float32) != 0, 1 / np.where(d == 0, 1, d.astype(np.float32)), 0)
    q = np.clip(np.floor((blocks - m.astype(np.float32)[..., None]) * inv[..., None] + 0.5), 0, 15).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([d[..., None].view(np.uint8).reshape(n, -1, 2), m[..., None].view(np.uint8).reshape(n, -1, 2),
                          qs], axis=-1)
    return out.reshape(n, -1)


def quantize_q8_0(w: np.ndarray) -> Q80:
    """fp32 (N, K) -> Q8_0 blocks, llama.cpp's rounding: per block of 32 along K, d = max|w| / 127
    (fp16), codes round(w / d). Used only for draft heads (graphs.head_weights q8): the target's
    weights are never re-quantized."""
    n, k = w.shape
    blocks = np.asarray(w, np.float32).reshape(n, k // QK, QK)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16).astype(np.float32)  # (N, K/32)
    inv = np.where(d != 0, 1 / np.where(d == 0, 1, d), 0)
    codes = np.clip(np.round(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return Q80(codes=codes.reshape(n, k), d=d)


def pack_nbits_4(codes: np.ndarray) -> np.ndarray:
    """(N, K) codes in [0, 15] -> MatMulNBits B (N, K/32, 16): two codes per byte, low nibble first
    along K."""
    n, k = codes.shape
    pairs = codes.reshape(n, k // QK, QK // 2, 2).astype(np.uint8)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8)


def matmulnbits_q4_1(q: Q41) -> dict[str, np.ndarray]:
    """MatMulNBits inputs for Q4_1: B, scales = d, zero points 0 (packed), and the minima M (K/32, N)
    added through BlockSum32(x) @ M."""
    n, k = q.codes.shape
    nb = k // QK
    return {"B": pack_nbits_4(q.codes), "scales": q.d.copy(),
            "zero_points": np.zeros((n, (nb + 1) // 2), np.uint8),
            "mins": np.ascontiguousarray(q.m.T)}


def matmulnbits_q8_0(q: Q80) -> dict[str, np.ndarray]:
    """8-bit MatMulNBits inputs for Q8_0: codes + 128 as uint8 with zero point 128 (exact)."""
    n, k = q.codes.shape
    codes = (q.codes.astype(np.int16) + 128).astype(np.uint8)
    return {"B": codes.reshape(n, k // QK, QK), "scales": q.d.copy(),
            "zero_points": np.full((n, k // QK), 128, np.uint8)}


# ---------------------------------------------------------------------------------------------
# Matching exported fp32 weights to GGUF blocks


def _row_keys(w: np.ndarray) -> list[bytes]:
    w = np.ascontiguousarray(w, dtype=np.float32)
    return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in w]


def match_rows(exported: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """perm with exported[i] == reference[perm[i]] bit for bit (q/k rows are permuted by the GGUF
    loader); raises QuantizeError when a row has no identical twin."""
    if exported.shape != reference.shape:
        raise QuantizeError(f"shape {exported.shape} vs GGUF {reference.shape}")
    index = {key: i for i, key in enumerate(_row_keys(reference))}
    perm = np.empty(exported.shape[0], np.int64)
    for i, key in enumerate(_row_keys(exported)):
        j = index.get(key)
        if j is None:
            diff = np.abs(reference - exported[i]).max(axis=1).min()
            raise QuantizeError(f"row {i} has no bit-identical GGUF row (closest differs by {diff:.3g}): "
                                f"these weights were not dequantized from this GGUF's blocks")
        perm[i] = j
    return perm


def take_rows(q, perm: np.ndarray):
    if isinstance(q, Q41):
        return Q41(codes=q.codes[perm], d=q.d[perm], m=q.m[perm])
    return Q80(codes=q.codes[perm], d=q.d[perm])


_HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str | None:
    """'model.layers.3.mlp.up_proj.weight' -> 'blk.3.ffn_up.weight'; embeddings -> token_embd."""
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "token_embd.weight" if hf_name == "model.embed_tokens.weight" else "output.weight"
    parts = hf_name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        short = _HF_TO_GGUF.get(".".join(parts[3:5]))
        return f"blk.{parts[2]}.{short}.weight" if short else None
    return None


class GgufBlocks:
    """Q4_1 / Q8_0 tensors of a GGUF file by name, parsed on demand."""

    def __init__(self, path: Path):
        import gguf

        self.path = Path(path)
        reader = gguf.GGUFReader(str(path))
        self._tensors = {t.name: t for t in reader.tensors}
        self._types = {name: t.tensor_type.name for name, t in self._tensors.items()}

    def kind(self, name: str) -> str | None:
        return self._types.get(name)

    def get(self, name: str):
        tensor = self._tensors[name]
        raw = np.asarray(tensor.data)
        if self._types[name] == "Q4_1":
            return parse_q4_1(raw)
        if self._types[name] == "Q8_0":
            return parse_q8_0(raw)
        raise QuantizeError(f"{name} is {self._types[name]}, not Q4_1 or Q8_0")


def blocks_for(gguf_path: Path):
    """(initializer name, exported fp32 (N, K) weight) -> that weight's Q4_1 / Q8_0 blocks in the GGUF,
    rows matched bit for bit (None: the GGUF has no such tensor, the weight stays fp32; a weight
    without an exact match is refused: QuantizeError)."""
    gguf = GgufBlocks(gguf_path)

    def blocks(name: str, weight: np.ndarray):
        gname = gguf_name(name)
        if gname is None or gguf.kind(gname) not in ("Q4_1", "Q8_0"):
            return None
        q = gguf.get(gname)
        return take_rows(q, match_rows(weight, q.dequantize()))
    return blocks
