"""spec-edge-train --kind eagle3: an EAGLE-3 head trained with training-time test.

Each batch (collate) is unrolled --ttt-steps draft steps, step j consuming the head's own hidden
state of step j-1, the loss (decayed by 0.8 per step) against the target's own softmax over the
draft vocabulary (--loss distribution, EAGLE-3's) or its argmax (--loss argmax). The held-out score
(answer_agreement, also used by scripts/replay_head.py) is the teacher-forced top-1 agreement per
draft step over the answer positions; the loop is fit.fit.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from spec_edge.heads import eagle3
from spec_edge_training.data import feature_std
from spec_edge_training.fit import draft_vocab_map, fit, load_resume, split


def collate(items: list[dict], t2d, embed, ttt: int, with_hlast: bool = False):
    """emb_steps (ttt, B, N, H), hid3 (B, N, 3H), labels (ttt, B, N) in draft ids (-100 = none),
    and with with_hlast the target's final-norm hidden state behind each label, hlast_steps
    (ttt, B, N, H): what the target's own distribution over the draft vocabulary is computed from."""
    import torch

    n = max(len(item["tokens"]) for item in items) - 1  # pairs (h_t, x_{t+1}) for t < len - 1
    B = len(items)
    tokens = torch.zeros(B, n + ttt + 1, dtype=torch.long)
    labels_t = torch.full((B, n + ttt + 1), -1, dtype=torch.long)
    hid3 = torch.zeros(B, n, items[0]["hid3"].shape[1])
    hlast = torch.zeros(B, n + ttt + 1, items[0]["hlast"].shape[1]) if with_hlast else None
    for b, item in enumerate(items):
        length = len(item["tokens"])
        tokens[b, :length] = item["tokens"]
        labels_t[b, :length] = item["labels"]  # prompt positions too: the target's own next-token choices
        hid3[b, :length - 1] = item["hid3"][:length - 1].float()
        if with_hlast:
            hlast[b, :length] = item["hlast"].float()
    emb_steps = torch.stack([embed[tokens[:, j + 1:j + 1 + n]] for j in range(ttt)])  # token t+j+1
    target = torch.stack([labels_t[:, j + 1:j + 1 + n] for j in range(ttt)])          # argmax at t+j+1
    draft_labels = torch.where(target >= 0, t2d[target.clamp(min=0)], torch.full_like(target, -100))
    if not with_hlast:
        return emb_steps, hid3, draft_labels
    hlast_steps = torch.stack([hlast[:, j + 1:j + 1 + n] for j in range(ttt)])       # (ttt, B, N, H)
    return emb_steps, hid3, draft_labels, hlast_steps


def answer_agreement(module, items: list[dict], t2d, embed, n_steps: int, batch: int) -> list[float]:
    """Top-1 agreement of an EAGLE-3 head (train_forward) with the target per draft step, over the
    answer positions of items (prompts excluded), teacher-forced."""
    hits, total = np.zeros(n_steps), np.zeros(n_steps)
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        emb, hid, labels = collate(chunk, t2d, embed, n_steps)
        for b, item in enumerate(chunk):  # score the answer only: step j at t predicts t+j+2
            for j in range(n_steps):
                labels[j, b, :max(item["n_prompt"] - j - 2, 0)] = -100
        for j, normed in enumerate(module.train_forward(emb, hid, n_steps)):
            valid = labels[j] != -100
            hits[j] += (module.lm_head(normed[valid]).argmax(-1) == labels[j][valid]).sum().item()
            total[j] += valid.sum().item()
    return list(hits / np.maximum(total, 1))


def train_eagle3(args, argv: list[str], data: list[dict], target_state: dict, cfg, out: Path, eos_ids,
                 aux: tuple[int, ...]) -> int:
    """Training-time test over --ttt-steps unrolled draft steps, loss decayed by 0.8 per step."""
    import torch

    identity = {"kind": "eagle3", "draft_vocab": args.draft_vocab, "aux": list(aux), "ttt": args.ttt_steps,
                "train_lm_head": args.train_lm_head}
    resume = load_resume(out, identity)
    draft_ids, t2d = draft_vocab_map(resume, data, cfg.vocab_size, args.draft_vocab, eos_ids)
    hcfg = eagle3.head_config_for(cfg, len(draft_ids), aux)
    module = eagle3.build_module(hcfg, eagle3.init_state(hcfg, target_state, draft_ids, args.seed, feature_std(data)))
    if not args.train_lm_head:  # keep the target's own output rows and final norm: less to overfit
        module.lm_head.weight.requires_grad_(False)
        module.norm.weight.requires_grad_(False)
    embed = target_state["model.embed_tokens.weight"]
    weights = [0.8 ** j for j in range(args.ttt_steps)]
    eval_data, train_data = split(data)

    target_rows = target_state.get("lm_head.weight", embed)[torch.from_numpy(draft_ids)]  # (Vd, H) frozen

    def step_loss(normed, labels, hlast):
        """--loss argmax: cross-entropy on the target's argmax; --loss distribution: cross-entropy on
        the target's own softmax over the draft vocabulary (EAGLE-3's loss; more signal per token).
        Positions whose target argmax is outside the draft vocabulary are left out of both."""
        valid = labels != -100
        log_q_draft = torch.log_softmax(module.lm_head(normed[valid]).float(), dim=-1)   # (M, Vd)
        if args.loss == "argmax":
            return torch.nn.functional.nll_loss(log_q_draft, labels[valid])
        p_target = torch.softmax(hlast[valid] @ target_rows.T, dim=-1)                  # (M, Vd)
        return -(p_target * log_q_draft).sum(-1).mean()

    def batch_loss(items):
        emb, hid, labels, hlast = collate(items, t2d, embed, args.ttt_steps, with_hlast=True)
        outs = module.train_forward(emb, hid, args.ttt_steps)
        return sum(w * step_loss(o, lab, hl) for w, o, lab, hl in zip(weights, outs, labels, hlast)) / sum(weights)

    def evaluate() -> list[float]:
        return answer_agreement(module, eval_data, t2d, embed, args.ttt_steps, args.batch)

    def save_head(extra: dict) -> None:
        eagle3.save_head(out, hcfg, dict(module.state_dict()), draft_ids, dtype=args.dtype, extra=extra)

    return fit(args=args, argv=argv, out=out, kind="eagle3", module=module, identity=identity,
               resume=resume, draft_ids=draft_ids, train_data=train_data, batch_loss=batch_loss,
               evaluate=evaluate, save_head=save_head, n_sequences=len(data))
