"""Probe: what the KV-cache layout of the target graphs costs on ONNX Runtime (CPU), side by side.

The graphs take the cache as one (L, Hkv, S, D) tensor and concatenate each layer's cache with the
new keys/values before attention (spec_edge/model.py). On ONNX Runtime both are copies of the whole
cache on every call: the per-layer slice becomes a Split (~2.8 ms/step on the 135M model, S=1024)
and the concatenation a Concat (~1.6 ms). This script exports, from the same weights, the current
layout ("base") and a candidate ("split"): one cache input per layer (the caller binds views of
its resident cache, no copy) and attention in two parts (scores over the cache and over the new
rows, concatenated only as scores; P @ V = P_cache @ V_cache + P_new @ V_new), and with --rms also
RMSNorm written as x / sqrt(mean(x^2) + eps), which ONNX Runtime fuses into
SimplifiedLayerNormalization. It then times step [1, 1] and verify [1, 5] calls of each variant,
interleaved, and prints the medians, their ratios and the largest logit difference.

Not wired into the package: the export contract (io_names, backends, TensorRT profiles) would
change with it. Run:

    .venv/bin/python bench/kv_layout_probe.py [--widths 1 5] [--rounds 40] [--rms] [--out /tmp/kv_probe]
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np


def split_attention(self, x, cos, sin, k_cache, v_cache, mask):
    """model.Attention.forward without concatenating the cache: same inputs, same outputs."""
    import torch

    from spec_edge import model as model_mod

    seq = x.shape[0]
    q = self.q_proj(x).view(seq, self.n_heads, self.head_dim).transpose(0, 1)       # (H, T, D)
    k = self.k_proj(x).view(seq, self.n_kv_heads, self.head_dim).transpose(0, 1)    # (Hkv, T, D)
    v = self.v_proj(x).view(seq, self.n_kv_heads, self.head_dim).transpose(0, 1)    # (Hkv, T, D)
    q = q * cos + model_mod.rotate_half(q) * sin
    k_new = k * cos + model_mod.rotate_half(k) * sin
    group = self.n_heads // self.n_kv_heads
    q = q.reshape(self.n_kv_heads, group * seq, self.head_dim) * (1.0 / math.sqrt(self.head_dim))
    s_cache = torch.matmul(q, k_cache.transpose(1, 2))  # (Hkv, G*T, S)
    s_new = torch.matmul(q, k_new.transpose(1, 2))      # (Hkv, G*T, T)
    scores = torch.cat((s_cache, s_new), -1).view(self.n_kv_heads, group, seq, -1) + mask
    probs = torch.softmax(scores, dim=-1).view(self.n_kv_heads, group * seq, -1)
    cache_len = k_cache.shape[1]
    out = torch.matmul(probs[..., :cache_len], v_cache) + torch.matmul(probs[..., cache_len:], v)
    out = out.view(self.n_heads, seq, self.head_dim).transpose(0, 1).reshape(seq, -1)
    return self.o_proj(out), k_new, v


def rms_div(self, x):
    import torch

    return self.weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def per_layer_module(inner):
    """The Transformer with one cache input per layer: forward(tokens, position, k_0..k_L-1, v_0..v_L-1)."""
    import torch

    from spec_edge import model as model_mod

    class PerLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, tokens, position, *caches):
            t, n_layers = self.inner, len(caches) // 2
            seq, cache_len = tokens.shape[1], caches[0].shape[1]
            x = t.model.embed_tokens(tokens[0])
            cos, sin, mask = model_mod.rope_and_mask(t.inv_freq, position, seq, cache_len, x.dtype)
            k_news, v_news = [], []
            for i, layer in enumerate(t.model.layers):
                x, k_new, v_new = layer(x, cos, sin, caches[i], caches[n_layers + i], mask)
                k_news.append(k_new)
                v_news.append(v_new)
            return t.head(x), torch.stack(k_news), torch.stack(v_news)

    return PerLayer()


def export_variants(out: Path, widths: list[int], max_context: int, rms: bool) -> dict:
    """{(variant, width): onnx path}; each variant's graphs exported from the embedded weights."""
    import torch

    from spec_edge import export, model as model_mod, weights

    cfg, state, _ = weights.load("embedded")
    paths = {}
    base_attention, base_rms = model_mod.Attention.forward, model_mod.RMSNorm.forward
    variants = ["base", "split"] + (["split_rms"] if rms else [])
    for variant in variants:
        model_mod.Attention.forward = base_attention if variant == "base" else split_attention
        model_mod.RMSNorm.forward = rms_div if variant == "split_rms" else base_rms
        try:
            for width in widths:
                path = out / f"{variant}_{width}.onnx"
                paths[(variant, width)] = path
                if path.is_file():
                    continue
                print(f"[probe] exporting {path.name} ...", file=sys.stderr, flush=True)
                module = model_mod.build(cfg, state)
                tokens, position = torch.zeros(1, width, dtype=torch.int64), torch.tensor([0])
                if variant == "base":
                    k_cache, v_cache = model_mod.empty_cache(cfg, max_context)
                    args, inputs = (tokens, position, k_cache, v_cache), ["tokens", "position", "k_cache", "v_cache"]
                else:
                    module = per_layer_module(module)
                    caches = tuple(torch.zeros(cfg.n_kv_heads, max_context, cfg.head_dim)
                                   for _ in range(2 * cfg.n_layers))
                    args = (tokens, position) + caches
                    inputs = (["tokens", "position"] + [f"k_cache_{i}" for i in range(cfg.n_layers)]
                              + [f"v_cache_{i}" for i in range(cfg.n_layers)])
                store = export.WeightStore(out / f"{variant}_{width}.bin")
                export.save_static(module, args, inputs, ["logits", "k_new", "v_new"], path, store)
                store.close()
        finally:
            model_mod.Attention.forward, model_mod.RMSNorm.forward = base_attention, base_rms
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 5])
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--position", type=int, default=300)
    p.add_argument("--rms", action="store_true", help="also the variant with the fusable RMSNorm")
    p.add_argument("--out", default="/tmp/kv_probe")
    args = p.parse_args()
    import onnxruntime as ort

    from spec_edge.backends.onnxruntime import cpu_session

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = export_variants(out, args.widths, args.max_context, args.rms)
    sessions = {}  # (variant, width) -> [session, binding, outputs]
    for (variant, width), path in paths.items():
        session = cpu_session(str(path), 2)
        binding = session.io_binding()
        for name, value in (("tokens", np.arange(100, 100 + width, dtype=np.int64)[None]),
                            ("position", np.array([args.position]))):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(value))
        outputs = {o.name: np.zeros(o.shape, np.float32) for o in session.get_outputs()}
        for name, value in outputs.items():
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(value))
        sessions[(variant, width)] = [session, binding, outputs]
    # every variant reads the same random resident cache: base binds it whole, the others per layer (views)
    cache_shape = tuple(sessions[("base", args.widths[0])][0].get_inputs()[2].shape)  # (L, Hkv, S, D)
    k_cache, v_cache = np.random.default_rng(0).standard_normal((2,) + cache_shape, np.float32)
    for (variant, _), (_, binding, _) in sessions.items():
        if variant == "base":
            binding.bind_ortvalue_input("k_cache", ort.OrtValue.ortvalue_from_numpy(k_cache))
            binding.bind_ortvalue_input("v_cache", ort.OrtValue.ortvalue_from_numpy(v_cache))
            continue
        for i in range(cache_shape[0]):
            binding.bind_ortvalue_input(f"k_cache_{i}", ort.OrtValue.ortvalue_from_numpy(k_cache[i]))
            binding.bind_ortvalue_input(f"v_cache_{i}", ort.OrtValue.ortvalue_from_numpy(v_cache[i]))
    times = {key: [] for key in sessions}
    for key, (session, binding, _) in sessions.items():
        for _ in range(3):
            session.run_with_iobinding(binding)
    for _ in range(args.rounds):  # interleaved, so load drift hits every variant alike
        for key, (session, binding, _) in sessions.items():
            started = time.perf_counter()
            session.run_with_iobinding(binding)
            times[key].append(time.perf_counter() - started)
    print(f"{'variant':12} {'width':>5} {'median ms':>9} {'x base':>7} {'max |dlogits| vs base':>22}")
    for (variant, width), (_, _, outputs) in sessions.items():
        median = 1000 * float(np.median(times[(variant, width)]))
        base = 1000 * float(np.median(times[("base", width)]))
        diff = float(np.abs(outputs["logits"] - sessions[("base", width)][2]["logits"]).max())
        print(f"{variant:12} {width:>5} {median:9.2f} {median / base:7.2f} {diff:22.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
