"""Tiny random-weight Llama-family checkpoints in Hugging Face layout, for fast tests.

A byte-level BPE tokenizer (a few hundred tokens, ChatML specials) is trained in code on a fixed
text, so the folders need no download. Weights are drawn with a fixed seed and scaled up so the
logits are far apart (greedy choices are not near-ties, which would let the different reduction
orders of the step and verify graphs disagree).
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from speculated import assert_speculated
from spec_edge.runtime.scheduler import Scheduler, run_one
from spec_edge.runtime.serving import front_of

CORPUS = [
    "The robot picks up the red box and places it on the shelf.",
    "Move the arm to the left, then open the gripper slowly.",
    "Navigate to the kitchen and report the battery level.",
    "def add(a, b):\n    return a + b\n",
    "Temperature sensors read 21.5 degrees; humidity is 40 percent.",
    "Ünïcödé tëxt and emoji 🤖 keep the byte-level path honest.",
] * 20


def warm(decoder, system_prompt: str = "") -> int:
    """Warm decoder's cache with the system prompt's chat prefix as a door does (Scheduler.warm); its length."""
    import logging

    return Scheduler(decoder, decoder.cfg, logging.getLogger("test"), thread=False).warm(system_prompt)


TINY_K_VALUES = [1, 3, 4, 7]  # verify graphs the session's tiny target is exported with
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def train_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def make_checkpoint(path: Path, *, seed: int, n_layers: int = 4, hidden: int = 64, heads: int = 4,
                    kv_heads: int = 2, inter: int = 128, tie: bool = False, model_type: str = "llama",
                    llama3_rope: bool = False, tokenizer=None, scale: float = 3.0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = tokenizer or train_tokenizer()
    vocab = tok.get_vocab_size()
    head_dim = hidden // heads
    cfg = {"model_type": model_type, "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
           "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": n_layers,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": tie, "hidden_act": "silu",
           "max_position_embeddings": 4096, "bos_token_id": tok.token_to_id("<|im_start|>"),
           "eos_token_id": tok.token_to_id("<|im_end|>"), "_name_or_path": f"tiny-{model_type}-{seed}"}
    if llama3_rope:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (path / "config.json").write_text(json.dumps(cfg))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, std=0.02):
        return torch.randn(*shape, generator=gen) * std

    state = {"model.embed_tokens.weight": rand(vocab, hidden, std=1.0), "model.norm.weight": torch.ones(hidden)}
    for i in range(n_layers):
        pre = f"model.layers.{i}."
        state[pre + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden, std=scale / hidden ** 0.5)
        state[pre + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden, std=scale / hidden ** 0.5)
        state[pre + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden, std=1 / hidden ** 0.5)
        state[pre + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim, std=1 / hidden ** 0.5)
        state[pre + "mlp.gate_proj.weight"] = rand(inter, hidden, std=1 / hidden ** 0.5)
        state[pre + "mlp.up_proj.weight"] = rand(inter, hidden, std=1 / hidden ** 0.5)
        state[pre + "mlp.down_proj.weight"] = rand(hidden, inter, std=1 / inter ** 0.5)
        state[pre + "input_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        state[pre + "post_attention_layernorm.weight"] = 1 + rand(hidden, std=0.1)
        if model_type == "qwen3":
            state[pre + "self_attn.q_norm.weight"] = 1 + rand(head_dim, std=0.1)
            state[pre + "self_attn.k_norm.weight"] = 1 + rand(head_dim, std=0.1)
    if not tie:
        state["lm_head.weight"] = rand(vocab, hidden, std=scale / hidden ** 0.5 * 2)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}))
    return path


# -- helpers the drafter-head tests share (test_eagle3, test_peagle, test_medusa) ------------------

PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the"]
TRAIN_PROMPTS = "Move the arm to the left\nNavigate to the kitchen\ndef add(a, b):\nReport the battery\n"


# the texts the fitted heads are fitted on: what the head tests ask (PROMPTS raw, as assert_greedy_equals_plain and
# test_hybrid encode them; "Move the arm" and test_guided's prompts through the chat template, as requests and
# assert_sampling_follows_target send them), each followed by the target's own greedy answer
FIT_TEXTS = [*PROMPTS, "Navigate to the kitchen", *(
    f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n" for prompt in
    ("Move the arm", "Move the arm to the left", "The robot picks up the red box and places it on the shelf."))]
FIT_NEW_TOKENS = 64
_ANSWERS: dict[str, list[dict]] = {}


@contextmanager
def one_thread():
    """torch on one thread, no autograd: the tiny fits' ops take microseconds, and more threads only spin on
    a shared machine (a 4-layer forward of 80 tokens: 30 ms on one thread, 2 s on two at load 15)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            yield
    finally:
        torch.set_num_threads(threads)


