"""Speculative greedy output == target-only greedy output, token for token, on real ONNX Runtime
graphs of tiny random models, for every drafter and k in {1, 3, 4, 7}. Every case proves it speculated
(speculated.assert_speculated): verify calls ran and, but for the always-wrong drafter, drafts were accepted."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spec_edge.runtime import speculative
from spec_edge.runtime.backends.ort_runner import b1_runner
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.scheduler import run_one
from speculated import assert_speculated
from test_request_fields import PENALTIES
from tiny import TINY_K_VALUES, run_alone

PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the"]


def margin_note(runner, seq: list[int], at: int) -> str:
    """Top-2 logit margin of the target at the first differing position: ~1e-5 is numerics."""
    logits = runner.prefill(seq[:at], 0)  # the target's logits for the token at index `at`
    top2 = np.sort(logits)[-2:]
    return f"first difference at token {at}; target top-2 margin there {top2[1] - top2[0]:.2e}"


def assert_same(engine, spec_ids, plain_ids, prompt_ids):
    if spec_ids != plain_ids:
        at = next(i for i, (a, b) in enumerate(zip(spec_ids + [-1], plain_ids + [-2])) if a != b)
        note = margin_note(engine.target, prompt_ids + plain_ids, len(prompt_ids) + at)
        pytest.fail(f"speculative != plain: {note}\nspec  {spec_ids}\nplain {plain_ids}")


class WrongDrafter:
    """Proposes the target's own greedy token + 1: never accepted (acceptance exactly 0)."""
    name = "always-wrong"

    def __init__(self, runner):
        self.inner = ModelDrafter(runner)

    def start(self, prompt_ids):
        self.inner.start(prompt_ids)

    def propose(self, seq, k, sampler):
        draft = self.inner.propose(seq, k, sampler)
        if draft is None:  # no room left for a verify window
            return None
        vocab = self.inner.runner.vocab_size
        return Draft(tokens=[(t + 1) % vocab for t in draft.tokens], q_draft=None)

    def observe(self, n_proposed, n_accepted):
        pass

    def check_k(self, k):
        pass

    def forget(self):
        self.inner.forget()

    def finish(self):
        self.inner.finish()


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    """A second runner over the target's own graphs (own cache): a drafter that is the target."""
    return b1_runner(tiny_engine.graph_dir)


def run(engine, prompt_ids, drafter, k, max_new=40, eos_ids=None, sampling=SamplingParams()):
    return run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=engine.eos_ids if eos_ids is None else eos_ids,
        drafter=drafter, k=k, sampling=sampling))


_TRUNCATED: dict = {}  # target folder -> the truncated draft's runner


def truncated_draft_runner(engine):
    """A draft model of its own (own checkpoint, export and cache) for engine's tiny target: its embedding,
    first two layers, final norm and head, so its greedy drafts agree with the target's now and then (a random
    draft model never does). Exported once per target through the product's draft-model path, with the
    engine's own graph settings."""
    from safetensors.torch import load_file, save_file

    from spec_edge.graphs import export, plan
    from spec_edge.artifacts import ort_graphs

    target = Path(engine.cfg.model.target)
    if str(target) not in _TRUNCATED:
        path = target.parent / "truncated_draft"
        if not path.exists():
            shutil.copytree(target, path)
            cfg = json.loads((target / "config.json").read_text())
            cfg.update(num_hidden_layers=2, _name_or_path="tiny-truncated-draft")
            (path / "config.json").write_text(json.dumps(cfg))
            state = load_file(str(target / "model.safetensors"))
            save_file({name: tensor for name, tensor in state.items() if not name.startswith("model.layers.")
                       or int(name.split(".")[2]) < 2}, str(path / "model.safetensors"))
        cfg = engine.cfg.replace(**{"model.draft": str(path),
                                    "runtime.profile": f"{engine.cfg.runtime.profile}-truncated-draft"})
        draft_dir = export.export_model(cfg, "draft", plan.artifact_dir(cfg, "draft"), lambda message: None)
        _TRUNCATED[str(target)] = b1_runner(ort_graphs(cfg, "draft", draft_dir, lambda message: None))
    return _TRUNCATED[str(target)]


def drafters(engine, self_runner, name):
    if name == "ngram":
        return NgramDrafter()
    if name == "draft":
        return ModelDrafter(truncated_draft_runner(engine))
    if name == "layerskip":
        return engine.drafter("layerskip")
    if name == "self":
        return ModelDrafter(self_runner, name="self")
    if name == "wrong":
        return WrongDrafter(self_runner)
    raise AssertionError(name)


def sampling_for(engine, name, prompt_ids):
    """Greedy; for prompt lookup, a favoured token (the plain output's first) with penalties, so the output
    repeats it until the penalties outweigh its bias: lookup drafts the repeats (a random target never
    repeats itself) and the row where the output moves on is rejected."""
    if name != "ngram":
        return SamplingParams()
    return PENALTIES(run(engine, prompt_ids, None, 0, max_new=1)[0][0])


