"""spec-edge-train --kind eagle3: an EAGLE-3 head trained with training-time test.

Each batch (collate) is unrolled --ttt-steps draft steps, step j consuming the head's own hidden
state of step j-1, the loss (decayed by 0.8 per step) against the target's own softmax over the
draft vocabulary (--loss distribution, EAGLE-3's) or its argmax (--loss argmax). The held-out score
(answer_agreement, also used by scripts/replay_head.py) is the teacher-forced top-1 agreement per
draft step over the answer positions; the loop is fit.fit. The head's geometry for a target (head_config_for),
its fresh state (init_state) and its unrolled training pass (train_forward) are here; the head's module,
config and folder are spec_edge.heads.eagle3's.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from spec_edge.config import ModelConfig
from spec_edge.graphs.hidden import default_aux_layers
from spec_edge.heads import eagle3
from spec_edge.heads.eagle3 import HeadConfig
from spec_edge_training.data import feature_std
from spec_edge_training.fit import draft_vocab_map, fit, load_resume, split


def head_config_for(target: ModelConfig, draft_vocab_size: int, aux_layers: tuple[int, ...] | None = None,
                    intermediate_size: int | None = None) -> HeadConfig:
    """The geometry spec_edge trains for a target: the target's own attention/MLP shapes."""
    return HeadConfig(
        hidden_size=target.hidden_size, intermediate_size=intermediate_size or target.intermediate_size,
        n_heads=target.n_heads, n_kv_heads=target.n_kv_heads, head_dim=target.head_dim,
        target_hidden_size=target.hidden_size, target_vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size, aux_layers=tuple(aux_layers or default_aux_layers(target.n_layers)),
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_llama3=target.rope_llama3,
        target_layers=target.n_layers)


