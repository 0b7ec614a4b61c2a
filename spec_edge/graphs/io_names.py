"""The one place graph tensor names are defined.

Export (spec_edge/graphs/export.py) names the ONNX inputs/outputs with these, and the ONNX Runtime
backends bind tensors by these names. Shapes, with
L = layers, Hkv = KV heads, S = max context (cache length), D = head dim, T = graph width, V = vocab:
"""

TOKENS = "tokens"            # (1, T) int64   token ids to process
POSITION = "position"        # (1,)   int64   position of tokens[0, 0]; cache rows >= position are ignored
LAST_INDEX = "last_index"    # (1,)   int64   prefill only: row of the last real token in the padded chunk
IMAGE_ROWS = "image_rows"    # (T, hidden) float32  prefill_image only: the image rows of the chunk's image tokens
IMAGE_MASK = "image_mask"    # (T,)   bool    prefill_image only: which rows take image_rows instead of the token's
PIXELS = "pixel_values"      # (1, 3, tile, tile) float32  the vision graph's one image tile (vision/processor.py)
IMAGE_FEATURES = "image_features"  # (N, hidden) float32  its N image rows (N: the model's image tokens per image)
# The target's resident cache is one (L, Hkv, S, D) array per K and V on the caller's side; the
# graphs take it one layer per input, so each binds a view of its layer with no copy (a single
# (L, ...) input would be sliced per layer inside the graph, a copy of the whole cache per call).
K_CACHE_PREFIX = "k_cache_"  # k_cache_<i>: (Hkv, S, D) layer i of the resident key cache (read only)
V_CACHE_PREFIX = "v_cache_"  # v_cache_<i>: (Hkv, S, D) layer i of the resident value cache
K_CACHE = "k_cache"          # head graphs (EAGLE-3, P-EAGLE): (1, Hkv, S, D) the head's own cache
V_CACHE = "v_cache"

LOGITS = "logits"            # (T, V) float32 for step/verify graphs, (1, V) for prefill graphs
K_NEW = "k_new"              # (L, Hkv, T, D) keys of the processed tokens; the caller writes them
V_NEW = "v_new"              # (L, Hkv, T, D) into the cache at [position, position + n_valid)
# graphs.ort_attention = fused (ONNX Runtime only, spec_edge/graphs/ort_attention.py): no k_new / v_new; the
# cache inputs are (1, Hkv, S + C, D) (C spare rows for a padded chunk) and each layer writes its T
# new rows in place, through an output the caller binds to the same memory as the input
K_PRESENT_PREFIX = "k_present_"  # k_present_<i>: (1, Hkv, S + C, D) aliases k_cache_<i>
V_PRESENT_PREFIX = "v_present_"
# graphs.batch_slots = B > 1, a graph of m rows (fused attention only, gqa_rewrite.rewrite_rows): tokens (m, T),
# position (m,), logits (m, T, V) [, hidden (m, T, n * hidden)];
# each row's layer is its own input <k_cache_i>_s<j> (1, Hkv, S + C, D) and output <k_present_i>_s<j>, bound
# to the region of the slot row j serves in the (L, B + 1, Hkv, S + C, D) cache (slot_name; runtime/backends/
# ort_runner.py), so one graph runs any m of the slots
K_PRESENT = "k_present"      # the EAGLE-3 head graphs' one layer: (1, Hkv, S + W, D) aliases k_cache
V_PRESENT = "v_present"
HIDDEN = "hidden"            # (T, n * hidden) the hidden states of the layers the configured heads read
                             # (hidden.target_hidden_layers: EAGLE-3's low/mid/high, Medusa's final-norm
                             # state); an output of the target's graphs, an input of the head graphs
EMBED_TABLE = "embed_table"  # (V, hidden) EAGLE-3 head input: the target's token embedding, bound by pointer
HIDDEN_OUT = "hidden_out"    # (1, hidden) EAGLE-3 head output: its own hidden state for the next draft step

GRAPH_OUTPUTS = (LOGITS, K_NEW, V_NEW)


def k_cache(layer: int) -> str:
    return f"{K_CACHE_PREFIX}{layer}"


def v_cache(layer: int) -> str:
    return f"{V_CACHE_PREFIX}{layer}"


def k_present(layer: int) -> str:
    return f"{K_PRESENT_PREFIX}{layer}"


def v_present(layer: int) -> str:
    return f"{V_PRESENT_PREFIX}{layer}"


def slot_name(name: str, slot: int) -> str:
    """A per-row cache tensor of a batched fused graph: slot_name(k_cache(3), 1) = 'k_cache_3_s1' (row 1)."""
    return f"{name}_s{slot}"


def cache_inputs(n_layers: int) -> list[str]:
    """The per-layer cache inputs of a target graph, in input order: k_cache_0.., then v_cache_0.."""
    return [k_cache(i) for i in range(n_layers)] + [v_cache(i) for i in range(n_layers)]


def graph_inputs(n_layers: int, prefill: bool = False, images: bool = False) -> list[str]:
    """Input names, in order, of a target graph (forward(tokens, position, [last_index], [image_rows, image_mask],
    *caches))."""
    return ([TOKENS, POSITION] + ([LAST_INDEX] if prefill else []) + ([IMAGE_ROWS, IMAGE_MASK] if images else [])
            + cache_inputs(n_layers))


def graph_file(kind: str, width: int) -> str:
    """File stem of a graph: 'prefill_64', 'verify_5', 'step_1', 'layerskip8_step_1' ..."""
    return f"{kind}_{width}"
