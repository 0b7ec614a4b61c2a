"""The token embedding as a graph input (io_names.EMBED_TABLE) instead of a weight.

A TensorRT engine embeds every weight it uses, so the target engine and the EAGLE-3 head engine
would each hold the (V, H) table (1 GB for Llama-3.1-8B in bf16). In a profile with a head, the
target's dynamic graph takes the table as the input embed_table instead (export.graph_plan:
"embed_input"), and so does the head graph: the runtime loads it once, from the export's
weights.bin, and binds the one buffer to both engines. Its place in weights.bin is the manifest's
"embed_table" record, written here.
"""
from __future__ import annotations

import json
from pathlib import Path

KEY = "embed_table"                  # the manifest record of an export whose graphs take the table
TENSOR = "model.embed_tokens.weight"  # the checkpoint tensor it holds


def store(table, weight_store, dtype: str) -> dict:
    """Put the (V, H) table (a torch tensor already in the graphs' dtype) into the export's weight
    store; returns the manifest record: file, offset, length (bytes), shape, dtype, tensor."""
    import torch

    table = table.contiguous()
    offset, length = weight_store.put(table.view(-1).view(torch.uint8).numpy().tobytes())
    return {"file": weight_store.path.name, "offset": offset, "length": length, "shape": list(table.shape),
            "dtype": dtype, "tensor": TENSOR}


def record(out_dir: Path) -> dict | None:
    """The manifest record of an export's shared table (store), None when its graphs take none."""
    path = Path(out_dir) / "manifest.json"
    return json.loads(path.read_text()).get(KEY) if path.is_file() else None


def table_tensor(out_dir: Path):
    """The shared table as a (V, H) torch tensor of the record's dtype over a read-only memory map of
    weights.bin (no host copy; `.to("cuda")` makes the one device table both engines bind)."""
    import warnings

    import numpy as np
    import torch

    rec = record(out_dir)
    if rec is None:
        raise ValueError(f"{out_dir}: the export records no shared embedding table (manifest '{KEY}')")
    raw = np.memmap(Path(out_dir) / rec["file"], dtype=np.uint8, mode="r", offset=int(rec["offset"]),
                    shape=(int(rec["length"]),))
    with warnings.catch_warnings():  # torch warns that the buffer is read-only: it is, on purpose (never written)
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.frombuffer(raw, dtype=getattr(torch, rec["dtype"])).view(*rec["shape"])  # torch.<graphs.dtype>
