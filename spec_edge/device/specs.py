"""What engines a profile needs and what each is made of: EngineSpec (name, role, ONNX file,
widths and the kind of each width) and its build key, from the exported graphs; the file hashes
the build keys and the manifest use; the ONNX inspection helpers (token width, quantization,
external-data files), which read graph structure only, never the weights.

  over a dynamic-width graph (layout "shared"), one engine per model:
    target     widths {C, 1, k+1 for each k in graphs.k_values}   memory.target_widths
    draft      widths {C, 1}, drafter=draft                       memory.draft_widths
    layerskip  width 1, drafter=layerskip                          graphs.layer_skip_layers layers
    eagle3     widths {1, k+1 for each k, C} (ingest) + a second width-1 profile "step",
               drafter=eagle3 / hybrid (memory.head_widths; heads/eagle3_export.py's dynamic head graph)
  over static graphs (layout "per_graph"): one engine per ONNX file, at that file's width.
  graphs.batch_slots = B > 1: one target engine over graphs/batch_dynamic.py's (n, T) graph, its
    profile per width carrying the rows n as (min, opt, max) (memory.target_rows: decode widths
    (1, B, B), the prefill chunk (1, 1, 1)); no other engine (config.validate refuses the drafters
    that would need one)

Importable and testable without tensorrt.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spec_edge.config import HEAD_DRAFTERS, Config
from spec_edge.device import head_memory, memory
from spec_edge.graphs import io_names

HASH_CHUNK = 16 << 20


class BuildError(RuntimeError):
    """An engine cannot be built; the message says why and what to change."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def quick_fingerprint(path: Path) -> str:
    """Size + first and last MiB: identifies a large file cheaply (ONNX external weights)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{path.name}:{size}".encode())
    with path.open("rb") as fh:
        digest.update(fh.read(1 << 20))
        if size > 2 << 20:
            fh.seek(size - (1 << 20))
            digest.update(fh.read())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """One engine to build: name (file stem), role, ONNX file, widths and kind of each width."""
    name: str
    role: str            # target | draft | layerskip
    onnx: Path
    widths: tuple[int, ...]
    kinds: dict[int, str]  # width -> prefill | step | verify | layerskip | ingest
    dynamic: bool         # one profile per width over a dynamic token axis
    # (kind, width) profiles after the width profiles: the head's draft step is a second width-1
    # profile, so it gets its own execution context (a profile serves one context at a time)
    extra_profiles: tuple[tuple[str, int], ...] = ()
    # graphs.batch_slots > 1: width -> (min, opt, max) rows n of its profile (tokens (n, T)); None: (1, T)
    rows: dict[int, tuple[int, int, int]] | None = None

    def profile_shapes(self) -> list[tuple[str, int]]:
        """(name, width) of every optimization profile in order: str(width) per width, then the extras."""
        return [(str(w), w) for w in self.widths] + [(kind, w) for kind, w in self.extra_profiles]

    def build_key(self, extra: dict[str, Any]) -> str:
        """sha256 over what the engine is made of: the ONNX graph file, its external weights'
        fingerprints, widths, and `extra` (precision, TensorRT version, GPU, workspace)."""
        parts = {"onnx": file_sha256(self.onnx), "widths": list(self.widths), "dynamic": self.dynamic,
                 **({"extra_profiles": [list(p) for p in self.extra_profiles]} if self.extra_profiles else {}),
                 **({"rows": {str(w): list(r) for w, r in sorted(self.rows.items())}} if self.rows else {}),
                 "external": {p.name: quick_fingerprint(p) for p in external_data_files(self.onnx)},
                 **extra}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def profile_input_shapes(spec: EngineSpec, width: int, name: str, shape: Sequence[int]
                         ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) of network input `name` (TensorRT's shape, -1 = dynamic) in the width-`width` profile.
    Unbatched: every dynamic dimension is T. Batched (spec.rows): tokens is (n, T), any other input's
    dynamic dimension is the rows n (graphs/batch_dynamic.py: position (n,), caches (n, Hkv, S, D))."""
    if spec.rows is None:
        fixed = tuple(width if d < 0 else int(d) for d in shape)
        return fixed, fixed, fixed
    dynamic = [i for i, d in enumerate(shape) if d < 0]
    if name == io_names.TOKENS and dynamic == [0, 1]:
        return tuple((n, width) for n in spec.rows[width])
    if name != io_names.TOKENS and len(dynamic) <= 1:
        return tuple(tuple(n if d < 0 else int(d) for d in shape) for n in spec.rows[width])
    raise BuildError(f"{spec.onnx}: input '{name}' has shape {tuple(shape)}; a batched graph has tokens (n, T) "
                     f"and one dynamic dimension n elsewhere: delete {spec.onnx.parent} and run "
                     f"`spec-edge build --export-only`")


def external_data_files(onnx_path: Path) -> list[Path]:
    """The external-data files an ONNX file points to (read without loading the weights)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    names = set()
    for tensor in model.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            for entry in tensor.external_data:
                if entry.key == "location":
                    names.add(entry.value)
    return [onnx_path.parent / name for name in sorted(names)]


def onnx_token_width(onnx_path: Path) -> int | None:
    """The tokens input's width T, or None when the axis is dynamic (a 'shared' layout graph)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    for value in model.graph.input:
        if value.name == io_names.TOKENS:
            dim = value.type.tensor_type.shape.dim[1]
            return dim.dim_value if dim.HasField("dim_value") else None
    raise BuildError(f"{onnx_path} has no '{io_names.TOKENS}' input: not a spec_edge graph")


