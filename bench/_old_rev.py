"""A module of spec_edge as it was at an earlier git revision, for the benches that time the code before a
change against today's in one process (bench/batch_rows.py, bench/batch_loop_ab.py)."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def old_module(rev: str, path: str):
    """Module `path` (spec_edge/...) as it was at git revision rev, loaded under its own name."""
    source = subprocess.check_output(["git", "-C", str(REPO), "show", f"{rev}:{path}"])
    name = f"{Path(path).stem}_{rev}"
    file = Path(f"/tmp/{name}.py")
    file.write_bytes(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def ab_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every old-against-new bench takes: the earlier revision, its graph folder, the
    weights form and the batch slots."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--old-graphs", required=True)
    parser.add_argument("--weights", default="fp32")
    parser.add_argument("--slots", type=int, default=8)
    return parser
