"""What the drafter head folders share (EAGLE-3 and P-EAGLE heads in eagle3.py / peagle.py, Medusa
heads in medusa.py): reading config.json and the tensors, the draft vocabulary map (d2t: draft id
offsets, target_id = draft_id + d2t[draft_id]; t2d: (V,) bool, which target ids are drafted),
writing a folder, its fingerprint and loading a state into the torch module (heads/export.py exports a head's
graphs into an artifact folder).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from spec_edge.config import ConfigError

# ---------------------------------------------------------------------------------------------
# Reading


def read_config(path: Path, what: str, made_by: str) -> dict:
    """config.json of a head folder; what: "EAGLE-3 head", made_by: the command that makes one."""
    if not (path / "config.json").is_file():
        raise ConfigError(f"{what} '{path}' has no config.json (expected a head folder: "
                          f"config.json + model.safetensors, e.g. from `{made_by}`)")
    return json.loads((path / "config.json").read_text())


def read_tensors(path: Path, what: str, torch_files: tuple[str, ...]) -> dict:
    """The tensors of *.safetensors, else of the first of torch_files that is there."""
    import torch

    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        state: dict = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    for name in torch_files:
        if (path / name).is_file():
            return torch.load(str(path / name), map_location="cpu", weights_only=True)
    names = ["model.safetensors", *torch_files]
    raise ConfigError(f"{what} {path} has no {', '.join(names[:-1])} or {names[-1]}")


def target_problems(vocab_size: int, target_layers: int, target, made: str = "head was") -> list[str]:
    """A head's vocabulary and target depth against the target's (target_layers 0: not recorded)."""
    problems = []
    if vocab_size != target.vocab_size:
        problems.append(f"head vocabulary is {vocab_size} tokens, the target's is {target.vocab_size}")
    if target_layers and target_layers != target.n_layers:
        problems.append(f"{made} trained for a {target_layers}-layer target; this one has {target.n_layers}")
    return problems


def refuse(problems: list[str], where: str, target) -> None:
    """Raise the ConfigError naming every problem of a head that does not fit the target."""
    if problems:
        raise ConfigError(f"{where} does not match the target {target.name or ''} "
                          f"({target.n_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}): "
                          + "; ".join(problems))


def draft_ids_of(d2t, draft_vocab_size: int) -> np.ndarray:
    """(Vd,) int64 draft id -> target id from the d2t offsets (None: the identity)."""
    draft_ids = np.arange(draft_vocab_size, dtype=np.int64)
    return draft_ids if d2t is None else draft_ids + d2t.numpy().astype(np.int64)


def d2t_problems(d2t, draft_vocab_size: int, head_vocab_size: int, target_vocab_size: int, *,
                 earlier: bool) -> list[str]:
    """What is wrong with a head's d2t map; earlier: other problems were found already (then its
    ids are not range-checked)."""
    problems = []
    if draft_vocab_size != head_vocab_size:
        if d2t is None:
            problems.append("a reduced draft vocabulary needs the d2t map, which is missing")
        elif d2t.shape[0] != draft_vocab_size:
            problems.append(f"d2t has {d2t.shape[0]} entries, draft_vocab_size is {draft_vocab_size}")
    if d2t is not None and not problems and not earlier:
        ids = draft_ids_of(d2t, d2t.shape[0])
        if ids.min() < 0 or ids.max() >= target_vocab_size:
            problems.append(f"d2t maps draft ids outside the target vocabulary [0, {target_vocab_size})")
    return problems


def fingerprint(path: str | Path, suffixes: tuple[str, ...], skip: tuple[str, ...]) -> str:
    """A digest of the folder's files with those suffixes (names in skip left out)."""
    path = Path(path).expanduser()
    digest = hashlib.sha256()
    for file in sorted(path.iterdir()):
        if file.suffix in suffixes and file.name not in skip:
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def load_state(module, state: dict | None, what: str):
    """module with its tensors from state (None: left as built); a missing one is a ConfigError."""
    if state is not None:
        own = module.state_dict()
        missing = [name for name in own if name not in state]
        if missing:
            raise ConfigError(f"{what} lacks tensors {missing[:4]}")
        module.load_state_dict({name: state[name] for name in own})
    return module


# ---------------------------------------------------------------------------------------------
# Writing

def write(path: str | Path, state: dict, names: list[str], draft_ids: np.ndarray, vocab_size: int,
          dtype: str, config: dict) -> Path:
    """A head folder: model.safetensors (the named tensors stored as dtype, d2t, t2d) + config.json."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    store_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    tensors = {name: state[name].detach().to(store_dtype).contiguous() for name in names}
    draft_ids = np.asarray(draft_ids, dtype=np.int64)
    tensors["d2t"] = torch.from_numpy(draft_ids - np.arange(len(draft_ids), dtype=np.int64))
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[draft_ids] = True
    tensors["t2d"] = torch.from_numpy(t2d)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# ---------------------------------------------------------------------------------------------
# Export