def onnx_quantization(onnx_path: Path) -> str:
    """'int4', 'fp8', 'nvfp4' or 'none': what Q/DQ nodes the graph's weights carry (graphs/qdq.py, ModelOpt)."""
    import onnx
    model = onnx.load(str(onnx_path), load_external_data=False)
    found = "none"
    fp8 = (onnx.TensorProto.FLOAT8E4M3FN,)
    fp4 = getattr(onnx.TensorProto, "FLOAT4E2M1", -1)
    init_types = {t.name: t.data_type for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type.startswith("TRT_FP4") or (node.op_type == "DequantizeLinear" and
                                                  init_types.get(node.input[0]) == fp4):
            return "nvfp4"
        if node.op_type == "DequantizeLinear" and init_types.get(node.input[0]) == onnx.TensorProto.INT4:
            return "int4"
        if node.op_type in ("QuantizeLinear", "DequantizeLinear", "TRT_FP8QuantizeLinear",
                            "TRT_FP8DequantizeLinear"):
            if node.op_type.startswith("TRT_FP8") or init_types.get(node.input[0]) in fp8:
                found = "fp8"
            for attr in node.attribute:
                if attr.name == "output_dtype" and attr.i in fp8:
                    found = "fp8"
    return found


def engine_specs(cfg: Config, onnx_dirs: dict[str, Path]) -> list[EngineSpec]:
    """The engines a profile needs, from the exported graphs in onnx_dirs (role -> folder): one
    engine over a dynamic-width graph when the export has one, else one engine per static graph.
    The layer-skip graph (in the target's folder) is built only for drafter=layerskip."""
    g, drafter = cfg.graphs, cfg.speculative.drafter
    roles = {"target": onnx_dirs["target"]}
    if drafter == "draft":
        roles["draft"] = onnx_dirs["draft"]
    specs: list[EngineSpec] = []
    if drafter in HEAD_DRAFTERS:
        specs.append(head_spec(cfg, onnx_dirs))
    skip_prefix = f"layerskip{g.layer_skip_layers}_"
    if g.batch_slots > 1:
        return [batched_spec(cfg, onnx_dirs["target"])]
    for role, folder in roles.items():
        files = sorted(Path(folder).glob("*.onnx"))
        if not files:
            raise BuildError(f"no ONNX graphs in {folder}: the export did not run")
        groups = {role: [f for f in files if not f.stem.startswith("layerskip")]}
        if role == "target" and drafter == "layerskip":
            groups["layerskip"] = [f for f in files if f.stem.startswith(skip_prefix)]
            if not groups["layerskip"]:
                raise BuildError(f"no {skip_prefix}*.onnx in {folder}: export the layer-skip graph "
                                 f"(graphs.layer_skip_layers={g.layer_skip_layers})")
        for group_role, group in groups.items():
            dynamic = [f for f in group if onnx_token_width(f) is None]
            if dynamic:
                widths = (memory.target_widths(g) if group_role == "target" else
                          memory.draft_widths(g) if group_role == "draft" else (1,))
                kinds = {w: _kind(w, g, group_role) for w in widths}
                name = role if group_role != "layerskip" else f"layerskip{g.layer_skip_layers}"
                specs.append(EngineSpec(name, group_role, dynamic[0], widths, kinds, True))
                continue
            for f in group:
                width = onnx_token_width(f)
                kind = f.stem.split("_")[0] if group_role != "layerskip" else "layerskip"
                specs.append(EngineSpec(f"{role}_{f.stem}", group_role, f, (width,), {width: kind}, False))
    return specs


def batched_spec(cfg: Config, folder: Path) -> EngineSpec:
    """The target engine of graphs.batch_slots = B > 1: graphs/batch_dynamic.py's graph, rows per width."""
    g = cfg.graphs
    path = Path(folder) / "dynamic.onnx"  # batch_dynamic.STEM
    if not path.is_file() or onnx_token_width(path) is not None:
        raise BuildError(f"graphs.batch_slots={g.batch_slots} builds from the batched dynamic graph {path}: the "
                         f"export did not run (spec-edge build --export-only)")
    widths = memory.target_widths(g)
    return EngineSpec("target", "target", path, widths, {w: _kind(w, g, "target") for w in widths}, True,
                      rows=memory.target_rows(g))


HEAD_GRAPH = "eagle3_dynamic.onnx"  # heads.eagle3_export.DYNAMIC_HEAD_STEM


def head_spec(cfg: Config, onnx_dirs: dict[str, Path]) -> EngineSpec:
    """The EAGLE-3 head engine: one dynamic-width graph, a profile per ingest width + the draft step."""
    folder = onnx_dirs.get("eagle3")
    if folder is None or not (Path(folder) / HEAD_GRAPH).is_file():
        raise BuildError(f"speculative.drafter={cfg.speculative.drafter} needs the EAGLE-3 head graph "
                         f"{HEAD_GRAPH} in onnx/eagle3/: the export did not run (spec-edge build --export-only)")
    widths = head_memory.head_widths(cfg.graphs)
    return EngineSpec("eagle3", "eagle3", Path(folder) / HEAD_GRAPH, widths, {w: "ingest" for w in widths}, True,
                      extra_profiles=(("step", 1),))


def _kind(width: int, g, role: str) -> str:
    if role == "layerskip":
        return "layerskip"
    if width == g.prefill_chunk:
        return "prefill"
    return "step" if width == 1 else "verify"
