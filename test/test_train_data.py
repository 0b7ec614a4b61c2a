"""The training data of `spec-edge train-draft`: answering prompts in a batch (left-padded, one
forward per token for all rows) gives each prompt the same answer, argmax labels and hidden states
as answering it alone, and the recorded final-norm state is what the target's lm_head reads."""
from __future__ import annotations

import torch

from spec_edge.train import answer_batch, load_hf_target


def test_batched_answers_equal_one_by_one(tiny_models):
    model, tok, cfg = load_hf_target(str(tiny_models["target"]))
    prompts = [tok.encode(text) for text in ("Move the arm", "Navigate to the kitchen and report", "def add(a, b):")]
    assert len({len(ids) for ids in prompts}) == 3  # different lengths: the batch is really padded
    eos = set(cfg.eos_ids)
    batched = answer_batch(model, prompts, 10, eos, pad_id=0, aux_layers=(0, 1, 2))
    for ids, item in zip(prompts, batched):
        alone = answer_batch(model, [ids], 10, eos, pad_id=0, aux_layers=(0, 1, 2))[0]
        assert item["tokens"].tolist() == alone["tokens"].tolist()
        assert item["tokens"][:len(ids)].tolist() == ids and item["n_prompt"] == len(ids)
        n = len(item["tokens"])
        assert item["labels"].shape == (n,) and item["hid3"].shape == (n, 3 * cfg.hidden_size)
        assert item["hlast"].shape == (n, cfg.hidden_size)
        # greedy: every answer token is the argmax recorded at the position before it
        assert item["labels"][len(ids) - 1:n - 1].tolist() == item["tokens"][len(ids):].tolist()
        torch.testing.assert_close(item["hid3"].float(), alone["hid3"].float(), atol=2e-2, rtol=2e-2)
        with torch.no_grad():
            logits = model.lm_head(item["hlast"].float())
        assert logits.argmax(-1).tolist() == item["labels"].tolist()
