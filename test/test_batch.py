"""Batched graphs (graphs.batch_slots > 1) and the in-flight batching loop on tiny random models,
through real ONNX Runtime graphs: a call over any subset of the
slots == the B=1 graph's rows for those slots bit for bit (padding rows included) with every other
slot's cache bytes untouched, and every request's output == its solo output token for token."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from speculated import assert_speculated

from spec_edge.artifacts import model_graphs
from spec_edge.config import ConfigError
from spec_edge.graphs import export, model as model_mod, plan
from spec_edge.runtime import speculative
from spec_edge.runtime.backends.ort_runner import OrtRunner
from spec_edge.runtime.drafters.draft_model import ModelDrafter
from spec_edge.runtime.drafters.ngram import NgramDrafter
from spec_edge.runtime.sampling import SamplingParams
from tiny import Kept, drain, run_alone, run_together

SLOTS, K = 4, 3  # row counts (2, 3, 4)
PROMPTS = ["Move the arm to the left", "def add(a, b):", "Ünïcödé 🤖 robot robot robot robot",
           "The robot picks up the red box and places it on the shelf. The robot picks up the",
           "Navigate to the kitchen and report the battery level."]


def batch_cfg(tiny_cfg):
    return tiny_cfg.replace(**{"graphs.batch_slots": SLOTS, "graphs.k_values": [K], "speculative.k": K,
                               "speculative.drafter": "ngram"})


@pytest.fixture(scope="module")
def batch_runner(tiny_cfg):
    return OrtRunner(model_graphs(batch_cfg(tiny_cfg), "target", progress=lambda message: None), slots=SLOTS)


@pytest.fixture(scope="module")
def torch_target(tiny_models):
    from spec_edge.graphs import weights

    model_cfg, state, _ = weights.load(str(tiny_models["target"]))
    return model_mod.build(model_cfg, state)


def prompt_ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def filled(runner, engine, prompts) -> list[int]:
    """Prefill each slot with its prompt; returns the positions."""
    ids = [prompt_ids(engine, p) for p in prompts]
    for slot, p in enumerate(ids):
        runner.prefill(slot, p, 0)
    return [len(p) for p in ids]


@pytest.mark.parametrize("rows", [None, (4,)])
def test_subset_calls_equal_b1_rows_and_leave_other_slots_alone(batch_runner, tiny_engine, rows):
    """Every subset of the slots, at the step and verify widths: row j == the B=1 graph's rows for slot
    slots[j] bit for bit (1 row: the B=1 graph; n rows: the n-row graph; rows=(4,): only the 4-row
    graph, so 2 and 3 rows run with padding rows bound to the scratch region), and the cache bytes of
    every slot outside the call stay as they were."""
    single = tiny_engine.target
    rng = np.random.default_rng(1)
    seen = set()
    exported, batch_runner.row_counts = batch_runner.row_counts, rows or batch_runner.row_counts
    try:
        for n in range(1, SLOTS + 1):
            for slots in itertools.combinations(range(SLOTS), n):
                for width in (1, K + 1):
                    positions = filled(batch_runner, tiny_engine, PROMPTS[:SLOTS])
                    k_before, v_before = batch_runner.k_cache.copy(), batch_runner.v_cache.copy()
                    tokens = rng.integers(3, tiny_engine.model_cfg.vocab_size, (n, width))
                    at = [positions[slot] for slot in slots]
                    logits = batch_runner.forward(slots, tokens, at).copy()
                    ids = batch_runner.argmax(slots, tokens, at)  # the same call again: the same rows
                    assert logits.shape == (n, width, tiny_engine.model_cfg.vocab_size)
                    np.testing.assert_array_equal(ids, logits.argmax(-1))
                    seen.add(batch_runner.rows_for(n))
                    for slot in set(range(SLOTS)) - set(slots):
                        assert np.array_equal(batch_runner.k_cache[:, slot], k_before[:, slot]), (slots, slot)
                        assert np.array_equal(batch_runner.v_cache[:, slot], v_before[:, slot]), (slots, slot)
                    for j, slot in enumerate(slots):
                        single.prefill(prompt_ids(tiny_engine, PROMPTS[slot]), 0)
                        np.testing.assert_array_equal(logits[j], single.forward(list(tokens[j]), at[j]),
                                                      err_msg=f"slots {slots} width {width} row {j}")
    finally:
        single.held = ()  # its cache was rewritten here
        batch_runner.row_counts = exported
    assert seen == ({1, 4} if rows else {1, 2, 3, 4})


def solo(runner, engine, request_args):
    """The request alone in the batched loop."""
    return run_together(runner, [speculative.SlotRequest(**request_args())])[0]


def target_only(request_args) -> speculative.SlotRequest:
    """The same request without speculation (plain steps, its own sampling)."""
    args = request_args()
    return speculative.SlotRequest(prompt_ids=args["prompt_ids"], max_new_tokens=args["max_new_tokens"],
                                   eos_ids=args["eos_ids"], sampling=args["sampling"], seed=args["seed"])


def draft_graphs(engine):
    """The graph folder of a draft model whose greedy drafts the tiny target accepts now and then (the
    session's random draft model never agrees with it): test_speculative.truncated_draft_runner's."""
    from test_speculative import truncated_draft_runner

    return truncated_draft_runner(engine).runner.graph_dir


def make_requests(engine, runner, drafter_names, max_news, sampling=SamplingParams(), seeds=None, ks=None,
                  accepted=False):
    """Factories (a drafter keeps state: each run gets a fresh one) for one request per prompt. accepted: greedy
    requests whose drafts are accepted: the draft model is draft_graphs', and a prompt-lookup request favours
    its prompt's last token under penalties (test_request_fields.PENALTIES: lookup drafts its repeats)."""
    from spec_edge.runtime.backends.ort_runner import b1_runner
    from test_request_fields import PENALTIES

    draft_dir = draft_graphs(engine) if accepted else engine.drafter("draft").runner.runner.graph_dir

    def drafter(name):
        if name == "ngram":
            return NgramDrafter()
        if name == "draft":  # a separate model with its own cache: one runner per request
            return ModelDrafter(b1_runner(draft_dir), name="draft")
        return None

    def own_sampling(text, name):
        return PENALTIES(prompt_ids(engine, text)[-1]) if accepted and name == "ngram" else sampling

    factories = []
    for i, (text, name, max_new) in enumerate(zip(PROMPTS, drafter_names, max_news)):
        def args(text=text, name=name, max_new=max_new, i=i, sampling=own_sampling(text, name)):
            return dict(prompt_ids=prompt_ids(engine, text), max_new_tokens=max_new, eos_ids=engine.eos_ids,
                        sampling=sampling, seed=None if seeds is None else seeds[i], drafter=drafter(name),
                        k=K if ks is None else ks[i])
        factories.append(args)
    return factories


def test_each_output_equals_its_solo_output(batch_runner, tiny_engine):
    """Five requests (mixed drafters and lengths) over four slots, two joining mid-stream and one
    reusing a freed slot, so calls run 1 to 4 rows: each == the same request alone, and greedy == B=1
    target-only; each drafting request accepted drafts."""
    names = ["ngram", "draft", None, "ngram", None]
    factories = make_requests(tiny_engine, batch_runner, names, [40, 12, 30, 25, 20], accepted=True)
    calls = dict(batch_runner.calls)
    together = run_together(batch_runner, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 0, 5, 0, 3])
    used = {key for key, count in batch_runner.calls.items() if count > calls.get(key, 0)}
    assert {rows for _, rows in used} == {1, 2, 3, 4}, used
    for name, f, (ids, finish, stats) in zip(names, factories, together):
        alone_ids, alone_finish, _ = solo(batch_runner, tiny_engine, f)
        assert (ids, finish) == (alone_ids, alone_finish)
        plain, plain_finish, _ = run_alone(tiny_engine.runner, target_only(f))
        assert (ids, finish) == (plain, plain_finish)
        if name is not None:
            assert_speculated(stats, what=name)