@pytest.mark.parametrize("k", TINY_K_VALUES)
@pytest.mark.parametrize("name", ["ngram", "draft", "layerskip", "self", "wrong"])
def test_greedy_speculative_equals_plain(tiny_engine, self_runner, name, k):
    runs = []
    for prompt in PROMPTS:
        prompt_ids = tiny_engine.front.prompt_ids(GenerateRequest(prompt=prompt))
        sampling = sampling_for(tiny_engine, name, prompt_ids)
        plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, sampling=sampling)
        spec, spec_finish, stats = run(tiny_engine, prompt_ids, drafters(tiny_engine, self_runner, name), k,
                                       sampling=sampling)
        assert_same(tiny_engine, spec, plain, prompt_ids)
        assert spec_finish == plain_finish
        assert stats.accepted <= stats.drafted == stats.verify_calls * k
        runs.append(stats)
        if name == "self":
            assert stats.acceptance_rate > 0.95, stats  # the target drafting for itself
            assert stats.mean_accepted_length > k  # k drafts + the bonus token per verify
        if name == "wrong":
            assert stats.accepted == 0 and stats.mean_accepted_length == 1.0
    assert_speculated(*runs, accepted=name != "wrong", what=f"{name} k={k}")


def test_eos_inside_a_draft(tiny_engine, self_runner):
    """The model's 7th greedy token is declared EOS: the self-drafter proposes it in the middle of
    a draft window; output must stop right before it, as plain decoding does."""
    prompt_ids = tiny_engine.front.prompt_ids(GenerateRequest(prompt=PROMPTS[0]))
    free, _, _ = run(tiny_engine, prompt_ids, None, 0, max_new=20)
    eos = free[6]
    plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, eos_ids=(eos,))
    for k in TINY_K_VALUES:
        spec, finish, stats = run(tiny_engine, prompt_ids, ModelDrafter(self_runner), k, eos_ids=(eos,))
        assert plain_finish == finish == "eos"
        assert spec == plain == free[:free.index(eos)]


def test_stop_string_split_across_chunks(tiny_engine):
    """A stop string made of text from several tokens (so several accepted chunks): the text and
    token ids match plain decoding, which checks after every token."""
    plain = run_one(tiny_engine, GenerateRequest(prompt=PROMPTS[1], speculate=False, max_new_tokens=30))
    ids = plain.token_ids
    text = tiny_engine.tokenizer.decode(ids[:12])
    # 4 printable characters ending as late as possible in the first 12 tokens' text
    stop = next(text[end - 4:end] for end in range(len(text), 3, -1)
                if all(c.isprintable() and c != "\ufffd" for c in text[end - 4:end]))
    assert len(tiny_engine.tokenizer.decode(ids[:3])) < plain.text.find(stop) + len(stop)
    base = GenerateRequest(prompt=PROMPTS[1], max_new_tokens=30, stop=(stop,))
    want = run_one(tiny_engine, base.__class__(**{**base.__dict__, "speculate": False}))
    assert want.finish_reason == "stop" and stop not in want.text
    for drafter in ("draft", "layerskip"):
        for k in (3, 7):
            got = run_one(tiny_engine, GenerateRequest(**{**base.__dict__, "drafter": drafter, "k": k}))
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)


def test_streamed_deltas_concatenate_to_text(tiny_engine):
    deltas: list[str] = []
    counts: list[int] = []
    result = run_one(tiny_engine, GenerateRequest(prompt=PROMPTS[2], max_new_tokens=40),
                                  on_text=lambda delta, n_tokens: (deltas.append(delta), counts.append(n_tokens)))
    assert "".join(deltas) == result.text
    assert counts == sorted(counts) and counts[-1] >= len(result.token_ids)
    assert len(deltas) > 1  # streamed in pieces, not once at the end


def test_context_full_edge(tiny_engine, self_runner):
    """Prompt near the end of the 128-token cache: verify windows stop fitting, the loop falls back
    to plain steps and both paths end with context_full at the same token."""
    cache = tiny_engine.target.max_context
    prompt_ids = tiny_engine.tokenizer.encode("the robot moves " * 80)[:cache - 10]
    assert len(prompt_ids) == cache - 10
    plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, max_new=cache - 1)
    assert plain_finish == "context_full"
    assert len(prompt_ids) + len(plain) == cache + 1  # the last token is chosen, never cached
    for k in TINY_K_VALUES:
        spec, finish, _ = run(tiny_engine, prompt_ids, ModelDrafter(self_runner), k, max_new=cache - 1)
        assert finish == "context_full" and spec == plain


def test_max_new_tokens_cuts_inside_a_chunk(tiny_engine, self_runner):
    prompt_ids = tiny_engine.front.prompt_ids(GenerateRequest(prompt=PROMPTS[0]))
    plain, _, _ = run(tiny_engine, prompt_ids, None, 0, max_new=11)
    spec, finish, stats = run(tiny_engine, prompt_ids, ModelDrafter(self_runner), 7, max_new=11)
    assert finish == "length" and spec == plain and len(spec) == 11


def test_stats_are_filled(tiny_engine):
    result = run_one(tiny_engine, GenerateRequest(prompt=PROMPTS[0], drafter="layerskip", k=3, max_new_tokens=30))
    s = result.stats
    assert s.drafter == "layerskip2" and s.k == 3 and s.prompt_tokens > 0
    assert s.new_tokens == len(result.token_ids)
    assert s.tokens_per_s > 0 and s.time_to_first_token_s > 0 and s.target_time_s > 0 and s.draft_time_s > 0
    assert len(s.acceptance_per_position) == 3
    assert_speculated(s)
    # every token after the first (the prefill's) came from a step or a verify call: 1 per step, accepted + 1
    # per verify, less what max_new_tokens cut from the last chunk
    assert s.step_calls + s.verify_calls + s.accepted >= s.new_tokens - 1 >= s.step_calls + s.verify_calls
    d = s.as_dict()
    for key in ("drafted", "accepted", "acceptance_rate", "mean_accepted_length", "tokens_per_s",
                "time_to_first_token_s", "acceptance_per_position"):
        assert key in d
