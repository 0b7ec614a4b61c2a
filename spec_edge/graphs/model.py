"""The static Llama-family forward, written for export.

    forward(tokens (1, T), position (1,), k_cache (L, Hkv, S, D), v_cache) -> logits, k_new, v_new

One module serves every graph shape: prefill chunk T=C, verify T=k+1, step T=1. The cache is
read, never written, inside the graph: attention scores over the full cache and over the new
tokens are joined (a static (S + T) axis) and a mask hides cache rows >= position. The caller writes k_new / v_new
into its resident cache at [position, position + n_valid). No shape depends on a value, so every
tensor of the exported graph is static.

Parameter names follow Hugging Face (model.layers.0.self_attn.q_proj.weight ...) so a checkpoint's
state dict loads as it is, and graphs that share layers share initializer names.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from spec_edge.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        # x / sqrt(...) rather than x * rsqrt(...): the form ONNX Runtime fuses into one
        # SimplifiedLayerNormalization (6 ops -> 1; docs/bench.md, "KV-cache layout")
        x32 = x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(D/2,) inverse frequencies, with Llama-3 scaling when the config has it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if cfg.rope_llama3 is not None:
        factor, low_freq_factor, high_freq_factor, old_context = cfg.rope_llama3
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq.float()


def rope_and_mask(inv_freq: torch.Tensor, position: torch.Tensor, seq: int, cache_len: int,
                  mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cos, sin) (T, D) float32 for positions position..position+T-1, and the additive mask
    (T, S + T) float32: cache rows < position, causal among the T new rows, finfo(mask_dtype).min
    elsewhere. Shared by the target graphs and the head graphs (the cache-then-new key order)."""
    positions = position + torch.arange(seq, dtype=torch.int64)  # (T,)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cache_ok = (torch.arange(cache_len, dtype=torch.int64) < position).expand(seq, cache_len)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    allowed = torch.cat((cache_ok, causal), dim=1)  # (T, S + T)
    return emb.cos(), emb.sin(), torch.where(allowed, 0.0, torch.finfo(mask_dtype).min)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, k_cache, v_cache, mask):
        # x (T, hidden); cos/sin (T, D); k_cache/v_cache (Hkv, S, D); mask (T, S + T) additive
        seq = x.shape[0]
        q = self.q_proj(x).view(seq, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(seq, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.transpose(0, 1)  # (H, T, D)
        k = k.transpose(0, 1)  # (Hkv, T, D)
        v = v.transpose(0, 1)  # (Hkv, T, D)
        q = q * cos + rotate_half(q) * sin
        k_new = k * cos + rotate_half(k) * sin
        v_new = v
        # attention in two parts, cache rows and new rows, so the cache is never concatenated with
        # the new keys/values (that would copy the whole cache on every call): only the scores are
        # joined, and P @ V = P_cache @ V_cache + P_new @ V_new
        group = self.n_heads // self.n_kv_heads
        q = q.reshape(self.n_kv_heads, group * seq, self.head_dim) * (1.0 / math.sqrt(self.head_dim))
        s_cache = torch.matmul(q, k_cache.transpose(1, 2))  # (Hkv, G*T, S)
        s_new = torch.matmul(q, k_new.transpose(1, 2))      # (Hkv, G*T, T)
        scores = torch.cat((s_cache, s_new), -1).view(self.n_kv_heads, group, seq, -1) + mask  # (Hkv, G, T, S + T)
        probs = torch.softmax(scores.float(), dim=-1).to(v_new.dtype).view(self.n_kv_heads, group * seq, -1)
        cache_len = k_cache.shape[1]
        out = torch.matmul(probs[..., :cache_len], v_cache) + torch.matmul(probs[..., cache_len:], v_new)
        out = out.view(self.n_heads, seq, self.head_dim).transpose(0, 1).reshape(seq, -1)  # (T, H*D)
        return self.o_proj(out), k_new, v_new


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, mask):
        attn, k_new, v_new = self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, mask)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k_new, v_new


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, n_layers: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The whole model, or (n_layers < cfg.n_layers) its first layers + final norm + head: the
    layer-skip self-draft, whose parameters and cache layers are the target's own."""

    def __init__(self, cfg: ModelConfig, n_layers: int | None = None, hidden_layers: tuple[int, ...] = ()):
        super().__init__()
        self.cfg = cfg
        self.n_layers = cfg.n_layers if n_layers is None else n_layers
        self.model = Decoder(cfg, self.n_layers)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hidden_layers = hidden_layers  # layers whose outputs are also returned (L = after the final norm)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.matmul(h, weight.t()).float()

    def forward(self, tokens, position, k_cache, v_cache, last_index=None, image_rows=None, image_mask=None):
        # tokens (1, T) int64; position (1,) int64; last_index (1,) int64
        # k_cache/v_cache: (L, Hkv, S, D), or a sequence of L (Hkv, S, D) layers (the exported graphs)
        # image_rows (T, hidden), image_mask (T,) bool: a vision model's image rows replace those tokens' embeddings
        seq = tokens.shape[1]
        cache_len = k_cache[0].shape[1]
        x = self.model.embed_tokens(tokens[0])  # (T, hidden)
        if image_rows is not None:
            x = torch.where(image_mask[:, None], image_rows.to(x.dtype), x)
        cos, sin, mask = rope_and_mask(self.inv_freq, position, seq, cache_len, x.dtype)
        cos, sin, mask = cos.to(x.dtype), sin.to(x.dtype), mask.to(x.dtype)  # (T, D), (T, D), (T, S + T)
        k_news, v_news, hiddens = [], [], []
        for i, layer in enumerate(self.model.layers):
            x, k_new, v_new = layer(x, cos, sin, k_cache[i], v_cache[i], mask)
            k_news.append(k_new)
            v_news.append(v_new)
            if i in self.hidden_layers:
                hiddens.append(x)
        if self.n_layers in self.hidden_layers:  # index L: the final-norm state lm_head reads (Medusa)
            hiddens.append(self.model.norm(x))
        if last_index is not None:
            x = torch.index_select(x, 0, last_index)  # (1, hidden)
        logits = self.head(x)  # (T or 1, V)
        outputs = (logits, torch.stack(k_news), torch.stack(v_news))  # k/v_new (L, Hkv, T, D)
        if self.hidden_layers:
            outputs = outputs + (torch.cat(hiddens, dim=-1),)  # (T, n_hidden * hidden)
        return outputs


