"""Speculative greedy output == target-only greedy output, token for token, on real ONNX Runtime
graphs of tiny random models, for every drafter and k in {1, 3, 4, 7}. Every case proves it speculated
(speculated.assert_speculated): verify calls ran and, but for the always-wrong drafter, drafts were accepted."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
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
from tiny import TINY_K_VALUES, Wrapped, run_alone

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
    for prompt in PROMPTS:
        prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=prompt))
        sampling = sampling_for(tiny_engine, name, prompt_ids)
        plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, sampling=sampling)
        spec, spec_finish, stats = run(tiny_engine, prompt_ids, drafters(tiny_engine, self_runner, name), k,
                                       sampling=sampling)
        assert_same(tiny_engine, spec, plain, prompt_ids)
        assert spec_finish == plain_finish
        assert stats.accepted <= stats.drafted == stats.verify_calls * k
        assert_speculated(stats, accepted=name != "wrong", what=f"{name} k={k} prompt={prompt!r}")
        if name == "self":
            assert stats.acceptance_rate > 0.95, stats  # the target drafting for itself
            assert stats.mean_accepted_length > k  # k drafts + the bonus token per verify
        if name == "wrong":
            assert stats.accepted == 0 and stats.mean_accepted_length == 1.0


class Recording(Wrapped):
    """A drafter that keeps every draft its inner drafter proposes (the windows the loop verified)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.drafts, self.asked_at = [], []

    def propose(self, seq, k, sampler):
        draft = self.inner.propose(seq, k, sampler)
        self.asked_at.append(len(seq))
        if draft is not None:
            self.drafts.append(list(draft.tokens))
        return draft


def test_eos_inside_a_draft(tiny_engine, self_runner):
    """The model's 14th greedy token is declared EOS: the self-drafter proposes it inside a verify window,
    with drafts after it for k > 1 (the windows start at tokens 1 + n (k + 1): token 13 is draft 1 of 2, 1 of 4,
    3 of 4, 5 of 7); output must stop right before it, as plain decoding does."""
    prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPTS[0]))
    free, _, _ = run(tiny_engine, prompt_ids, None, 0, max_new=20)
    eos = free[13]
    assert eos not in free[:13]
    plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, eos_ids=(eos,))
    for k in TINY_K_VALUES:
        drafter = Recording(ModelDrafter(self_runner))
        spec, finish, stats = run(tiny_engine, prompt_ids, drafter, k, eos_ids=(eos,))
        assert plain_finish == finish == "eos"
        assert spec == plain == free[:free.index(eos)]
        assert_speculated(stats, what=f"k={k}")
        # the premise: the last verified window drafted the EOS, with drafts after it where the window has room
        assert eos in drafter.drafts[-1], (k, drafter.drafts)
        assert k == 1 or drafter.drafts[-1].index(eos) < k - 1, (k, drafter.drafts)


def stop_across_chunks(engine, prompt_ids: list[int], drafter, k: int) -> tuple[str, int]:
    """(stop, at): the text of tokens of the greedy output from the last of one verify's chunk to one before the
    end of the next chunk (so that chunk has two or more tokens), first occurring at token `at` (the premise of
    test_stop_string_split_across_chunks; the chunks are read from where the drafter was asked)."""
    recording = Recording(drafter)
    ids, _, _ = run_alone(engine.runner, speculative.SlotRequest(
        prompt_ids=prompt_ids, max_new_tokens=30, eos_ids=engine.eos_ids, drafter=recording, k=k))
    starts = [n - len(prompt_ids) for n in recording.asked_at]  # the index of each verify's first new token
    decode = engine.tokenizer.decode
    for a, b in zip(starts, starts[1:]):
        for end in range(a + 1, b):  # the stop ends inside the chunk [a, b), before its last token
            before = decode(ids[:a - 1])
            stop = decode(ids[:end])[len(before):]
            shown = all((c.isprintable() and c != "\ufffd") or c in "\n\t" for c in stop)  # a request's stop
            if stop and shown and decode(ids).find(stop) == len(before) and len(decode(ids[:a])) > len(before):
                return stop, a - 1
    raise AssertionError(f"no chunk of two tokens or more ends a stop string: chunks start at {starts}")