def test_sampling_stream_is_the_seeds_own(batch_runner, tiny_engine):
    """With sampling each request's tokens depend on its seed only, not on what shares the batch."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    factories = make_requests(tiny_engine, batch_runner, ["ngram", None, "draft"], [20, 20, 20], sampling, [11, 12, 13])
    together = run_together(batch_runner, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 2, 0])
    for f, (ids, _, _) in zip(factories, together):
        assert ids == solo(batch_runner, tiny_engine, f)[0]
    other_seed = make_requests(tiny_engine, batch_runner, ["ngram"], [20], sampling, [99])[0]
    assert solo(batch_runner, tiny_engine, other_seed)[0] != together[0][0]


GUIDED = [("regex", r"(pick|place|move) the (red|blue|green) (box|cup|arm)( slowly| fast)?\."),
          ("json_schema", '{"type": "object", "additionalProperties": false, "required": ["speed"], '
                          '"properties": {"speed": {"type": "integer", "minimum": 0, "maximum": 99}}}')]


def guided_requests(engine, sampling=SamplingParams(), seeds=None):
    """Factories of five requests, each with a fresh grammar state (one matcher per request) where it has
    one: ngram + regex with forced drafts, the draft model + schema, forced drafts alone (no drafter),
    ngram unconstrained, target-only + schema."""
    plan = [("ngram", GUIDED[0], True), ("draft", GUIDED[1], False), (None, GUIDED[0], True),
            ("ngram", None, False), (None, GUIDED[1], False)]
    base = make_requests(engine, None, [name for name, _, _ in plan], [40, 30, 40, 25, 30], sampling, seeds)

    def with_grammar(factory, grammar, forced):
        def args():
            out = factory()
            if grammar is not None:
                out.update(constraint=engine.grammars.constraint(*grammar), forced_drafts=forced)
            return out
        return args
    return [with_grammar(f, grammar, forced) for f, (_, grammar, forced) in zip(base, plan)]


def test_guided_slots_equal_their_b1_output(batch_runner, tiny_engine):
    """Guided decoding per slot: five requests (grammars, forced drafts, drafters mixed) over four slots,
    joining mid-stream: each greedy output == the same request through the B=1 loop (speculative.generate)
    token for token, and the grammar-forced and cut drafts were in play."""
    factories = guided_requests(tiny_engine)
    together = run_together(batch_runner, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 0, 3, 0, 6])
    for f, (ids, finish, stats) in zip(factories, together):
        args = f()
        alone = run_alone(tiny_engine.runner, speculative.SlotRequest(**args))
        assert (ids, finish) == alone[:2]
        assert (stats.forced, stats.cut, stats.verify_calls) == (alone[2].forced, alone[2].cut, alone[2].verify_calls)
    grammar_ends = [finish for f, (_, finish, _) in zip(factories, together) if "constraint" in f()]
    assert grammar_ends == ["eos"] * 4  # every guided output completed its grammar
    assert sum(stats.forced for _, _, stats in together) > 0


def test_guided_sampling_stream_is_the_seeds_own(batch_runner, tiny_engine):
    """Seeded sampling under grammars: each request's tokens in a busy batch == the same request alone."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95)
    factories = guided_requests(tiny_engine, sampling, [21, 22, 23, 24, 25])
    together = run_together(batch_runner, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 2, 0, 4, 1])
    for f, (ids, finish, _) in zip(factories, together):
        assert (ids, finish) == solo(batch_runner, tiny_engine, f)[:2]