class LayerCaches(Transformer):
    """The exported form of a Transformer: forward(tokens, position, [last_index], k_cache_0 ..
    k_cache_{L-1}, v_cache_0 .. v_cache_{L-1}), one (Hkv, S, D) input per layer (io_names.py), so the
    caller binds views of its (L, Hkv, S, D) cache and no graph slices it (a copy per call). A
    subclass, not a wrapper, so parameter (= initializer) names stay Hugging Face's."""

    prefill = False  # True: last_index follows position (the prefill graphs)
    images = False   # True: image_rows and image_mask follow last_index (a vision model's prefill_image graph)

    def forward(self, tokens, position, *rest):
        last_index, caches = (rest[0], rest[1:]) if self.prefill else (None, rest)
        image_rows, image_mask = (caches[0], caches[1]) if self.images else (None, None)
        caches = caches[2:] if self.images else caches
        n_layers = len(caches) // 2
        return super().forward(tokens, position, caches[:n_layers], caches[n_layers:], last_index, image_rows,
                               image_mask)


def empty_cache(cfg: ModelConfig, max_context: int, n_layers: int | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (cfg.n_layers if n_layers is None else n_layers, cfg.n_kv_heads, max_context, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)  # (L, Hkv, S, D) each


def build(cfg: ModelConfig, state_dict: dict[str, torch.Tensor], n_layers: int | None = None,
          dtype: torch.dtype = torch.float32, hidden_layers: tuple[int, ...] = (),
          cls: type[Transformer] = Transformer) -> Transformer:
    """A Transformer (or LayerCaches) in eval mode with the checkpoint's weights (only the layers it has)."""
    model = cls(cfg, n_layers, hidden_layers)
    wanted = model.state_dict()
    missing = [name for name in wanted if name not in state_dict]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    model.load_state_dict({name: state_dict[name] for name in wanted})
    return model.to(dtype).eval()
