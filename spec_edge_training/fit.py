"""The training loop every kind of spec-edge-train shares (eagle3, medusa, peagle, draft).

AdamW, warm-up then cosine learning rate, gradient clipping, a progress bar on stderr, bounded by
--steps and --time-budget; every --save-every steps the held-out score is measured and the head
folder keeps the best checkpoint; <out>/train_state.pt (module, optimizer, step, draft vocabulary)
makes a rerun with the same --out and the same head shape resume. The kind-specific code
(eagle3.py, medusa.py, peagle.py, draft_model.py) supplies the module, the loss of a batch, the
held-out evaluation (top-1 agreement per draft position) and how to save the head. Also here:
the resume state, the draft vocabulary map, the held-out split, and the scores of a head's
per-position agreements (expected_length) and of its chain predictions (replay_chain).
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spec_edge_training.data import batches, draft_vocabulary, log


def load_resume(out: Path, identity: dict) -> dict | None:
    """The saved training state of the same kind and shape, or None (start fresh)."""
    import torch

    path = Path(out) / "train_state.pt"
    if not path.is_file():
        return None
    saved = torch.load(str(path), weights_only=False)
    if saved.get("identity") != identity:
        log(f"[spec-edge-train] {path} is for {saved.get('identity')}, not {identity}: starting fresh")
        return None
    return saved


def draft_vocab_map(resume: dict | None, data: list[dict], vocab_size: int, draft_vocab: int, eos_ids):
    """(draft_ids (Vd,) draft id -> target id, t2d (V,) long tensor target id -> draft id or -100):
    the resumed run's draft vocabulary, else the most frequent tokens of the target's answers."""
    import torch

    draft_ids = (np.asarray(resume["draft_ids"]) if resume is not None
                 else draft_vocabulary(data, vocab_size, draft_vocab, eos_ids))
    t2d = torch.full((vocab_size,), -100, dtype=torch.long)
    t2d[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    return draft_ids, t2d


def split(data: list[dict]) -> tuple[list[dict], list[dict]]:
    """(held-out, training) sequences: the first tenth is held out, at most 120 sequences (scoring
    more would only slow the checkpoints; every other answer trains)."""
    n_eval = max(1, min(len(data) // 10, 120))
    return data[:n_eval], data[n_eval:] or data


def expected_length(accuracy: list[float]) -> float:
    """Accepted drafts per verify if the per-position agreements were independent: the score the
    head folder keeps the best checkpoint by."""
    total, run = 0.0, 1.0
    for a in accuracy:
        run *= a
        total += run
    return total


def replay_chain(chain_preds: list, tokens, n_prompt: int, k: int) -> tuple[int, int]:
    """The live greedy loop replayed offline on one target answer: (verify calls, tokens they emitted).

    chain_preds[j][t]: the head's draft j+1 when the newest verified pair is t (it predicts token
    t + j + 2; train_forward's step j, target ids); tokens (N,): the prompt and the target's answer.
    From the pair before the first answer token, draft k, keep the agreeing prefix plus the target's
    own token, move on. Unlike expected_length this starts each chain where the last one failed,
    as the live loop does (hard positions come first), so it predicts the live mean accepted length."""
    n_tokens, t = len(tokens), n_prompt - 1
    calls = emitted = 0
    while t + 2 < n_tokens:
        n_accepted = 0
        while (n_accepted < k and t + n_accepted + 2 < n_tokens
               and int(chain_preds[n_accepted][t]) == int(tokens[t + n_accepted + 2])):
            n_accepted += 1
        calls += 1
        emitted += min(n_accepted + 1, n_tokens - t - 2)  # no own token after the answer's last
        t += n_accepted + 1
    return calls, emitted


def fit(*, args, argv: list[str], out: Path, kind: str, module, identity: dict, resume: dict | None,
        draft_ids: np.ndarray, train_data: list[dict], batch_loss: Callable, evaluate: Callable[[], list[float]],
        save_head: Callable[[dict], None], n_sequences: int) -> int:
    import torch
    from tqdm import tqdm

    out = Path(out)
    state_path = out / "train_state.pt"
    params = [p for p in module.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    step = 0
    best = [-1.0, 0]  # held-out score and the step of the checkpoint in the head folder
    if resume is not None:
        module.load_state_dict(resume["module"])
        optim.load_state_dict(resume["optim"])
        step = resume["step"]
        best = list(resume.get("best", best))
        log(f"[spec-edge-train] resuming {state_path} at step {step}")
    module.train()
    rng = np.random.default_rng(args.seed + step)
    stream = batches(train_data, min(args.batch, len(train_data)), rng)

    def save_state() -> None:
        torch.save({"identity": identity, "module": module.state_dict(), "optim": optim.state_dict(),
                    "step": step, "draft_ids": draft_ids, "best": best}, str(state_path))

    def save() -> None:
        save_head({"trained_steps": step, "train_prompts": args.prompts, "target": args.target,
                   "command": "spec-edge-train " + " ".join(argv)})
        save_state()

    def score() -> tuple[list[float], float]:
        module.eval()
        with torch.no_grad():
            accuracy = evaluate()
        module.train()
        return accuracy, expected_length(accuracy)

    started = time.monotonic()
    bar = tqdm(total=args.steps, initial=step, desc=f"[spec-edge-train] {kind}", unit="step", file=sys.stderr)
    loss_avg = None
    while step < args.steps and time.monotonic() - started < args.time_budget:
        loss = batch_loss(next(stream))
        # warm-up, then a cosine to a tenth of --lr at whichever bound ends this run first
        progress = min(max(step / args.steps, (time.monotonic() - started) / args.time_budget), 1.0)
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optim.param_groups:
            group["lr"] = lr
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.95 * loss_avg + 0.05 * loss.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_avg:.3f}")
        if step % args.save_every == 0:
            accuracy, value = score()
            if value >= best[0]:  # the head folder keeps the best checkpoint on held-out answers
                best[:] = [value, step]
                save()
            else:
                save_state()
            bar.write(f"[spec-edge-train] step {step}: held-out agreement per draft position "
                      + ", ".join(f"{a:.2f}" for a in accuracy)
                      + f" (expected accepted {value:.2f}; best {best[0]:.2f} at step {best[1]})", file=sys.stderr)
    bar.close()
    accuracy, value = score()
    log(f"[spec-edge-train] step {step}: held-out top-1 agreement with the target per draft position: "
        + ", ".join(f"{a:.2f}" for a in accuracy) + f" (expected accepted {value:.2f})")
    if value >= best[0]:
        best[:] = [value, step]
        save()
        log(f"[spec-edge-train] saved {kind} head after {step} steps to {out}")
    else:
        save_state()
        log(f"[spec-edge-train] kept the checkpoint of step {best[1]} (expected accepted {best[0]:.2f})")
    (out / "train_log.json").write_text(json.dumps({
        "kind": kind, "step": step, "eval_top1_per_position": accuracy,
        "train_seconds_this_run": round(time.monotonic() - started, 1), "kept_step": best[1],
        "kept_expected_accepted": best[0], "sequences": n_sequences}, indent=1))
    return 0