def test_cancel_leaves_at_the_iteration_boundary(batch_runner, tiny_engine):
    """A cancelled request leaves at the next iteration boundary and its slot is reused; the others' greedy
    output stays the same."""
    factories = make_requests(tiny_engine, batch_runner, ["ngram", "ngram", "ngram"], [40, 40, 40])
    loop = speculative.BatchLoop(batch_runner)
    requests = [speculative.SlotRequest(**f()) for f in factories]
    for i, request in enumerate(requests):
        request.sink = Kept(cancel=(lambda: "cancelled" if loop.iterations > 4 else None) if i == 0 else None)
    loop.add(requests[0])
    loop.add(requests[1])
    while requests[0].sink.result is None:
        loop.iterate()
    done = {i: request.sink.result for i, request in enumerate(requests)}
    assert done[0][1] == "cancelled" and 0 < len(done[0][0]) < 40
    assert loop.add(requests[2]) == 2  # a slot never taken before the freed one (its record is kept)
    drain(loop)
    done = {i: request.sink.result for i, request in enumerate(requests)}
    for i in (1, 2):
        assert done[i][0] == solo(batch_runner, tiny_engine, factories[i])[0]


def test_batch_slots_config(tiny_cfg):
    with pytest.raises(ConfigError, match="batch_slots"):
        tiny_cfg.replace(**{"graphs.batch_slots": 0})
    with pytest.raises(ConfigError, match="graphs.ort_attention: fused"):
        model_graphs(batch_cfg(tiny_cfg).replace(**{"graphs.ort_attention": "graph"}), "target")
    assert plan.row_counts(1) == () and plan.row_counts(2) == (2,) and plan.row_counts(8) == tuple(range(2, 9))
    assert plan.row_counts(20) == (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20)  # padding < a quarter of a call