def target_answers(target_dir: Path) -> list[dict]:
    """The tiny target's greedy answers to FIT_TEXTS (FIT_NEW_TOKENS each, past EOS), run in torch from its
    checkpoint: per text tokens (N,) the prompt and answer, hidden (N, (L + 1) * H) every layer's output and
    the final-norm state side by side (graphs.model's hidden_layers 0..L), labels (N,) the target's argmax
    at each position (what it writes next). Cached per folder."""
    key = str(Path(target_dir).resolve())
    if key not in _ANSWERS:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        from spec_edge.graphs import model, weights

        cfg = weights.load(str(target_dir))[0]
        target = model.build(cfg, load_file(str(Path(target_dir) / "model.safetensors")),
                             hidden_layers=tuple(range(cfg.n_layers + 1)))
        tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
        answers = []
        with one_thread():
            for text in FIT_TEXTS:
                ids = tok.encode(text).ids
                k_cache, v_cache = model.empty_cache(cfg, len(ids) + FIT_NEW_TOKENS)  # (L, Hkv, S, D)
                fed = 0
                for _ in range(FIT_NEW_TOKENS):
                    logits, k_new, v_new, _ = target(torch.tensor([ids[fed:]]), torch.tensor([fed]), k_cache,
                                                     v_cache)
                    k_cache[:, :, fed:len(ids)], v_cache[:, :, fed:len(ids)] = k_new, v_new
                    fed = len(ids)
                    ids.append(int(logits[-1].argmax()))
                logits, _, _, hidden = target(torch.tensor([ids]), torch.tensor([0]), *model.empty_cache(cfg, 0))
                answers.append({"tokens": torch.tensor(ids), "hidden": hidden, "labels": logits.argmax(-1)})
        _ANSWERS[key] = answers
    return _ANSWERS[key]


