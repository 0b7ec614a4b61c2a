"""Exactness at the loop's edges, each with its premise asserted: an EOS and a max_new_tokens cut inside a
verify window (the window's chunk really is cut there), prefix reuse on a following request (the record
holds exactly the rows that were fed; the last prompt token is always prefilled), a grammar-cut draft keeps
its kept tokens' own q rows, and the grammar masks (mask_logits, mask_probs) do what accept_rows relies on.
test_mutations.py breaks each of these lines in the product and requires one of these assertions to fail."""
from __future__ import annotations

import numpy as np
import pytest

from spec_edge.runtime.serving import front_of
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.ort_runner import b1_runner
from spec_edge.runtime.drafters.base import Draft
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.grammar import mask_logits, mask_probs
from spec_edge.runtime.requests import GenerateRequest
from spec_edge.runtime.sampling import Sampler, SamplingParams, probabilities
from spec_edge.runtime.stats import Stats
from speculated import assert_speculated
from tiny import Kept, drain, run_alone

PROMPT = "Move the arm to the left"
K = 7  # the self-drafter is always accepted: chunks of K + 1 tokens


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    """A second runner over the target's own graphs (own cache): a drafter that is the target."""
    return b1_runner(tiny_engine.graph_dir)


def request(engine, prompt_ids, max_new, drafter=None, k=0, eos_ids=(), chunks=None):
    """A greedy SlotRequest; chunks: a list that gets every emitted chunk (after take_chunk's cut)."""
    def emit(chunk):
        chunks.append(list(chunk))
        return False  # no stop string

    sink = Kept(emit=None if chunks is None else emit)
    return speculative.SlotRequest(prompt_ids=prompt_ids, max_new_tokens=max_new, eos_ids=eos_ids, drafter=drafter,
                                   k=k, sink=sink)


def test_eos_and_length_cut_inside_a_verify_window(tiny_engine, self_runner):
    """A token chosen as the second of a multi-token verify chunk is declared EOS, then max_new_tokens ends the
    output right after a chunk's first token: both cut the chunk there (the emitted chunks prove it), and the
    output equals plain decoding's, which meets the same token one step at a time."""
    runner = tiny_engine.runner
    prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPT))
    free_chunks: list = []
    free, _, stats = run_alone(runner, request(tiny_engine, prompt_ids, 40, ModelDrafter(self_runner), K,
                                               chunks=free_chunks))
    assert_speculated(stats)
    # a verify chunk (>= 3 tokens) whose second token does not occur earlier in the output
    start = 0
    for chunk in free_chunks:
        if len(chunk) >= 3 and chunk[1] not in free[:start + 1]:
            break
        start += len(chunk)
    else:
        pytest.fail(f"no verify chunk to cut in {free_chunks}")
    eos = chunk[1]
    plain, plain_finish, _ = run_alone(runner, request(tiny_engine, prompt_ids, 40, eos_ids=(eos,)))
    cut_chunks: list = []
    spec, finish, _ = run_alone(runner, request(tiny_engine, prompt_ids, 40, ModelDrafter(self_runner), K, (eos,),
                                                cut_chunks))
    assert cut_chunks[-1] == chunk[:1], (cut_chunks, chunk)  # the premise: EOS cut the window's chunk after one token
    assert (spec, finish) == (plain, plain_finish) == (free[:start + 1], "eos")

    max_new = start + 1  # ends right after that chunk's first token
    plain, plain_finish, _ = run_alone(runner, request(tiny_engine, prompt_ids, max_new))
    cut_chunks = []
    spec, finish, _ = run_alone(runner, request(tiny_engine, prompt_ids, max_new, ModelDrafter(self_runner), K,
                                                chunks=cut_chunks))
    assert cut_chunks[-1] == chunk[:1], (cut_chunks, chunk)  # the premise: the length cut the window's chunk
    assert (spec, finish) == (plain, plain_finish) == (free[:max_new], "length")