@pytest.fixture(scope="module")
def q4_runners(tiny_cfg, tiny_engine, tmp_path_factory):
    """(B slots, B=1) runners over one folder of tiny graphs carried to 4-bit MatMulNBits with int8
    activations (graphs.weights q4: the plan's graphs of m > 1 rows step at width 2)."""
    from spec_edge.artifacts import ensure_packed
    from spec_edge.graphs import ort_attention, plan, quantize
    from spec_edge.runtime.backends.ort_runner import b1_runner
    from test_quantize import _fresh_blocks

    cfg = batch_cfg(tiny_cfg).replace(**{"graphs.weights": "q4"})
    graphs = plan.graph_plan(cfg, "target")
    fused = ort_attention.ensure_fused(export.export_model(cfg, "target", plan.artifact_dir(cfg, "target"),
                                                           progress=lambda m: None), lambda m: None, graphs=graphs)
    folder = quantize.convert_folder(fused, tmp_path_factory.mktemp("q4b") / "q4", _fresh_blocks,
                                     accuracy_level=plan.ACCURACY_LEVELS["q4"], stamp="tiny",
                                     source="tiny blocks", progress=lambda m: None, graphs=graphs)
    ensure_packed(folder, progress=lambda m: None)
    return OrtRunner(folder, slots=SLOTS), b1_runner(folder)


def test_q4_batched_equals_b1_q4(q4_runners, tiny_engine):
    """q4 (int8 activations, where a row's numerics depend on the call's shape): batched steps run as
    two-row calls, so a subset call's step row 0 and verify rows == the B=1 q4 graphs' bit for bit (with
    and without padding rows), and every request in the batch == the B=1 q4 graphs' target-only output."""
    batched, single = q4_runners
    assert batched.step_width == 2
    positions = filled(batched, tiny_engine, PROMPTS[:SLOTS])
    exported = batched.row_counts
    subsets = ((2,), (0, 3), (0, 1, 3), (0, 1, 2, 3))
    for counts, slots, width in itertools.product((exported, (4,)), subsets, (2, K + 1)):
        batched.row_counts = counts
        tokens = np.array([[7 + slot] * width if width == 2 else [7 + slot, 9, 11, 13] for slot in slots])
        at = [positions[slot] for slot in slots]
        logits = batched.forward(slots, tokens, at).copy()
        for j, slot in enumerate(slots):
            single.prefill(prompt_ids(tiny_engine, PROMPTS[slot]), 0)
            rows = 1 if width == 2 else width  # the two-row step: row 0 (the B=1 step graph's one row)
            np.testing.assert_array_equal(logits[j, :rows], single.forward(list(tokens[j, :rows]), at[j]))
        filled(batched, tiny_engine, PROMPTS[:SLOTS])
    batched.row_counts = exported
    names = ["ngram", None, "ngram", None, "ngram"]
    factories = make_requests(tiny_engine, batched, names, [30, 30, 20, 25, 15], accepted=True)
    together = run_together(batched, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 0, 3, 0, 6])
    for name, f, (ids, finish, stats) in zip(names, factories, together):
        plain = run_alone(single.runner, target_only(f))
        assert (ids, finish) == plain[:2]
        if name is not None:
            assert_speculated(stats, what=name)