def head_inputs(target_dir: Path, *, seed: int, draft_vocab: int, fitted: bool = False):
    """(target ModelConfig, target tensors, sorted draft vocabulary) to build a head from: a random vocabulary,
    or (fitted) one that holds the tokens the target writes on FIT_TEXTS (as many as fit), the rest random."""
    import numpy as np
    from safetensors.torch import load_file

    from spec_edge.graphs import weights

    target_cfg, _, _ = weights.load(str(target_dir))
    state = load_file(str(target_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    if not fitted:
        return target_cfg, state, np.sort(rng.choice(target_cfg.vocab_size, draft_vocab, replace=False))
    written = np.unique(torch.cat([answer["labels"] for answer in target_answers(target_dir)]).numpy())
    written = written[rng.permutation(len(written))][:draft_vocab]
    rest = np.setdiff1d(np.arange(target_cfg.vocab_size), written)
    return target_cfg, state, np.sort(np.concatenate([written, rng.choice(rest, draft_vocab - len(written),
                                                                            replace=False)]))


def fit_output_layer(features, labels, draft_ids, scale: float = 20.0):
    """(Vd, H) output weights fitted in closed form (ridge least squares) so that features (R, H) map to
    scale x the one-hot of labels (R,) (target ids; rows whose label is outside draft_ids are left out):
    a head whose layers are random still drafts what the target writes on the texts it was fitted on."""
    import numpy as np

    t2d = np.full(int(max(draft_ids.max(), labels.max())) + 1, -1)
    t2d[draft_ids] = np.arange(len(draft_ids))
    rows = t2d[labels.numpy()]
    keep = rows >= 0
    f = features[torch.from_numpy(keep)].double()  # (R', H)
    y = torch.zeros(len(f), len(draft_ids), dtype=torch.float64)
    y[torch.arange(len(f)), torch.from_numpy(rows[keep])] = scale
    gram = f.T @ f
    ridge = 1e-4 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    return torch.linalg.solve(gram + ridge, f.T @ y).T.float().contiguous()  # (Vd, H)


def fitted_eagle3_lm_head(module, hcfg, target_dir: Path, draft_ids):
    """(Vd, H) lm_head weights for an EAGLE-3-style head module (eagle3 / peagle build_module) fitted with
    fit_output_layer on its own first-step features (spec_edge_training.eagle3.train_forward: every pair
    (target hidden at t, token t + 1) of target_answers) to the token the target writes next (t + 2). Row 0 of
    a P-EAGLE draft pass is the same computation, so one fit serves both."""
    from safetensors.torch import load_file

    from spec_edge_training.eagle3 import train_forward

    embed = load_file(str(Path(target_dir) / "model.safetensors"))["model.embed_tokens.weight"]
    H = hcfg.target_hidden_size
    columns = torch.cat([torch.arange(i * H, (i + 1) * H) for i in hcfg.aux_layers])
    features, labels = [], []
    answers = target_answers(target_dir)
    with one_thread():
        for answer in answers:
            tokens, hidden = answer["tokens"], answer["hidden"]
            emb = embed[tokens[1:]][None, None]  # (1 step, B=1, N-1, H)
            features.append(train_forward(module, hcfg, emb, hidden[:-1, columns][None], 1)[0][0])  # (N-1, H)
            labels.append(answer["labels"][1:])
    return fit_output_layer(torch.cat(features), torch.cat(labels), draft_ids)


def plain(engine, prompt_ids, max_new=40):
    """Target-only greedy output."""
    from spec_edge.runtime import speculative

    return run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids))[0]


def assert_greedy_equals_plain(engine, drafter, k: int, prompts=PROMPTS, max_new=40) -> None:
    """Per prompt: greedy speculative output with drafter == target-only output, with drafts accepted."""
    from spec_edge.runtime import speculative

    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt)
        got, _, stats = run_alone(engine.runner, speculative.SlotRequest(
            prompt_ids=ids, max_new_tokens=max_new, eos_ids=engine.eos_ids, drafter=drafter, k=k))
        assert got == plain(engine, ids, max_new), f"k={k} prompt={prompt!r}"
        assert_speculated(stats, what=f"k={k} prompt={prompt!r}")  # the fitted heads' drafts are accepted


def assert_sampling_uses_full_vocab_q(engine, drafter, k: int = 4) -> None:
    """Sampled generation runs, and every draft's q_draft is a (k, V) distribution over the draft
    vocabulary that gives each drafted token a chance."""
    import numpy as np

    from spec_edge.runtime import speculative
    from spec_edge.runtime.sampling import SamplingParams

    seen = []

    class Spy:
        name = "spy"

        def start(self, p):
            drafter.start(p)

        def propose(self, seq, k, sampler):
            draft = drafter.propose(seq, k, sampler)
            if draft is not None:
                seen.append(draft)
            return draft

        def observe(self, a, b):
            pass

        def check_k(self, k):
            drafter.check_k(k)

        def forget(self):
            drafter.forget()

        def finish(self):
            drafter.finish()

    ids = engine.tokenizer.encode("Move the arm")
    out, _, _ = run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=ids, max_new_tokens=30, eos_ids=(), sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=7,
        drafter=Spy(), k=k))
    assert len(out) == 30 and seen
    V = engine.target.vocab_size
    outside = np.setdiff1d(np.arange(V), drafter.draft_ids)
    for draft in seen:
        assert draft.q_draft.shape == (k, V)
        assert np.allclose(draft.q_draft.sum(axis=1), 1.0)
        assert np.all(draft.q_draft[:, outside] == 0)
        for i, token in enumerate(draft.tokens):
            assert draft.q_draft[i, token] > 0


