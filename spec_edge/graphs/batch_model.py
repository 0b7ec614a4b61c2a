"""The static forward with a batch dimension: B slots, one position per slot, one cache region per slot.

    forward(tokens (B, T), position (B,), k_cache_0 .. k_cache_{L-1}, v_cache_0 .. v_cache_{L-1})
        -> logits (B, T, V), k_new (L, B, Hkv, T, D), v_new (L, B, Hkv, T, D)
           [, hidden (B, T, n * H): the layers hidden_layers names, as model.Transformer returns them
              per row (a profile with draft heads: graphs/hidden.py)]

B here is the graph's row count (graphs/batch_export.py exports m = 2, 4, .. up to graphs.batch_slots
rows). k_cache_<i> is (B, Hkv, S, D): row b is one slot's region of the resident cache (after the fused
rewrite, graphs/batch_attention.py, each row's region is an input of its own). Each row is its
own sequence: its rotary positions start at position[b], its mask hides its cache rows
>= position[b], and no slot attends to another's rows, so a row's logits are those of the B=1
graph (model.LayerCaches) over that slot's cache, up to float summation order. The linear layers
run on the (B*T, hidden) rows flattened, so they export as the same Gemm nodes the post-export
passes (ort_attention.py's GroupQueryAttention, quantize.py's MatMulNBits) rewrite by weight name.

Prefill stays a B=1 graph (model.LayerCaches, prefill=True) bound to one slot's region
(graphs/batch_export.py): a joining request's chunk costs what it costs alone, between the other
slots' decode iterations.
"""
from __future__ import annotations

import math

import torch

from spec_edge.graphs.model import Transformer, rotate_half


def batch_rope_and_mask(inv_freq: torch.Tensor, position: torch.Tensor, seq: int, cache_len: int,
                        mask_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """model.rope_and_mask per slot: cos, sin (B, T, D) and the additive mask (B, T, S + T)."""
    positions = position[:, None] + torch.arange(seq, dtype=torch.int64)[None, :]  # (B, T)
    freqs = positions.float()[..., None] * inv_freq[None, None, :]  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    batch = position.shape[0]
    cache_ok = (torch.arange(cache_len, dtype=torch.int64)[None, None, :] < position[:, None, None])
    cache_ok = cache_ok.expand(batch, seq, cache_len)  # (B, T, S)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()[None].expand(batch, seq, seq)
    allowed = torch.cat((cache_ok, causal), dim=2)  # (B, T, S + T)
    return emb.cos(), emb.sin(), torch.where(allowed, 0.0, torch.finfo(mask_dtype).min)


def batch_attention(attn, x, cos, sin, k_cache, v_cache, mask, batch: int, seq: int):
    """model.Attention.forward per slot. x (B*T, hidden); cos/sin (B, T, D); k_cache/v_cache
    (B, Hkv, S, D); mask (B, T, S + T). Returns (B*T, hidden), k_new / v_new (B, Hkv, T, D)."""
    heads, kv_heads, dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = attn.q_proj(x).view(batch, seq, heads, dim)
    k = attn.k_proj(x).view(batch, seq, kv_heads, dim)
    v = attn.v_proj(x).view(batch, seq, kv_heads, dim)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H or Hkv, T, D)
    q = q * cos[:, None] + rotate_half(q) * sin[:, None]
    k_new = k * cos[:, None] + rotate_half(k) * sin[:, None]
    v_new = v
    group = heads // kv_heads
    q = q.reshape(batch, kv_heads, group * seq, dim) * (1.0 / math.sqrt(dim))
    s_cache = torch.matmul(q, k_cache.transpose(2, 3))  # (B, Hkv, G*T, S)
    s_new = torch.matmul(q, k_new.transpose(2, 3))      # (B, Hkv, G*T, T)
    scores = torch.cat((s_cache, s_new), -1).view(batch, kv_heads, group, seq, -1) + mask[:, None, None]
    probs = torch.softmax(scores.float(), dim=-1).to(v_new.dtype).view(batch, kv_heads, group * seq, -1)
    cache_len = k_cache.shape[2]
    out = torch.matmul(probs[..., :cache_len], v_cache) + torch.matmul(probs[..., cache_len:], v_new)
    out = out.view(batch, heads, seq, dim).transpose(1, 2).reshape(batch * seq, heads * dim)  # (B*T, H*D)
    return attn.o_proj(out), k_new, v_new


class BatchCaches(Transformer):
    """The exported batched form: forward(tokens (B, T), position (B,), k_cache_0 .., v_cache_0 ..),
    one (B, Hkv, S, D) input per layer (a view of the caller's (L, B, Hkv, S, D) cache). A subclass,
    so initializer names stay Hugging Face's and the B=1 graphs' post-export passes find them."""

    def forward(self, tokens, position, *caches):
        batch, seq = tokens.shape
        n_layers = len(caches) // 2
        k_caches, v_caches = caches[:n_layers], caches[n_layers:]
        cache_len = k_caches[0].shape[2]
        x = self.model.embed_tokens(tokens.reshape(batch * seq))  # (B*T, hidden)
        cos, sin, mask = batch_rope_and_mask(self.inv_freq, position, seq, cache_len, x.dtype)
        cos, sin, mask = cos.to(x.dtype), sin.to(x.dtype), mask.to(x.dtype)
        k_news, v_news, hiddens = [], [], []
        for i, layer in enumerate(self.model.layers):
            attn, k_new, v_new = batch_attention(layer.self_attn, layer.input_layernorm(x), cos, sin,
                                                 k_caches[i], v_caches[i], mask, batch, seq)
            x = x + attn
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            k_news.append(k_new)
            v_news.append(v_new)
            if i in self.hidden_layers:
                hiddens.append(x)
        if self.n_layers in self.hidden_layers:  # index L: the final-norm state (Medusa)
            hiddens.append(self.model.norm(x))
        logits = self.head(x).view(batch, seq, -1)  # (B, T, V)
        outputs = (logits, torch.stack(k_news), torch.stack(v_news))  # k/v_new (L, B, Hkv, T, D)
        if self.hidden_layers:
            outputs = outputs + (torch.cat(hiddens, dim=-1).view(batch, seq, -1),)  # (B, T, n * H)
        return outputs
