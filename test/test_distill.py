"""spec-edge-train --kind draft: a small draft model distilled from the target, saved as a
Hugging Face folder that `model.draft` loads; speculative output with it == target-only output."""
from __future__ import annotations

import json

import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.config import ConfigError
from spec_edge.runtime import speculative
from spec_edge import artifacts
from spec_edge.runtime.requests import GenerateRequest
from spec_edge_training import draft_model, train
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from tiny import run_alone


def test_layer_choice_spreads_first_to_last():
    assert draft_model.layer_choice(30, 4) == [0, 10, 19, 29]
    assert draft_model.layer_choice(30, 1) == [0]
    with pytest.raises(ConfigError, match="--draft-layers"):
        draft_model.layer_choice(4, 4)


@pytest.mark.release
def test_train_draft_model_loads_as_draft_and_stays_exact(tmp_path, tiny_models, tiny_cfg):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Move the arm to the left\nNavigate to the kitchen\ndef add(a, b):\nReport the battery\n")
    out = tmp_path / "draft"
    argv = ["--kind", "draft", "--target", str(tiny_models["target"]), "--out", str(out),
            "--prompts", str(prompts), "--max-new-tokens", "12", "--draft-layers", "2", "--aux-layers", "0", "1", "2", "--batch", "2",
            "--steps", "3", "--dtype", "float32", "--save-every", "2"]
    assert train.main(argv) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["spec_edge"]["initialised_from_target_layers"] == [0, 3]
    argv[argv.index("--steps") + 1] = "4"
    assert train.main(argv) == 0  # resumes from step 3

    cfg = tiny_cfg.replace(**{"model.draft": str(out), "runtime.profile": "tiny-distilled",
                              "speculative.drafter": "draft"})
    engine = artifacts.engine(cfg, progress=lambda message: None)
    try:
        for prompt in ("Move the arm", "def add(a, b):"):
            ids = front_of(engine).prompt_ids(GenerateRequest(prompt=prompt))
            plain, _, _ = run_alone(engine.runner, speculative.SlotRequest(
                prompt_ids=ids, max_new_tokens=24, eos_ids=engine.eos_ids))
            result = run_one(engine, GenerateRequest(prompt=prompt, max_new_tokens=24, drafter="draft", k=3))
            assert result.token_ids == plain[:len(result.token_ids)] and len(result.token_ids) == len(plain)
            assert_speculated(result.stats, what=prompt)  # from the target's own layers: its drafts are accepted
    finally:
        engine.close()
