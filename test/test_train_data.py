"""The training data of `spec-edge-train`: answering prompts in a batch (left-padded, one
forward per token for all rows) gives each prompt the same answer, argmax labels and hidden states
as answering it alone, and the recorded final-norm state is what the target's lm_head reads."""
from __future__ import annotations

import pytest
import torch

from spec_edge_training import data as train_data, fit, train
from spec_edge_training.data import answer_batch, load_hf_target
from tiny import train_draft_argv

pytestmark = pytest.mark.release  # training (docs/testing.md, "Tiers")


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


def test_data_cache_reuses_answers_and_loses_none(tmp_path, tiny_models, monkeypatch):
    """A cache made for fewer prompts is reused for those prompts (only the rest are answered), and
    a later run over fewer prompts reuses the bigger cache without shrinking it."""
    model, tok, cfg = load_hf_target(str(tiny_models["target"]))
    eos = set(cfg.eos_ids)
    out = tmp_path / "head"
    argv = train_draft_argv(tmp_path, tiny_models, out)
    n_prompts = len(train_data.read_prompts(argv[argv.index("--prompts") + 1], 0))
    assert n_prompts >= 3
    answered: list[int] = []  # prompts per answer_batch call: what really ran the target
    real_answer_batch = train_data.answer_batch
    monkeypatch.setattr(train_data, "answer_batch", lambda model, prompts, *rest: (
        answered.append(len(prompts)) or real_answer_batch(model, prompts, *rest)))

    def data_for(max_prompts: int) -> list[dict]:
        args = train.parse_args(argv + ["--max-prompts", str(max_prompts)])
        return train_data.make_data(args, model, tok, (0, 1, 2), eos, out)

    first = data_for(2)
    assert sum(answered) == 2
    cache = out / "train_data.pt"
    every = data_for(0)
    assert sum(answered) == n_prompts  # only the prompts the cache lacked were answered
    assert len(every) == n_prompts
    assert [item["tokens"].tolist() for item in first] == [item["tokens"].tolist() for item in every[:2]]
    stamp = cache.stat().st_mtime_ns
    again = data_for(1)
    assert sum(answered) == n_prompts and len(again) == 1  # all reused
    assert again[0]["tokens"].tolist() == every[0]["tokens"].tolist()
    assert cache.stat().st_mtime_ns == stamp  # not rewritten with fewer answers
    assert len(torch.load(str(cache), weights_only=False)["data"]) == n_prompts


def test_feature_std_equals_std_over_all_positions():
    """The heads' input scaling is the std over every cached position, computed per sequence
    (no float32 copy of the whole cache) yet equal to torch's std over all of them at once."""
    gen = torch.Generator().manual_seed(0)
    data = [{"hid3": (torch.randn(n, 12, generator=gen) * torch.arange(1, 13) + 3.0).half()} for n in (5, 17, 3)]
    want = torch.cat([item["hid3"].float() for item in data]).std(dim=0)
    torch.testing.assert_close(train_data.feature_std(data), want, rtol=1e-5, atol=1e-5)


def test_replay_chain_moves_like_the_live_loop():
    """Prompt of 3, answer tokens 3..9. Drafts are right except draft 1 from pair 5 (token 7)."""
    tokens = list(range(10))
    right = [[t + j + 2 for t in range(10)] for j in range(3)]  # chain_preds[j][t] = token t+j+2
    wrong = [row[:] for row in right]
    wrong[0][5] = -1
    # k=2, all right: pairs 2 -> 5 -> 8; verifies emit 4,5,6 then 7,8,9
    assert fit.replay_chain(right, tokens, 3, 2) == (2, 6)
    # k=2, a miss at pair 5: 4,5,6 | 7 (own token) | 8,9 (draft + own; the answer ends)
    assert fit.replay_chain(wrong, tokens, 3, 2) == (3, 6)
    # k=3: 4,5,6,7 | 8,9
    assert fit.replay_chain(right, tokens, 3, 3) == (2, 6)
