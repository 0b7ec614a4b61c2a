"""The hidden states a target's graphs return for its draft heads.

A head reads some of the target's layer outputs: EAGLE-3 and P-EAGLE a low, a middle and a high
layer (their config.json names them), Medusa the final-norm state (index L). The full-model graphs
(prefill, step, verify) then also return those states side by side, (T, len(layers) * H), ascending
by layer (index L = after the final norm). This is what the export needs to know of a head before
any head module is loaded: the layer ids, read from the head folder's config.json alone.

Layer ids here are 0-based layer *outputs* (id i = the output of layer i); configured_aux_layers
converts each published convention to it.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path

from spec_edge.config import Config, ConfigError


def default_aux_layers(n_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layers as outputs of layers: SafeAILab captures the inputs of layers
    (2, L//2, L-3), the outputs of (1, L//2-1, L-4); Model Optimizer's default is the same set."""
    return (1, n_layers // 2 - 1, n_layers - 4)


def configured_aux_layers(raw: dict, n_layers: int | Callable[[], int]) -> tuple[int, ...] | None:
    """The layer ids an EAGLE-3-style head's config.json names, in our convention (outputs of
    layers, 0-based); None when it names none (then default_aux_layers applies: SafeAILab's
    configs name none, its trainer hard-codes them). n_layers: the target's layer count, or a
    function that reads it (called only for speculators' ids, reading a GGUF's takes seconds).

    Two fields, two conventions:
      eagle_config.eagle_aux_hidden_state_layer_ids   (Model Optimizer, SpecForge, spec_edge's own
          save_head): layer *outputs* (Model Optimizer hooks the output of each named layer; SGLang
          captures the input of layer id+1). Taken as they are.
      top-level eagle_aux_hidden_state_layer_ids      (vLLM speculators): "before layer j", the
          residual stream vLLM captures at the input of layer j = the output of layer j-1.

    Model-Optimizer-numbered ids copied unchanged into the speculators field (published conversions
    did this: nm-testing/Qwen3-235B-A22B-EAGLE3-converted-speculators-lmsys lists [1, 46, 90] for a
    94-layer target, i.e. {1, L//2-1, L-4}) would read one layer too low. The weights cannot tell
    the two readings apart, and guessing wrong silently costs acceptance, so: when the config also
    has the trainer's own eagle_config ids, those win (the copy is recognised as one); when the
    top-level field alone holds exactly {1, L//2-1, L-4}, the config is refused with the two ways to
    state it unambiguously."""
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    outputs = tuple(int(i) for i in nested) if nested else None
    if not top:
        return outputs
    before = tuple(int(i) for i in top)
    if outputs is not None:
        if before == outputs or tuple(j - 1 for j in before) == outputs:
            return outputs  # a copy of eagle_config's output ids, or the same layers in vLLM's numbering
        raise ConfigError(f"head config.json names two different layer sets: eagle_config."
                          f"eagle_aux_hidden_state_layer_ids {list(outputs)} (layer outputs) and "
                          f"eagle_aux_hidden_state_layer_ids {list(before)} (inputs of layers, vLLM "
                          f"speculators); delete the one the head was not trained with")
    n_layers = n_layers() if callable(n_layers) else n_layers
    copied = sorted(set(default_aux_layers(n_layers)))
    if sorted(before) == copied:
        raise ConfigError(
            f"head config.json: eagle_aux_hidden_state_layer_ids {list(before)} is Model Optimizer's "
            f"default numbered as layer outputs ({{1, L//2-1, L-4}} for L={n_layers}), but this field "
            f"counts inputs of layers (vLLM speculators). If the head was trained by Model Optimizer or "
            f"SpecForge, write {[j + 1 for j in before]} here (or move the ids to eagle_config."
            f"eagle_aux_hidden_state_layer_ids); if it really read the inputs of layers {list(before)}, "
            f"write eagle_config.eagle_aux_hidden_state_layer_ids {[j - 1 for j in before]} instead")
    if min(before) < 1:
        raise ConfigError(f"head config.json: eagle_aux_hidden_state_layer_ids {list(before)} names the input "
                          f"of layer 0 (the token embeddings), which the target graphs do not return")
    return tuple(j - 1 for j in before)


def target_n_layers(source: str) -> int:
    """The target's layer count, read cheaply (config.json or GGUF metadata, no weights)."""
    from spec_edge.graphs import weights

    path = weights.resolve(source)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text())["num_hidden_layers"])
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    for field in reader.fields.values():
        if field.name.endswith(".block_count"):
            return int(field.parts[field.data[0]][0])
    raise ConfigError(f"{path}: GGUF metadata has no block_count")


def head_hidden_layers(head: str, target_source: str) -> tuple[int, ...]:
    """The target layers (outputs, ascending) an EAGLE-3-style head folder reads (its config.json)."""
    path = Path(head).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"head '{head}' is not a head folder (no config.json)")
    n_layers = cache(lambda: target_n_layers(target_source))
    try:
        layers = configured_aux_layers(json.loads((path / "config.json").read_text()), n_layers)
    except ConfigError as error:
        raise ConfigError(f"head '{head}': {error}") from None
    if layers is None:
        layers = default_aux_layers(n_layers())
    if list(layers) != sorted(set(layers)):
        raise ConfigError(f"head '{head}': auxiliary layers {list(layers)} must be distinct and ascending")
    return layers


def target_hidden_layers(cfg: Config) -> tuple[int, ...]:
    """The hidden states the target's graphs return (ascending; index L = after the final norm):
    the union of what the configured heads read (EAGLE-3 / P-EAGLE: three layers, Medusa: L)."""
    s = cfg.speculative
    if not (s.eagle3_head or s.peagle_head or s.medusa_head):
        return ()
    layers: set[int] = set()
    for head in (s.eagle3_head, s.peagle_head):
        if head:
            layers.update(head_hidden_layers(head, cfg.model.target))
    if s.medusa_head:
        layers.add(target_n_layers(cfg.model.target))
    return tuple(sorted(layers))


def returned_hidden_layers(graph_dir: Path) -> tuple[int, ...]:
    """The hidden states an exported target's graphs return (its manifest: the folder's form), () when none."""
    path = Path(graph_dir) / "manifest.json"
    if not path.is_file():
        return ()
    return tuple(json.loads(path.read_text()).get("hidden_layers", ()))


def hidden_columns(have: tuple[int, ...], layers: tuple[int, ...], hidden_size: int):
    """Column indices (len(layers) * hidden_size,) of `layers`' blocks in hidden-state rows that hold
    the layers `have` side by side (see target_hidden_layers)."""
    import numpy as np

    missing = [i for i in layers if i not in have]
    if missing:
        raise ConfigError(f"the target graphs do not return the hidden states of layers {missing} (they return "
                          f"{list(have)}): set the head in the config and re-export")
    return np.concatenate([np.arange(hidden_size) + have.index(i) * hidden_size for i in layers])
