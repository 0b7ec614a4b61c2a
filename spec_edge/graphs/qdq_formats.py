"""The numbers of the Q/DQ weight forms (graphs.weights int4_awq | int4_gguf | fp8 | nvfp4), in numpy.

Every form is what one TensorRT DequantizeLinear reads: codes in the ONNX low-precision type and
the scales that multiply them. The numbers here are in the HF layout W: (N, K), blocks along K;
graphs/qdq.py stores them transposed, (K, N), for the MatMul that replaces the exported Gemm:

    y = MatMul(x * pre, DQ(codes.T, scale.T))  [+ BlockSum32(x) @ mins]

  int4_awq   codes INT4 (N, K) in [-8, 7], symmetric, scale (N, K/B) = block amax / 7 along K
             (block B = graphs.int4_block); pre = 1 / s, the AWQ per-input-channel scale searched on
             the calibration activations (W * s is what is rounded, so (x / s) @ (W * s).T = x @ W.T)
  int4_gguf  the GGUF's own Q4_1 blocks (w = d q + m, q in [0, 15], blocks of 32): codes q - 8 as
             INT4 with scale d and no zero point, so DQ gives d (q - 8); the rest, m + 8 d per block,
             is the per-block offset `mins`, added through BlockSum32(x) @ mins (graphs/quantize.py's
             regrouping). DequantizeLinear cannot hold Q4_1 itself: its zero point has the codes'
             integer type and -m / d is not an integer; TensorRT takes only zero-point-free DQ.
             m + 8 d is computed once in float64 and refused unless exact in float32
  fp8        codes FLOAT8E4M3FN (N, K), per-output-channel scale (N,) (DQ axis 0) = amax / 448; the activation
             is also Q/DQ'd per tensor with a static scale (calibration amax / 448)
  nvfp4      codes FLOAT4E2M1 (N, K) in blocks of 16 along K; block scales FLOAT8E4M3FN (N, K/16),
             themselves dequantized by one float32 global scale (amax / (6 * 448)): the double DQ
             TensorRT's NVFP4 weights use

`dequantize()` is the exact float32 W each form stands for (what the tests and the accuracy table
compare against). Rounding is round-to-nearest-even everywhere (ml_dtypes casts for the float types).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT4_MAX = 7.0
FP8_MAX = 448.0
FP4_MAX = 6.0
NVFP4_BLOCK = 16
Q4_1_BLOCK = 32
AWQ_ALPHAS = tuple(i / 10 for i in range(11))  # AWQ-lite grid: s = act_mean ** alpha


class QdqError(RuntimeError):
    """A weight or graph that cannot be given the asked Q/DQ form; the message says why."""


@dataclass(frozen=True)
class QuantWeight:
    kind: str                 # int4 | fp8 | nvfp4
    codes: np.ndarray         # (N, K) in the ONNX type's numpy dtype (ml_dtypes int4 / float8_e4m3fn / float4_e2m1fn)
    scale: np.ndarray         # int4: (N, K/B) f32; fp8: (N,) f32; nvfp4: (N, K/16) float8_e4m3fn
    block: int = 0            # block size along K (0: one scale per output channel)
    global_scale: float = 1.0  # nvfp4: multiplies the block scales
    pre: np.ndarray | None = None   # (K,) f32 AWQ: x is multiplied by this before the Gemm
    mins: np.ndarray | None = None  # (K/32, N) f32 int4_gguf: per-block offset through BlockSum32(x) @ mins

    def scale_f32(self) -> np.ndarray:
        if self.kind == "nvfp4":
            return self.scale.astype(np.float32) * np.float32(self.global_scale)
        return self.scale

    def dequantize(self) -> np.ndarray:
        """(N, K) float32: what the DQ node outputs (the rounded W * s)."""
        codes = self.codes.astype(np.float32)
        scale = self.scale_f32()
        n, k = codes.shape
        if self.block:
            return (codes.reshape(n, k // self.block, self.block) * scale[:, :, None]).reshape(n, k)
        return codes * scale[:, None]

    def effective(self) -> np.ndarray:
        """(N, K) float32 with pre and mins folded in: x @ effective().T is the layer (up to summation order)."""
        w = self.dequantize()
        if self.pre is not None:
            w = w * self.pre[None, :]
        if self.mins is not None:
            w = w + np.repeat(self.mins.T, Q4_1_BLOCK, axis=1)
        return w

    @property
    def nbytes(self) -> int:
        """Bytes of the stored form (4-bit codes count half a byte)."""
        bits = 4 if self.kind in ("int4", "nvfp4") else 8
        total = self.codes.size * bits // 8 + self.scale.nbytes + (4 if self.kind == "nvfp4" else 0)
        return total + sum(a.nbytes for a in (self.pre, self.mins) if a is not None)


# ---------------------------------------------------------------------------------------------
# INT4


def int4_rtn(w: np.ndarray, block: int) -> QuantWeight:
    """Round W (N, K) to symmetric INT4 blocks of `block` along K (scale = block amax / 7)."""
    import ml_dtypes

    n, k = w.shape
    if k % block:
        raise QdqError(f"K={k} is not a multiple of the INT4 block {block}; set graphs.int4_block to a divisor of {k}")
    blocks = np.asarray(w, np.float32).reshape(n, k // block, block)
    scale = (np.abs(blocks).max(axis=2) / INT4_MAX).astype(np.float32)  # (N, K/B)
    safe = np.where(scale == 0, 1, scale)
    codes = np.clip(np.rint(blocks / safe[:, :, None]), -8, 7).reshape(n, k)
    return QuantWeight("int4", codes.astype(ml_dtypes.int4), scale, block=block)


def int4_awq(w: np.ndarray, act_mean: np.ndarray, x: np.ndarray, block: int) -> tuple[QuantWeight, float]:
    """AWQ-lite: s = act_mean ** alpha (normalised), alpha from AWQ_ALPHAS minimising the output error on
    the calibration rows x (R, K); returns the form (pre = 1 / s; none for alpha 0) and the chosen alpha.
    w: (N, K) HF layout; act_mean: (K,) mean |x| per input channel."""
    w = np.asarray(w, np.float32)
    x = np.asarray(x, np.float32)
    reference = x @ w.T  # (R, N)
    mean = np.maximum(act_mean.astype(np.float64), 1e-8)
    best = None
    for alpha in AWQ_ALPHAS:
        s = mean ** alpha
        s = (s / np.sqrt(s.max() * s.min())).astype(np.float32)  # (K,)
        q = int4_rtn(w * s[None, :], block)
        pre = (1.0 / s).astype(np.float32) if alpha else None
        err = float(np.mean(((x if pre is None else x * pre) @ q.dequantize().T - reference) ** 2))
        if best is None or err < best[0]:
            best = (err, alpha, QuantWeight("int4", q.codes, q.scale, block=block, pre=pre))
    return best[2], best[1]


def int4_from_q4_1(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> QuantWeight:
    """Q4_1 blocks (codes (N, K) in [0, 15], d and m (N, K/32), HF row order) -> INT4 DQ + mins.
    No second rounding: d (q - 8) + (m + 8 d) == d q + m for every weight."""
    import ml_dtypes

    offset64 = m.astype(np.float64) + 8.0 * d.astype(np.float64)
    offset = offset64.astype(np.float32)
    if not np.array_equal(offset.astype(np.float64), offset64):
        bad = int(np.sum(offset.astype(np.float64) != offset64))
        raise QdqError(f"{bad} Q4_1 blocks have a minimum + 8 * scale that float32 cannot hold exactly; "
                       f"use graphs.weights int4_awq for this model")
    signed = codes.astype(np.int16) - 8  # (N, K) in [-8, 7]
    return QuantWeight("int4", signed.astype(ml_dtypes.int4), d.astype(np.float32), block=Q4_1_BLOCK,
                       mins=np.ascontiguousarray(offset.T))


# ---------------------------------------------------------------------------------------------
# FP8 and NVFP4


def fp8_weight(w: np.ndarray) -> QuantWeight:
    """W (N, K) -> FLOAT8E4M3FN W with one scale per output channel (amax / 448)."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    scale = (np.abs(w).max(axis=1) / FP8_MAX).astype(np.float32)  # (N,)
    safe = np.where(scale == 0, 1, scale)
    return QuantWeight("fp8", (w / safe[:, None]).astype(ml_dtypes.float8_e4m3fn), scale)