@pytest.fixture(scope="module")
def policy_runner(tiny_cfg):
    """Batched graphs with verify widths for k = 1, 2, 3 (a profile folder of their own: batch_cfg's folder,
    which later test files share, stays as it is)."""
    cfg = tiny_cfg.replace(**{"graphs.batch_slots": SLOTS, "graphs.k_values": [1, 2, K], "speculative.k": K,
                              "runtime.profile": "tiny-policy"})
    return OrtRunner(model_graphs(cfg, "target", progress=lambda message: None), slots=SLOTS)


def test_a_k_without_its_graph_is_refused_and_the_load_counts_the_queue(batch_runner, policy_runner, tiny_engine):
    """A request is refused as it joins when its k has no verify graph; the load a request joins at is the
    occupied slots + what waits in the caller's queue."""
    from spec_edge.runtime.backends.base import BackendError

    (args,) = make_requests(tiny_engine, batch_runner, ["ngram"], [4], ks=[2])
    with pytest.raises(BackendError, match="k=2"):
        speculative.BatchLoop(batch_runner).add(speculative.SlotRequest(**args()))  # k = 3 only
    loop = speculative.BatchLoop(policy_runner)
    loop.add(speculative.SlotRequest(**make_requests(tiny_engine, policy_runner, ["ngram"], [4])[0]()))
    loop.waiting = 1
    request = speculative.SlotRequest(**make_requests(tiny_engine, policy_runner, ["ngram"], [4])[0]())
    loop.add(request)
    assert loop.load == 3 and request.occupancy == 3


def test_each_slot_verifies_its_own_k(policy_runner, tiny_engine):
    """Requests asking k = 3, 1, 2 and 3 share the batch: each verify call of a slot carries at most its
    own k (its stats count them at that k), and every greedy output == the B=1 target-only output."""
    ks = [K, 1, 2, K]
    names = ["draft", "draft", "draft", "ngram"]
    factories = make_requests(tiny_engine, policy_runner, names, [30, 25, 20, 15], ks=ks, accepted=True)
    together = run_together(policy_runner, [speculative.SlotRequest(**f()) for f in factories],
                                        join_at=[0, 0, 2, 3])
    for name, f, k, (ids, finish, stats) in zip(names, factories, ks, together):
        plain = run_alone(tiny_engine.runner, target_only(f))
        assert (ids, finish) == plain[:2]
        assert_speculated(stats, what=f"{name} k={k}")
        assert stats.k == k and len(stats.verify_calls_by_k) == k and stats.drafted <= k * stats.verify_calls
        if name == "draft":  # a draft model proposes at every iteration
            assert stats.verify_calls_by_k[k - 1] == stats.verify_calls > 0


def test_a_slot_near_its_cache_end_beside_a_wider_verify(policy_runner, tiny_engine):
    """A k=1 request running into the end of its cache beside a k=3 one: its window is never padded past
    the cache (it gets a call of its own there), and both answers == the B=1 target-only output."""
    from spec_edge.runtime.backends.ort_runner import b1_runner

    def draft():
        return ModelDrafter(b1_runner(draft_graphs(tiny_engine)), name="draft")

    long = prompt_ids(tiny_engine, " ".join([PROMPTS[3]] * 6))[:policy_runner.max_context - 12]
    short = prompt_ids(tiny_engine, PROMPTS[0])
    requests = [speculative.SlotRequest(prompt_ids=ids, max_new_tokens=40, eos_ids=(), drafter=draft(), k=k)
                for ids, k in ((long, 1), (short, K))]
    together = run_together(policy_runner, requests)
    assert together[0][1] == "context_full"
    for request, (ids, finish, stats) in zip(requests, together):
        plain = run_alone(tiny_engine.runner, speculative.SlotRequest(
            prompt_ids=request.prompt_ids, max_new_tokens=40, eos_ids=()))
        assert (ids, finish) == plain[:2]
        assert_speculated(stats, what=f"k={request.k}")


def test_call_costs_per_row_count(policy_runner):
    """The one cost measurement (runtime/k_choice.measure_costs, what speculative.k auto weighs) on the batched
    runner: the ms of calls with 1..B rows at every width the runner has."""
    from spec_edge.runtime import k_choice

    costs = k_choice.measure_costs(policy_runner, rounds=2)
    assert sorted(costs.ms) == [(n, w) for n in range(1, SLOTS + 1) for w in sorted(policy_runner.widths)]
    assert all(ms > 0 for ms in costs.ms.values())