def test_stop_string_split_across_chunks(tiny_engine):
    """A stop string made of the text of three tokens, across the boundary of two verify chunks and completed
    inside the second (chosen per k from the chunks of the run without it): the text and token ids match plain
    decoding, which checks after every token."""
    prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPTS[0]))
    for drafter in ("layerskip",):  # the tiny engine's drafter whose drafts this prompt accepts
        for k in (3, 7):
            stop, at = stop_across_chunks(tiny_engine, prompt_ids, tiny_engine.drafter(drafter), k)
            fields = dict(prompt=PROMPTS[0], max_new_tokens=30, drafter=drafter, k=k, stop=(stop,))
            want = run_one(tiny_engine, GenerateRequest(**fields, speculate=False))
            assert want.finish_reason == "stop" and stop not in want.text
            assert want.text == tiny_engine.tokenizer.decode(want.token_ids[:at])  # the text before the stop
            got = run_one(tiny_engine, GenerateRequest(**fields))
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
            assert_speculated(got.stats, what=f"{drafter} k={k}")


def test_streamed_deltas_concatenate_to_text(tiny_engine):
    deltas: list[str] = []
    counts: list[int] = []
    result = run_one(tiny_engine, GenerateRequest(prompt=PROMPTS[2], max_new_tokens=40),
                                  on_text=lambda delta, n_tokens: (deltas.append(delta), counts.append(n_tokens)))
    assert "".join(deltas) == result.text
    assert counts == sorted(counts) and counts[-1] >= len(result.token_ids)
    assert len(deltas) > 1  # streamed in pieces, not once at the end


def test_context_full_edge(tiny_engine, self_runner):
    """Prompt near the end of the 128-token cache: both paths end with context_full at the same token,
    whether the last verify window fills the cache exactly (k = 1, 4: 10 = 5 x 2 = 2 x 5 rows) or windows stop
    fitting and the loop falls back to plain steps (k = 3, 7)."""
    cache = tiny_engine.target.max_context
    prompt_ids = tiny_engine.tokenizer.encode("the robot moves " * 80)[:cache - 10]
    assert len(prompt_ids) == cache - 10
    plain, plain_finish, _ = run(tiny_engine, prompt_ids, None, 0, max_new=cache - 1)
    assert plain_finish == "context_full"
    assert len(prompt_ids) + len(plain) == cache + 1  # the last token is chosen, never cached
    ends = set()
    for k in TINY_K_VALUES:
        spec, finish, stats = run(tiny_engine, prompt_ids, ModelDrafter(self_runner), k, max_new=cache - 1)
        assert finish == "context_full" and spec == plain
        assert_speculated(stats, what=f"k={k}")
        ends.add("steps" if stats.step_calls else "verify")
        assert stats.step_calls == (0 if 10 % (k + 1) == 0 else 10 % (k + 1)), (k, stats)
    assert ends == {"steps", "verify"}


def test_max_new_tokens_cuts_inside_a_chunk(tiny_engine, self_runner):
    prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPTS[0]))
    plain, _, _ = run(tiny_engine, prompt_ids, None, 0, max_new=11)
    spec, finish, stats = run(tiny_engine, prompt_ids, ModelDrafter(self_runner), 7, max_new=11)
    assert finish == "length" and spec == plain and len(spec) == 11
    assert_speculated(stats)
    # the premise: the first token (prefill) + two fully accepted windows of 7 drafts + bonus = 17 > 11: the
    # second window's chunk was cut after 2 of its 8 tokens
    assert (stats.step_calls, stats.verify_calls, stats.accepted) == (0, 2, 14), stats


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
