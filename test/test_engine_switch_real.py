"""The sequence of issue 37 on the embedded default: the demo's export, the committed EAGLE-3 head on q4,
plain generate, then the head again. Every command works, and switching back re-exports nothing (each
form has its folder: graphs/folders.py). Shares <repo>/engines with the other real-model tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# the release tier (docs/testing.md): the exact-output check here is test_real_model's; what is its own (switching
# forms re-exports nothing) needs the EAGLE-3 form, minutes of export that no other test uses
pytestmark = [pytest.mark.release, pytest.mark.real_model("default", "eagle3")]
PROMPT = ("Rewrite this status report for the operator, keeping every number: Robot arm 2 finished 14 picks in "
          "3 minutes, battery at 76 percent.")
MAKING = ("[export]", "[fused]", "[q4]", "[q8]", "[packed]")


def generate(*args: str) -> tuple[dict, list[str]]:
    """spec-edge generate --json on the shared engines folder: (the result, the progress lines that made graphs)."""
    out = subprocess.run([sys.executable, "-m", "spec_edge.cli", "generate", "--prompt", PROMPT, "--max-new-tokens",
                          "24", "--json", "--engine-dir", str(REPO / "engines"), *args], capture_output=True, text=True,
                         timeout=1200, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout), [line for line in out.stderr.splitlines() if line.startswith(MAKING)]


def test_head_plain_head_switches_reload():
    head = ("--eagle3-head", "heads/smollm2-135m-eagle3", "--weights", "q4", "--drafter", "eagle3", "--k", "4")
    demo, _ = generate("--drafter", "ngram", "--k", "4")            # scripts/demo.sh's profile
    with_head, _ = generate(*head)                                  # its own form: the head's hidden states
    plain, made_plain = generate("--drafter", "none")
    again, made_again = generate(*head)
    assert made_plain == [] and made_again == [], made_plain + made_again
    assert plain["token_ids"] == demo["token_ids"]                  # fp32 speculation is exact
    assert again["token_ids"] == with_head["token_ids"] and again["stats"]["drafted"] > 0