def test_prefix_reuse_equals_cold(tiny_engine, self_runner):
    """With prefix reuse a slot's record is the rows that were fed (the prompt and every output token but the
    last, pending one), so a follow-up request extending the previous prompt + output reuses exactly those
    and a request whose prompt is the record itself still prefills its last token (its logits choose the
    first token); both answer, speculating, what they answer cold without a drafter."""
    runner = tiny_engine.runner
    first_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPT))

    def first():  # a plain request leaves the record first_ids + out[:-1]
        runner.held = [()] * runner.batch
        out, _, _ = run_alone(runner, request(tiny_engine, first_ids, 12), reuse=True)
        return out

    def cold(prompt_ids):
        runner.held = [()] * runner.batch
        out, finish, stats = run_alone(runner, request(tiny_engine, prompt_ids, 24))
        assert stats.prompt_tokens_reused == 0
        return out, finish

    out = first()
    follow_up = first_ids + out + tiny_engine.tokenizer.encode(" and then to the right")
    want = cold(follow_up)
    first()
    got, finish, stats = run_alone(runner, request(tiny_engine, follow_up, 24, ModelDrafter(self_runner), 3), reuse=True)
    assert stats.prompt_tokens_reused == len(first_ids) + len(out) - 1  # the pending last token was never fed
    assert (got, finish) == want
    assert_speculated(stats)

    record = first_ids + out[:-1]
    want = cold(record)
    first()
    exact = request(tiny_engine, record, 24, ModelDrafter(self_runner), 3)
    loop = speculative.BatchLoop(runner, reuse=True)
    slot = loop.add(exact)
    assert loop.slots[slot].stats.prompt_tokens_reused == len(record) - 1  # the last prompt token is prefilled
    drain(loop)
    got, finish, stats = exact.sink.result
    assert (got, finish) == want
    assert_speculated(stats)


def test_cut_draft_keeps_the_kept_drafts_q_rows(tiny_engine):
    """A draft cut at its first token the grammar forbids keeps its first tokens and their own q rows."""
    constraint = tiny_engine.grammars.constraint("regex", r"(pick|place) the box\.")
    allowed = tiny_engine.tokenizer.encode("pick the box.")
    forbidden = int(np.flatnonzero(~constraint.masks(allowed[:2])[-1])[0])
    tokens = allowed[:2] + [forbidden, allowed[2]]
    vocab = tiny_engine.target.vocab_size
    q = np.random.default_rng(0).dirichlet(np.ones(vocab), size=len(tokens))  # (4, V): four different rows
    stats = Stats()
    cut = speculative.cut_draft(Draft(tokens=tokens, q_draft=q), constraint, stats, NgramDrafter())
    assert cut.tokens == tokens[:2] and stats.cut == 2
    np.testing.assert_array_equal(cut.q_draft, q[:2])


def test_sampled_draft_q_rows_are_the_rows_drawn_from(tiny_engine, self_runner):
    """A sampling drafter's q row i is the distribution its draft i was drawn from (the request's sampling applied
    to the drafter's own logits after seq + drafts[:i]): the acceptance rule divides by exactly that row."""
    params = SamplingParams(temperature=0.8, top_k=5)
    prompt_ids = front_of(tiny_engine).prompt_ids(GenerateRequest(prompt=PROMPT))
    drafter = ModelDrafter(self_runner)
    drafter.start(prompt_ids)
    seq = prompt_ids + [prompt_ids[-1]]  # the prompt and a pending token
    draft = drafter.propose(seq, 3, Sampler(params, seed=0))
    drafter.finish()
    reference = b1_runner(tiny_engine.graph_dir)
    logits, rows = reference.prefill(seq, 0), []  # (V,) the row after seq
    for i, token in enumerate(draft.tokens):
        rows.append(probabilities(logits[None], params)[0])
        logits = reference.forward([token], len(seq) + i)[0]
    assert all(row[token] > 0 for row, token in zip(rows, draft.tokens))
    np.testing.assert_allclose(draft.q_draft, np.stack(rows), rtol=1e-4, atol=1e-6)


def test_grammar_masks():
    """mask_logits: each row's forbidden ids -inf, its allowed ids unchanged; mask_probs: each q row restricted to
    its own allowed ids and renormalised, a row with no allowed mass all zero."""
    logits = np.arange(8, dtype=np.float32).reshape(2, 4)  # (T=2, V=4)
    allowed = np.array([[True, False, True, False], [False, True, True, True]])
    np.testing.assert_array_equal(mask_logits(logits, allowed), [[0, -np.inf, 2, -np.inf], [-np.inf, 5, 6, 7]])
    q = np.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    allowed = np.array([[True, False, True, False], [False, True, True, False], [True, True, True, True]])
    np.testing.assert_allclose(mask_probs(q, allowed), [[0.25, 0, 0.75, 0], [0, 0, 0, 0], [0.25, 0.25, 0.25, 0.25]])
