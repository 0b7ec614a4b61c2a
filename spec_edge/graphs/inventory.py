"""What an engines folder holds, and which of it no profile uses: `spec-edge engines [--prune]`.

A profile uses the form folders of every model and head it runs on ONNX Runtime (plan.artifact_dir) and
the folders the post-export passes made from them (<form>_fused, ..._q4, ..._packed: folders.base_name).
The profiles are the defaults (Config()), each config/*.yaml of the package and the files named with
--config. A folder of a profile that cannot be read (a head folder not found) counts as used: prune
removes only what it can tell is unused. TensorRT Edge-LLM folders (no manifest.json of ours) are not
listed and never removed; nor are the folders of a profile that a tensorrt config names.
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from spec_edge.config import Config, ConfigError, engine_root, load
from spec_edge.graphs import folders, plan

HEAD_ROLES = ("eagle3", "peagle", "medusa")


@dataclasses.dataclass(frozen=True)
class Folder:
    path: Path
    size: int                   # bytes on disk
    graphs: int                 # graph files (*.onnx)
    last_used: float            # seconds since the epoch (folders.last_used)
    users: tuple[str, ...]      # the profiles that use it; () = none

    @property
    def form(self) -> str:
        """'target c1024 p64 float32 h1.14.26 2f786409 + fused q4 packed' from the folder's name."""
        base, _, passes = self.path.name.partition("_")
        return " ".join(base.split("-")) + (f" + {' '.join(passes.split('_'))}" if passes else "")


def package_profiles(extra: tuple[str, ...] = ()) -> list[tuple[str, Config | None, Path]]:
    """(label, config or None when it cannot be read, the folder its relative head paths are read
    against) of the defaults, each config/*.yaml beside the package, and each extra file."""
    checkout = Path(__file__).resolve().parents[2]
    found: list[tuple[str, Config | None, Path]] = [("default", Config(), checkout)]
    paths = sorted((checkout / "config").glob("*.yaml")) + [Path(path) for path in extra]
    for path in paths:
        own = path.parent == checkout / "config"
        label = f"config/{path.name}" if own else str(path)
        try:
            found.append((label, load(path), checkout if own else Path.cwd()))
        except ConfigError as err:
            found.append((f"{label} ({err})", None, checkout))
    return found


def used_bases(cfg: Config, base: Path) -> set[Path]:
    """The form folders cfg runs (models and heads), head paths relative to the working directory or base."""
    heads = {}
    for role in HEAD_ROLES:
        head = getattr(cfg.speculative, f"{role}_head")
        if head and not Path(head).expanduser().is_absolute() and not Path(head).exists():
            heads[f"speculative.{role}_head"] = str(base / head)
    cfg = cfg.replace(**heads) if heads else cfg
    roles = ["target"] + (["draft"] if cfg.model.draft else [])
    roles += [role for role in HEAD_ROLES if getattr(cfg.speculative, f"{role}_head")]
    return {plan.artifact_dir(cfg, role) for role in roles}


def inventory(root: Path, profiles: list[tuple[str, Config | None, Path]]) -> tuple[list[Folder], list[str]]:
    """Every graph folder under root (<profile>/onnx/<folder> with a manifest.json) with its users, and
    notes on the profiles whose folders could not be told (all of their profile's folders count as used)."""
    users: dict[Path, list[str]] = {}
    unknown: dict[str, str] = {}  # profile folder name -> who keeps all of its folders, and why
    notes = []
    for label, cfg, base in profiles:
        if cfg is None:
            notes.append(f"{label}: not a readable profile; its folders, if any, count as unused")
            continue
        if engine_root(cfg).resolve() != root.resolve():
            continue
        if cfg.runtime.backend != "onnxruntime":  # Edge-LLM's folders: never ours to remove
            unknown[cfg.runtime.profile] = f"{label} (its profile: runtime.backend {cfg.runtime.backend})"
            continue
        try:
            for path in used_bases(cfg, base):
                users.setdefault(path.resolve(), []).append(label)
        except (ConfigError, OSError) as err:
            unknown[cfg.runtime.profile] = f"{label} (its folders cannot be told)"
            notes.append(f"{label}: its folders cannot be told ({err}); every folder of profile "
                         f"'{cfg.runtime.profile}' is kept")
    found = []
    for manifest in sorted(root.glob("*/onnx/*/manifest.json")):
        path = manifest.parent
        if path.name.startswith(".") or not ours(manifest):
            continue
        base = (path.parent / folders.base_name(path.name)).resolve()
        who = users.get(base) or ([unknown[path.parent.parent.name]] if path.parent.parent.name in unknown else [])
        files = [p for p in path.rglob("*") if p.is_file()]
        found.append(Folder(path, sum(p.stat().st_blocks * 512 for p in files), sum(p.suffix == ".onnx" for p in files),
                            folders.last_used(path), tuple(who)))
    return found, notes


def ours(manifest: Path) -> bool:
    """A manifest.json that export.ensure_graphs or a head export wrote (an object with a "graphs" mapping)."""
    try:
        data = json.loads(manifest.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and isinstance(data.get("graphs"), dict)


def prune(found: list[Folder], progress=print) -> list[Folder]:
    """Remove every folder no profile uses, each under its writer lock (a process making it meanwhile
    finishes first); returns the removed ones."""
    removed = []
    for folder in found:
        if folder.users:
            continue
        with folders.writing(folder.path, progress, "[engines]"):
            folders.remove(folder.path)
        removed.append(folder)
    return removed


def report(found: list[Folder], now: float | None = None) -> list[str]:
    """One line per folder: size, graphs, last use, users, path and form."""
    now = time.time() if now is None else now
    lines = []
    for folder in found:
        age = max(0.0, now - folder.last_used)
        when = f"{age / 86400:.0f} d ago" if age >= 86400 else f"{age / 3600:.1f} h ago" if age >= 3600 \
            else f"{age / 60:.0f} min ago"
        who = ", ".join(folder.users) if folder.users else "UNUSED"
        lines.append(f"{folder.size / 2**20:8.0f} MiB  {folder.graphs:3d} graphs  last used {when:>11}  "
                     f"{folder.path.parent.parent.name}/onnx/{folder.path.name}\n"
                     f"    form: {folder.form}\n    used by: {who}")
    total = sum(folder.size for folder in found)
    unused = sum(folder.size for folder in found if not folder.users)
    lines.append(f"{len(found)} folders, {total / 2**30:.2f} GiB; "
                 f"unused (removed by --prune): {unused / 2**30:.2f} GiB")
    return lines


def main(args, progress=print) -> int:
    """spec-edge engines: list the folders under the engines root (args.engine_dir or the defaults'),
    with --prune remove the unused ones."""
    cfg = Config()
    if args.engine_dir:
        cfg = cfg.replace(**{"runtime.engine_dir": str(Path(args.engine_dir).expanduser().absolute())})
    root = engine_root(cfg)
    profiles = package_profiles(tuple(args.config or ()))
    if args.engine_dir:  # every profile is looked for under this root
        profiles = [(label, p.replace(**{"runtime.engine_dir": str(root)}) if p else None, base)
                    for label, p, base in profiles]
    found, notes = inventory(root, profiles)
    print(f"engines folder: {root}")
    for line in report(found):
        print(line)
    for note in notes:
        progress(f"[engines] {note}")
    if args.prune:
        removed = prune(found, progress)
        freed = sum(folder.size for folder in removed)
        print(f"removed {len(removed)} folders, {freed / 2**30:.2f} GiB")
    return 0
