"""What left the package stays reachable: bench/peers.py runs spec-edge bench's loop with a peer beside
spec_edge (transformers, for real, on the tiny target), and the commands that moved are refused with the
command that does it now."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from spec_edge import cli

REPO = Path(__file__).resolve().parents[1]


def bench_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,names", [
    (["train-draft", "--out", "x"], "spec-edge-train"),
    (["bench", "--peers", "none"], "bench/peers.py"),
    (["bench", "--hf-baseline"], "bench/peers.py"),
    (["bench", "--accuracy", "--weights", "q4"], "bench/accuracy.py"),
])
def test_a_moved_command_is_refused_naming_the_new_one(argv, names, capsys, tmp_path):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "moved" in err and names in err, err
    assert not (tmp_path / "x").exists()


def test_bench_peers_runs_a_peer_beside_spec_edge(tiny_cfg, tmp_path, capsys):
    """transformers' generate on the tiny target's own folder joins the interleaved run: its rows are in the
    report, compared with spec_edge fp32 target-only, the verdict weighs spec_edge against it; spec_edge's
    speculative rows stay exact (exit 0)."""
    pytest.importorskip("transformers")
    from spec_edge.tools import bench

    peers = bench_script("peers")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "p", "kind": "edit", "prompt": "Rewrite: move the arm to the left"}) + "\n")
    out = tmp_path / "bench.json"
    args = argparse.Namespace(full=False, temperatures=None, repeats=1, ks=[3], weights=None, prompts=str(prompts),
                              kinds=None, drafters=["ngram"], max_new_tokens=8, json_out=str(out), ort_attention=None)
    assert bench.main(tiny_cfg, args, lambda message: None, peers.peer_systems(["transformers"])) == 0
    rows = {r["system"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"spec_edge[fp32] target-only", "spec_edge[fp32] ngram k=3", "transformers plain",
            "transformers prompt-lookup k=3", "transformers assistant"} <= set(rows), sorted(rows)
    assert rows["transformers plain"]["greedy_equal_spec_edge_fp32"] in ("0/1", "1/1")  # compared with ours
    assert rows["spec_edge[fp32] ngram k=3"]["greedy_equal_own_plain"] == "1/1"
    assert "transformers plain" in capsys.readouterr().out.split("best spec_edge[fp32] speculative")[1]
