"""Graph folders on disk: their names (one form per folder), one writer at a time, atomic appearance.

A folder's name says its form, everything its graphs' shapes and outputs depend on, so two forms never
share a folder and switching between profiles loads what an earlier run made (docs/bench.md, "Engine
folders"):

    <engine_root>/<profile>/onnx/<role>-c<max_context>-p<prefill_chunk>-<dtype>[-h<layers>]-<source>
        role     target | draft | eagle3 | peagle | medusa
        layers   the hidden states the target's graphs also return for its heads, e.g. h1.14.26
        source   8 hex digits: the checkpoint's fingerprint (target, draft), the head folder's path (heads)
    <that>_fused, <that>_fused_q4, <that>_fused_q4_packed ...   the post-export passes' copies (suffixes
                                                               after the first "_", which no form name has)

Writers of a folder (any process) take an exclusive lock (fcntl.flock on `.<name>.lock` beside it,
released by the kernel when the holder dies); readers take none: whatever a reader can see is complete.
A new folder is written under `.<name>.tmp<pid>` and renamed into place; a file added to an existing folder
is written beside its final name and renamed over it (os.replace), its manifest last. A writer killed at
any point leaves the folder as it was plus leftovers that the next writer removes (cleanup_leftovers).
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

USED = ".used"  # touched whenever a run finds the folder complete: its last use (spec-edge engines)


def form_name(role: str, source_stamp: str, max_context: int, prefill_chunk: int, dtype: str,
              hidden_layers: tuple[int, ...] = ()) -> str:
    """The folder name of one form: form_name('target', '2f78640916036c4d', 1024, 64, 'float32', (1, 14, 26))
    = 'target-c1024-p64-float32-h1.14.26-2f786409'."""
    hidden = f"-h{'.'.join(str(i) for i in hidden_layers)}" if hidden_layers else ""
    return f"{role}-c{max_context}-p{prefill_chunk}-{dtype}{hidden}-{source_stamp[:8]}"


def path_stamp(path: str | Path) -> str:
    """A stamp of a folder's absolute path (a head folder: which head, whatever its contents' version)."""
    return hashlib.sha256(str(Path(path).expanduser().resolve()).encode()).hexdigest()[:16]


def base_name(folder_name: str) -> str:
    """The form folder a (derived) folder was made from: 'target-...-2f786409_fused_q4' -> 'target-...-2f786409'."""
    return folder_name.split("_", 1)[0]


def write_atomic(path: Path, data: str | bytes) -> None:
    """path holds data, or (a writer killed before the rename) what it held before; never a part."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    if isinstance(data, str):
        tmp.write_text(data)
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def lock_path(out: Path) -> Path:
    return out.parent / f".{out.name}.lock"


@contextmanager
def writing(out: Path, progress: Callable[[str], None] = print, label: str = "[graphs]") -> Iterator[None]:
    """Hold folder out's exclusive writer lock (waiting, with a note, while another process holds it);
    on entry, undo what a killed writer left (cleanup_leftovers)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path(out), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"{label} another process is writing {out}; waiting ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            cleanup_leftovers(out)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cleanup_leftovers(out: Path) -> None:
    """Under out's lock: put back a folder a killed publish() had moved aside, remove half-written
    temporary folders and files (theirs are complete or absent: nothing else refers to them)."""
    aside = sorted(out.parent.glob(f".{out.name}.old*"), key=lambda p: p.stat().st_mtime)
    if not out.exists() and aside:
        aside.pop().rename(out)
    for leftover in aside + list(out.parent.glob(f".{out.name}.tmp*")):
        remove(leftover)
    if out.is_dir():
        for leftover in out.glob(".*.tmp*"):
            leftover.unlink(missing_ok=True)


def temporary(out: Path) -> Path:
    """A new empty folder beside out (under out's lock) to write a whole new form into."""
    folder = out.parent / f".{out.name}.tmp{os.getpid()}"
    remove(folder)
    folder.mkdir(parents=True)
    return folder


def publish(folder: Path, out: Path) -> None:
    """Put the complete folder in out's place (under out's lock). A reader sees the old folder or the new
    one; between the two renames out is absent, which a reader takes as 'to be made' and so waits for the
    lock. Killed between them, the next writer puts the old folder back (cleanup_leftovers)."""
    old = out.parent / f".{out.name}.old{os.getpid()}"
    if out.exists():
        out.rename(old)
    folder.rename(out)
    remove(old)


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def mark_used(out: Path) -> None:
    """Record now as out's last use. Best effort: a read-only engines folder still serves."""
    try:
        (out / USED).touch()
    except OSError:
        pass


def last_used(out: Path) -> float:
    """When a run last found out complete (else when it was made), seconds since the epoch."""
    for path in (out / USED, out / "manifest.json", out):
        if path.exists():
            return path.stat().st_mtime
    return time.time()


def folder_stamp(folder: Path) -> str:
    """A short hash of a graph folder's identity (its manifest without the graph list and the run
    log): what a folder derived from it records. Adding graphs to the folder keeps its stamp."""
    manifest = json.loads((Path(folder) / "manifest.json").read_text())
    ident = {key: value for key, value in manifest.items() if key not in ("graphs", "made")}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