def exported_graphs(engine, role: str, min_tensors: int) -> tuple[Path, dict]:
    """(artifact folder, manifest) of a head's export, every graph in it checked fully static."""
    import onnx

    from spec_edge.graphs import export, plan

    head_dir = plan.artifact_dir(engine.cfg, role)
    manifest = json.loads((head_dir / "manifest.json").read_text())
    for stem in manifest["graphs"]:
        checked, dynamic = export.dynamic_tensors(onnx.load(str(head_dir / f"{stem}.onnx"), load_external_data=False))
        assert checked > min_tensors and not dynamic, stem
    return head_dir, manifest


def ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.use_per_session_threads = False  # the process shares one global pool (OrtRunner)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class FakeHiddenTarget:
    """A target whose hidden-state row p is p in every column (3 columns)."""
    vocab_size = 20

    def hidden_states(self, start, stop):
        import numpy as np

        return np.arange(start, stop, dtype=np.float32)[:, None] * np.ones((1, 3))


def train_draft_argv(tmp_path: Path, tiny_models: dict, out: Path, *extra: str) -> list[str]:
    """spec-edge-train arguments for a few steps on the tiny target (extra: the kind's own)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(TRAIN_PROMPTS)
    return [*extra, "--target", str(tiny_models["target"]), "--out", str(out),
            "--prompts", str(prompts), "--max-new-tokens", "12", "--draft-vocab", "64",
            "--aux-layers", "0", "1", "2", "--batch", "2", "--steps", "3"]


def engine_with(tiny_cfg, settings: dict):
    """An Engine for the session's tiny config with these dotted settings (profile, head, drafter)."""
    from spec_edge import artifacts

    return artifacts.engine(tiny_cfg.replace(**settings), progress=lambda message: None)


def assert_request_equals_plain(engine, drafter: str, k: int) -> None:
    """A greedy request through the engine with the drafter == the same request without speculation."""
    from spec_edge.runtime.requests import GenerateRequest

    spec = run_one(engine, GenerateRequest(prompt="Move the arm", max_new_tokens=30, drafter=drafter, k=k))
    base = run_one(engine, GenerateRequest(prompt="Move the arm", max_new_tokens=30, speculate=False))
    assert spec.token_ids == base.token_ids
    assert spec.stats.drafter == drafter
    assert_speculated(spec.stats, what=drafter)


def assert_same_head(loaded: tuple, reloaded: tuple) -> None:
    """Two loads (config, float32 state, draft ids) of a head are identical."""
    import numpy as np

    (cfg, state, draft_ids), (cfg2, state2, draft_ids2) = loaded, reloaded
    assert cfg2 == cfg and np.array_equal(draft_ids, draft_ids2)
    assert state.keys() == state2.keys()
    for name in state:
        assert torch.equal(state[name], state2[name]), name


def set_config(path: Path, **values) -> None:
    """Overwrite top-level keys of a head folder's config.json."""
    raw = json.loads((path / "config.json").read_text())
    raw.update(values)
    (path / "config.json").write_text(json.dumps(raw))


def assert_misfits_refused(tmp_path: Path, tiny_models: dict, make_head, load_head, hidden_match="hidden size"):
    """load_head refuses a head made for a wider target, one for a deeper target and one whose
    config.json names another vocabulary size. Returns (a head folder that fits, the target's config)."""
    import pytest

    from spec_edge.config import ConfigError
    from spec_edge.graphs import weights

    path, target_cfg = make_head(tmp_path / "h", tiny_models["target"], seed=7, fitted=False)
    wide_head, _ = make_head(tmp_path / "wide_head",
                             make_checkpoint(tmp_path / "wide", seed=9, hidden=96, heads=4, kv_heads=2), fitted=False)
    with pytest.raises(ConfigError, match=hidden_match):
        load_head(wide_head, target_cfg)
    with pytest.raises(ConfigError, match="4-layer target"):
        load_head(path, weights.load(str(make_checkpoint(tmp_path / "deep", seed=9, n_layers=6)))[0])
    set_config(path, vocab_size=999)
    with pytest.raises(ConfigError, match="vocabulary"):
        load_head(path, target_cfg)
    set_config(path, vocab_size=target_cfg.vocab_size)
    return path, target_cfg