def init_state(hcfg: HeadConfig, target_state: dict, draft_ids: np.ndarray, seed: int = 0,
               feature_std=None) -> dict:
    """A fresh head: small random layer, lm_head rows and final norm from the target's own head
    (a warm start that already speaks the target's output space), fc starting as the high layer's
    state. feature_std (3Ht,): the spread of each input feature in the training data; fc is scaled
    by its inverse, so a few huge ("massive activation") features do not swamp the rest."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    H, Ht = hcfg.hidden_size, hcfg.target_hidden_size
    q_out, kv_out = hcfg.n_heads * hcfg.head_dim, hcfg.n_kv_heads * hcfg.head_dim

    def rand(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    target_head = target_state.get("lm_head.weight", target_state["model.embed_tokens.weight"])
    inv = torch.ones(3 * Ht) if feature_std is None else 1.0 / torch.as_tensor(feature_std).float().clamp(min=1e-3)
    fc = torch.zeros(H, 3 * Ht)
    fc[:, 2 * Ht:] = torch.eye(H, Ht)  # start from the high layer's state
    fc += rand(H, 3 * Ht, std=0.005)
    fc = fc * inv[None, :]
    return {
        "fc.weight": fc, "norm.weight": target_state["model.norm.weight"].clone(),
        "lm_head.weight": target_head[torch.from_numpy(np.asarray(draft_ids))].clone(),
        "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.input_layernorm.weight": torch.ones(H),
        "midlayer.post_attention_layernorm.weight": torch.ones(H),
        "midlayer.self_attn.q_proj.weight": rand(q_out, 2 * H), "midlayer.self_attn.k_proj.weight": rand(kv_out, 2 * H),
        "midlayer.self_attn.v_proj.weight": rand(kv_out, 2 * H),
        "midlayer.self_attn.o_proj.weight": rand(H, q_out, std=0.02 / math.sqrt(2)),
        "midlayer.mlp.gate_proj.weight": rand(hcfg.intermediate_size, H),
        "midlayer.mlp.up_proj.weight": rand(hcfg.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": rand(H, hcfg.intermediate_size, std=0.02 / math.sqrt(2)),
    }


def train_forward(module, hcfg: HeadConfig, emb_steps, hid3, n_steps: int):
    """The head (eagle3.build_module) over all positions of a batch, n_steps draft steps unrolled
    (training-time test). emb_steps: (n_steps, B, N, H) embeddings of the tokens each step consumes (step j at
    index t consumes token t+j+1); hid3: (B, N, 3Ht). Returns a list of (B, N, Vd) logits,
    step j at index t predicting token t+j+2 (chain t: real pairs <= t, then j own steps)."""
    import torch

    from spec_edge.graphs.model import rotate_half

    attn = module.midlayer.self_attn
    B, N = hid3.shape[:2]
    nh, nkv, hd = hcfg.n_heads, hcfg.n_kv_heads, hcfg.head_dim
    group = nh // nkv
    h = module.fuse(hid3)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    neg = torch.finfo(h.dtype).min
    keys, values, outs = [], [], []
    for j in range(n_steps):
        pos = torch.arange(N, dtype=torch.float32) + j
        freqs = pos[:, None] * module.inv_freq[None, :]
        rot = torch.cat((freqs, freqs), dim=-1)
        cos, sin = rot.cos(), rot.sin()  # (N, D)
        x, residual = module.layer_inputs(emb_steps[j], h)
        q = attn.q_proj(x).view(B, N, nh, hd).transpose(1, 2)    # (B, nh, N, D)
        k = attn.k_proj(x).view(B, N, nkv, hd).transpose(1, 2)   # (B, nkv, N, D)
        v = attn.v_proj(x).view(B, N, nkv, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        keys.append(k)
        values.append(v)
        scale = 1.0 / math.sqrt(hd)
        s0 = torch.matmul(q, keys[0].transpose(-1, -2)) * scale       # (B, nh, N, N)
        s0 = s0.masked_fill(~causal, neg)
        diag = [(q * keys[i]).sum(-1, keepdim=True) * scale for i in range(1, j + 1)]  # (B, nh, N, 1)
        probs = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)
        out = torch.matmul(probs[..., :N], values[0])
        for i in range(1, j + 1):
            out = out + probs[..., N + i - 1:N + i] * values[i]
        out = out.transpose(1, 2).reshape(B, N, nh * hd)
        h = residual + attn.o_proj(out)
        h = h + module.midlayer.mlp(module.midlayer.post_attention_layernorm(h))
        outs.append(module.norm(h))
        if hcfg.norm_output:
            h = outs[-1]
    return outs


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


def answer_agreement(module, hcfg: HeadConfig, items: list[dict], t2d, embed, n_steps: int, batch: int) -> list[float]:
    """Top-1 agreement of an EAGLE-3 head (train_forward) with the target per draft step, over the
    answer positions of items (prompts excluded), teacher-forced."""
    hits, total = np.zeros(n_steps), np.zeros(n_steps)
    for start in range(0, len(items), batch):
        chunk = items[start:start + batch]
        emb, hid, labels = collate(chunk, t2d, embed, n_steps)
        for b, item in enumerate(chunk):  # score the answer only: step j at t predicts t+j+2
            for j in range(n_steps):
                labels[j, b, :max(item["n_prompt"] - j - 2, 0)] = -100
        for j, normed in enumerate(train_forward(module, hcfg, emb, hid, n_steps)):
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
    hcfg = head_config_for(cfg, len(draft_ids), aux)
    module = eagle3.build_module(hcfg, init_state(hcfg, target_state, draft_ids, args.seed, feature_std(data)))
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
        outs = train_forward(module, hcfg, emb, hid, args.ttt_steps)
        return sum(w * step_loss(o, lab, hl) for w, o, lab, hl in zip(weights, outs, labels, hlast)) / sum(weights)

    def evaluate() -> list[float]:
        return answer_agreement(module, hcfg, eval_data, t2d, embed, args.ttt_steps, args.batch)

    def save_head(extra: dict) -> None:
        eagle3.save_head(out, hcfg, dict(module.state_dict()), draft_ids, dtype=args.dtype, extra=extra)

    return fit(args=args, argv=argv, out=out, kind="eagle3", module=module, identity=identity,
               resume=resume, draft_ids=draft_ids, train_data=train_data, batch_loss=batch_loss,
               evaluate=evaluate, save_head=save_head, n_sequences=len(data))
