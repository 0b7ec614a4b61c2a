"""The one place graph tensor names are defined.

Export (spec_edge/export.py) names the ONNX inputs/outputs with these, and every backend
(ONNX Runtime, TensorRT) binds tensors by these names. Shapes, with
L = layers, Hkv = KV heads, S = max context (cache length), D = head dim, T = graph width, V = vocab:
"""

TOKENS = "tokens"            # (1, T) int64   token ids to process
POSITION = "position"        # (1,)   int64   position of tokens[0, 0]; cache rows >= position are ignored
LAST_INDEX = "last_index"    # (1,)   int64   prefill only: row of the last real token in the padded chunk
K_CACHE = "k_cache"          # (L, Hkv, S, D) resident key cache (read only inside the graph)
V_CACHE = "v_cache"          # (L, Hkv, S, D) resident value cache

LOGITS = "logits"            # (T, V) float32 for step/verify graphs, (1, V) for prefill graphs
K_NEW = "k_new"              # (L, Hkv, T, D) keys of the processed tokens; the caller writes them
V_NEW = "v_new"              # (L, Hkv, T, D) into the cache at [position, position + n_valid)
HIDDEN = "hidden"            # (T, n * hidden) the hidden states of the layers the configured heads read
                             # (export.target_hidden_layers: EAGLE-3's low/mid/high, Medusa's final-norm
                             # state); an output of the target's graphs, an input of the head graphs
EMBED_TABLE = "embed_table"  # (V, hidden) EAGLE-3 head input: the target's token embedding, bound by pointer
HIDDEN_OUT = "hidden_out"    # (1, hidden) EAGLE-3 head output: its own hidden state for the next draft step

GRAPH_INPUTS = (TOKENS, POSITION, K_CACHE, V_CACHE)
PREFILL_INPUTS = (TOKENS, POSITION, LAST_INDEX, K_CACHE, V_CACHE)
GRAPH_OUTPUTS = (LOGITS, K_NEW, V_NEW)


def graph_file(kind: str, width: int) -> str:
    """File stem of a graph: 'prefill_64', 'verify_5', 'step_1', 'layerskip8_step_1' ..."""
    return f"{kind}_{width}"