def fake_drafter(drafter_class, head):
    """(drafter_class over head and FakeHiddenTarget, started on the prompt [5, 6, 7]; a greedy sampler)."""
    from spec_edge.runtime.sampling import SamplingParams
    from spec_edge.runtime.sampling import Sampler

    drafter = drafter_class(FakeHiddenTarget(), head)
    drafter.start([5, 6, 7])
    return drafter, Sampler(SamplingParams())


def chi2_critical(df: int, z: float = 3.09) -> float:
    """0.999 quantile of chi-square(df), Wilson-Hilferty."""
    import numpy as np

    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson statistic against exact probabilities; cells expected < 5 are pooled."""
    big = [cell for cell, p in probs.items() if p * n >= 5]
    stat = sum((counts.get(cell, 0) - probs[cell] * n) ** 2 / (probs[cell] * n) for cell in big)
    rest_p = 1 - sum(probs[cell] for cell in big)
    rest_count = n - sum(counts.get(cell, 0) for cell in big)
    cells = len(big)
    if rest_p * n >= 1:
        stat += (rest_count - rest_p * n) ** 2 / (rest_p * n)
        cells += 1
    else:
        assert rest_count <= max(2, 5 * rest_p * n), "samples fell on cells of ~zero probability"
    return stat, cells - 1


def exact_first(engine, params, length: int, constraint=None) -> tuple[list[int], dict]:
    """(the prompt ids of "Move the arm", {path: probability}): the exact distribution of the first `length`
    tokens from the target's own graphs, each row processed with its history (sampling.processed_logits) and,
    with constraint (a (kind, text) grammar), masked by the grammar state along the path (a path the grammar
    completes ends there: the loop finishes with eos)."""
    import numpy as np

    from spec_edge.runtime.backends.ort_runner import b1_runner
    from spec_edge.runtime.requests import GenerateRequest
    from spec_edge.runtime.sampling import probabilities, processed_logits

    runner = b1_runner(engine.graph_dir)
    prompt_ids = front_of(engine).prompt_ids(GenerateRequest(prompt="Move the arm"))
    reference = None if constraint is None else engine.grammars.constraint(*constraint)

    def p(logits, generated):  # (V,) logits of the row after prompt + generated
        if reference is not None:
            logits = np.where(reference.masks(list(generated))[-1], logits, -np.inf)
        return probabilities(processed_logits(logits[None], params, prompt_ids, generated), params)[0]

    exact = {}

    def done(path):  # the grammar admits only EOS after path: the loop ends there (finish eos)
        if constraint is None:
            return False
        state = engine.grammars.constraint(*constraint)
        state.consume(path)
        return state.done

    def walk(path, prob, logits):
        row = p(logits, path)
        for token in np.flatnonzero(row):
            longer = path + [int(token)]
            if len(longer) == length or done(longer):
                exact[tuple(longer)] = prob * row[token]
            else:
                walk(longer, prob * row[token], runner.forward([int(token)], len(prompt_ids) + len(path))[0])

    walk([], 1.0, runner.prefill(prompt_ids, 0))
    assert abs(sum(exact.values()) - 1) < 1e-6
    return prompt_ids, exact


def assert_sampling_follows_target(engine, drafter, must_accept: bool = True, n: int = 1200, k: int = 3,
                                   params=None, length: int | None = None, constraint=None) -> list:
    """Speculative sampling with `drafter` keeps the target's distribution: the exact distribution of the
    first `length` tokens (default k + 2: a window of k accepted drafts is followed by its bonus token
    inside them; the default top_k=2 keeps the cells few; exact_first) vs n seeded runs through the real
    loop, chi-square below its 0.999 quantile (seeds fixed). The runs must speculate and (must_accept, the
    default) have drafts accepted (assert_speculated). Returns the runs' stats."""
    from spec_edge.runtime import speculative
    from spec_edge.runtime.sampling import SamplingParams

    params = params or SamplingParams(temperature=1.0, top_k=2)
    length = length or k + 2
    prompt_ids, exact = exact_first(engine, params, length, constraint)
    counts: dict = {}
    runs = []
    for seed in range(n):
        ids, _, stats = run_alone(engine.runner, speculative.SlotRequest(
            prompt_ids=prompt_ids, max_new_tokens=length, eos_ids=(), sampling=params, seed=seed, drafter=drafter, k=k,
            constraint=None if constraint is None else engine.grammars.constraint(*constraint)))
        counts[tuple(ids)] = counts.get(tuple(ids), 0) + 1
        runs.append(stats)
    assert_speculated(*runs, accepted=must_accept)
    stat, df = chi2_statistic(counts, exact, n)
    assert stat < chi2_critical(df), (stat, df, sorted(counts.items(), key=lambda kv: -kv[1])[:5])
    return runs


