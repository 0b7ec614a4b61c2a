"""The EAGLE-3 head's bytes in a TensorRT plan (memory.py adds them to the plan of a profile with
drafter eagle3 / hybrid): its engine's weights, its own KV cache, its I/O buffers per optimization
profile, the target's hidden-state outputs it reads, and the embedding the target engine no longer
holds (the table is the shared embed_table input of both engines). Pure arithmetic; dt = bytes per
element of graphs.dtype (memory.DTYPE_BYTES).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from spec_edge.config import GraphSection, ModelConfig

if TYPE_CHECKING:
    from spec_edge.heads.eagle3 import HeadConfig


def head_widths(graphs: GraphSection) -> tuple[int, ...]:
    """The head engine's ingest profiles: 1, each k+1 and the prefill chunk (eagle3_export.head_widths);
    the draft step is one more width-1 profile."""
    return tuple(sorted({1, graphs.prefill_chunk, *(k + 1 for k in graphs.k_values)}))


def head_weight_bytes(h: "HeadConfig", dt: int) -> int:
    """The head engine's weights: fc (3Ht -> H), the layer (q/k/v over 2H, o, MLP), lm_head over the
    draft vocabulary, four norms, + the d2t map (Vd int64). No embedding: it reads the target's table."""
    H, D = h.hidden_size, h.head_dim
    linear = (3 * h.target_hidden_size * H + 2 * H * D * (h.n_heads + 2 * h.n_kv_heads) + H * D * h.n_heads
              + 3 * H * h.intermediate_size + h.draft_vocab_size * H)
    return (linear + 4 * H) * dt + h.draft_vocab_size * 8


def embedding_in_engine(m: ModelConfig, dt: int) -> int:
    """Bytes memory.weight_bytes counts for the token embedding (twice when tied: Gather table + head
    GEMM): what the target engine does not hold when the table is its embed_table input."""
    return m.vocab_size * m.hidden_size * dt * (2 if m.tie_embeddings else 1)


def head_kv_bytes(h: "HeadConfig", max_context: int, dt: int) -> int:
    """The head's own K + V cache (1, Hkv, S, D) x 2."""
    return 2 * h.n_kv_heads * max_context * h.head_dim * dt


def head_io_bytes(h: "HeadConfig", widths: tuple[int, ...], dt: int) -> int:
    """The head engine's buffers, one set per profile (ingest widths + the draft step): hidden (W, 3Ht),
    hidden_draft (W, H), k_new / v_new (1, Hkv, W, D), hidden_out (1, H) in dt, logits (1, Vd) float32,
    tokens (1, W), position, last_index, draft_token int64."""
    return sum(w * (3 * h.target_hidden_size + h.hidden_size + 2 * h.n_kv_heads * h.head_dim) * dt
               + h.draft_vocab_size * 4 + h.hidden_size * dt + (w + 3) * 8 for w in widths)


def hidden_bytes(m: ModelConfig, n_hidden: int, widths: tuple[int, ...], max_context: int, dt: int) -> int:
    """The target's hidden-state outputs for a head: (T, n x H) per target profile (each execution
    context has its own), + the resident rows (S, n x H) the head ingests from (after prompt-lookup
    drafts the head catches up over several target calls)."""
    return n_hidden * m.hidden_size * dt * (sum(widths) + max_context)