def fp8_activation_scale(amax: float) -> float:
    """The static per-tensor scale of an activation whose calibration amax is `amax`."""
    return float(np.float32(max(amax, 1e-8) / FP8_MAX))


def fp8_round(x: np.ndarray, scale: float) -> np.ndarray:
    """What QuantizeLinear -> DequantizeLinear (FLOAT8E4M3FN, saturating) makes of x."""
    import ml_dtypes

    q = np.clip(x / np.float32(scale), -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float32) * np.float32(scale)


def nvfp4_weight(w: np.ndarray) -> QuantWeight:
    """W (N, K) -> FLOAT4E2M1 in blocks of 16 along K, FP8 block scales, one fp32 global scale."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    n, k = w.shape
    if k % NVFP4_BLOCK:
        raise QdqError(f"K={k} is not a multiple of NVFP4's block of {NVFP4_BLOCK}")
    amax = float(np.abs(w).max())
    global_scale = float(np.float32(max(amax, 1e-12) / (FP4_MAX * FP8_MAX)))
    blocks = w.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_scale = np.abs(blocks).max(axis=2) / FP4_MAX / global_scale  # (N, K/16), <= 448
    scale8 = np.minimum(block_scale, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    effective = scale8.astype(np.float32) * np.float32(global_scale)
    safe = np.where(effective == 0, 1, effective)
    codes = np.clip(blocks / safe[:, :, None], -FP4_MAX, FP4_MAX).reshape(n, k).astype(ml_dtypes.float4_e2m1fn)
    return QuantWeight("nvfp4", codes, scale8, block=NVFP4_BLOCK, global_scale=global_scale)