class Kept:
    """A speculative.SlotSink that keeps its request's (token ids, finish reason, stats) in result; cancel() and
    emit(chunk) as a SlotSink's, when given (the loop-level tests' sink)."""

    def __init__(self, cancel=None, emit=None):
        self._cancel, self._emit = cancel, emit
        self.result = None

    def drafter(self, slot):
        return None

    def emit(self, chunk):
        return self._emit is not None and self._emit(chunk)

    def cancel_reason(self):
        return self._cancel() if self._cancel is not None else None

    def done(self, request, token_ids, finish, stats):
        self.result = (token_ids, finish, stats)


def drain(loop) -> None:
    """Iterate a bare speculative.BatchLoop (the loop-level tests: their own drafter objects, slot placement)
    until every slot has left; a request through an engine goes through the scheduler (run_one,
    serve_together), the one driver of a decoder."""
    while loop.occupied:
        loop.iterate()


def serve_together(decoder, requests) -> list:
    """GenerateRequests submitted at once to one Scheduler over decoder, stepped in this thread as run_one
    steps it (admitted first in first out while the decoder has room): the GenerateResult per request (a
    refusal or failure raises)."""
    import logging

    from spec_edge.runtime.scheduler import Job, Scheduler

    scheduler = Scheduler(decoder, decoder.cfg, logging.getLogger("spec_edge"), thread=False)
    jobs = [Job(request) for request in requests]
    for job in jobs:
        scheduler.submit(job)
    while not all(job.done.is_set() for job in jobs):
        scheduler._step()
    for job in jobs:
        if job.error is not None:
            raise job.error
    return [job.result for job in jobs]


def run_together(runner, requests, join_at=None, reuse=False) -> list:
    """SlotRequests through one speculative.BatchLoop over runner, request i joining at iteration join_at[i]
    (default 0) or as soon as a slot is free after it: (token ids, finish reason, stats) per request."""
    from spec_edge.runtime import speculative

    join_at = join_at or [0] * len(requests)
    loop = speculative.BatchLoop(runner, reuse=reuse)
    waiting = sorted(range(len(requests)), key=lambda i: join_at[i])
    for request in requests:
        request.sink = request.sink or Kept()
    while waiting or loop.occupied:
        while waiting and join_at[waiting[0]] <= loop.iterations and loop.free:
            loop.add(requests[waiting.pop(0)])
        loop.iterate()
    return [request.sink.result for request in requests]


def run_alone(runner, request, reuse=False):
    """One SlotRequest alone in slot 0 of a new loop over runner: (token ids, finish reason, stats)."""
    return run_together(runner, [request], reuse=reuse)[0]


class Collect:
    """A serving.Sink that keeps its request's result (or failure)."""

    def __init__(self):
        self.result, self.error = None, None

    def on_text(self, delta: str, n_tokens: int) -> None:
        pass

    def cancel_reason(self) -> str | None:
        return None

    def done(self, result) -> None:
        self.result = result

    def failed(self, err: Exception) -> None:
        self.error = err


class Wrapped:
    """A drafter that hands every call to its inner drafter: tests subclass it to watch propose / observe."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def propose(self, seq, k, sampler):
        return self.inner.propose(seq, k, sampler)

    def observe(self, n_proposed, n_accepted):
        self.inner.observe(n_proposed, n_accepted)

    def check_k(self, k):
        self.inner.check_k(k)

    def forget(self):
        self.inner.forget()

    def finish(self):
        self.inner.finish()
