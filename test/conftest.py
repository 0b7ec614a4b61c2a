"""Shared fixtures: tiny random-weight models exported once per test session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")

from tiny import TINY_K_VALUES  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from tiny import make_checkpoint, train_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    tok = train_tokenizer()
    target = make_checkpoint(root / "target", seed=1, tokenizer=tok)
    draft = make_checkpoint(root / "draft", seed=2, n_layers=2, tie=True, tokenizer=tok)
    return {"target": target, "draft": draft, "root": root}


@pytest.fixture(scope="session")
def tiny_cfg(tiny_models):
    from spec_edge.config import Config

    # fp32, one slot: a Hugging Face folder has no GGUF blocks for the default q4, and one slot is the
    # single-request path the tests compare against (test_batch*.py set graphs.batch_slots themselves)
    return Config().replace(**{
        "model.target": str(tiny_models["target"]), "model.draft": str(tiny_models["draft"]),
        "graphs.weights": "fp32", "graphs.batch_slots": 1,
        "graphs.max_context": 128, "graphs.prefill_chunk": 16, "graphs.k_values": TINY_K_VALUES,
        "graphs.layer_skip_layers": 2, "runtime.engine_dir": str(tiny_models["root"] / "engines"),
        "runtime.profile": "tiny", "speculative.drafter": "draft", "speculative.k": 4})


@pytest.fixture(scope="session")
def tiny_engine(tiny_cfg):
    from spec_edge import artifacts

    return artifacts.engine(tiny_cfg, progress=lambda message: None)
