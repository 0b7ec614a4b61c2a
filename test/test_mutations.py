"""The mutation check: every named mutation of the exactness and sampling rules (test/mutations.py) must
make a fixed set of fast tests fail on an assertion; a mutation that survives, or that only makes a test crash,
fails here by name.

Per mutation, the tests of FAST run in this process, in their order (unit tests first, then the loop's edges,
greedy and guided exactness), with the mutated function installed, until one fails. That failure counts as the
catch only when it is an assertion of a test (AssertionError, pytest.fail, a pytest.raises that did not
raise; not an AssertionError raised inside the product) or the product refusal the mutation lists; any other
exception (a TypeError from a test whose signature drifted from its call here, an IndexError) fails the check
loudly. The catching test must be the mutation's caught_by (docs/testing.md's table is mutations.table()).
The control run: every test of the set passes with no mutation installed. The acceptance-rule mutations must
also fail their loop-level distribution test alone (mutation.loop), without the unit tests before it.
"""
from __future__ import annotations

import inspect
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import test_exactness_edges
import test_guided
import test_request_fields
import test_sampling
import test_speculative
from mutations import MUTATIONS, Mutation, applied, function_of, mutated_function, table

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "testing.md"
PRODUCT = str(ROOT / "spec_edge")


@dataclass(frozen=True)
class Case:
    """One test of the fixed set: its pytest id, the test function and its parametrized arguments (its
    fixtures are looked up by their parameter names: a drifted signature fails by name, not as a catch)."""
    id: str
    test: object
    params: dict = field(default_factory=dict)

    def run(self, request) -> None:
        signature = inspect.signature(self.test)
        unknown = set(self.params) - set(signature.parameters)
        if unknown:
            raise TypeError(f"{self.id}: {self.test.__name__} takes no {sorted(unknown)}: update test_mutations.FAST")
        kwargs = {name: self.params[name] if name in self.params else request.getfixturevalue(name)
                  for name in signature.parameters}
        self.test(**kwargs)


def _greedy(name, k):
    return Case(f"test_speculative.py::test_greedy_speculative_equals_plain[{name}-{k}]",
                test_speculative.test_greedy_speculative_equals_plain, {"name": name, "k": k})


def _guided(name, forced):
    return Case(f"test_guided.py::test_greedy_constrained_speculative_equals_constrained_plain"
                f"[{name}-{'forced' if forced else 'drafted'}]",
                test_guided.test_greedy_constrained_speculative_equals_constrained_plain,
                {"name": name, "forced": forced})


def _loop(name, n):
    return Case(f"test_sampling.py::test_generated_tokens_follow_target_distribution[{name}] n={n}",
                test_sampling.test_generated_tokens_follow_target_distribution, {"drafter_name": name, "n": n})


def _plain(module, test, **params):
    suffix = f"[{'-'.join(str(v) for v in params.values())}]" if params else ""
    return Case(f"{module.__name__}.py::{test.__name__}{suffix}", test, params)


# the fixed set, in the order it is tried (the cheapest first: unit tests, the loop's edges, greedy and guided
# exactness): each test
# in it is the first catcher of some mutation (test_every_mutation_applies_and_is_documented), so the control run
# pays for no test that catches nothing
FAST = [
    _plain(test_sampling, test_sampling.test_top_p_and_top_k_restrict_support),
    _plain(test_sampling, test_sampling.test_temperature_divides_the_logits),
    *[_plain(test_exactness_edges, t) for t in (
        test_exactness_edges.test_grammar_masks, test_exactness_edges.test_cut_draft_keeps_the_kept_drafts_q_rows,
        test_exactness_edges.test_sampled_draft_q_rows_are_the_rows_drawn_from)],
    _plain(test_request_fields, test_request_fields.test_each_row_sees_its_own_history),
    _plain(test_request_fields, test_request_fields.test_min_p_keeps_ids_near_the_top),
    *[_plain(test_sampling, t) for t in (
        test_sampling.test_acceptance_rule_preserves_p_target, test_sampling.test_one_hot_draft_preserves_p_target,
        test_sampling.test_every_draft_accepted_draws_the_bonus_from_row_k)],
    *[_plain(test_exactness_edges, t) for t in (
        test_exactness_edges.test_eos_and_length_cut_inside_a_verify_window,
        test_exactness_edges.test_prefix_reuse_equals_cold)],
    _greedy("layerskip", 4), _greedy("ngram", 4),
    _plain(test_guided, test_guided.test_verify_masks_and_renormalises_the_draft_q),
    _guided("self", False),
]
# the loop-level tests the acceptance-rule mutations must fail alone: tempered-self with CI's 1,200 seeded runs
# (at 600, accept-with-p fails it only just: 49.8 against 46.9), greedy-self with 300 (58.3 against 20.7)
LOOP = [_loop("tempered-self", 1200), _loop("greedy-self", 300)]
BY_ID = {case.id: case for case in FAST + LOOP}


@pytest.fixture(scope="module")
def self_runner(tiny_engine):
    from spec_edge.runtime.backends.ort_runner import b1_runner

    return b1_runner(tiny_engine.graph_dir)


def raised_in_product(err: BaseException) -> bool:
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(PRODUCT)


def is_catch(mutation: Mutation, err: BaseException) -> bool:
    """A test's assertion failed, or the product refused as the mutation lists."""
    if isinstance(err, (AssertionError, pytest.fail.Exception)) and not raised_in_product(err):
        return True
    return bool(mutation.refusal) and re.match(mutation.refusal, f"{type(err).__name__}: {err}") is not None


def first_failure(mutation: Mutation, cases: list[Case], request) -> tuple[str, str] | None:
    """(the id of the first case that fails with the mutation installed, how: the exception's type) when it fails
    on a catch; None when every case passed; any other failure fails the check with the case's traceback."""
    with applied(mutation):
        for case in cases:
            try:
                case.run(request)
            except Exception as err:  # noqa: BLE001 (sorted below: a catch, or a loud failure)
                if not is_catch(mutation, err):
                    raise AssertionError(
                        f"mutation {mutation.name}: {case.id} failed with {type(err).__name__}: {err}, which is not "
                        f"an assertion of the test (a drifted signature, a crash) nor the mutation's listed refusal "
                        f"{mutation.refusal!r}") from err
                return case.id, type(err).__name__
            except pytest.fail.Exception:
                return case.id, "pytest.fail"  # pytest.fail / a pytest.raises that did not raise
            except pytest.skip.Exception as err:
                raise AssertionError(f"{case.id} skipped ({err}): every test of the fixed set must run") from err
    return None


def test_fast_list_passes_without_mutation(request):
    """The control run: with no mutation installed every test of the fixed set (and every loop-level test an
    acceptance-rule mutation names) passes, so a catch below is the mutation's doing."""
    for case in FAST + LOOP:
        case.run(request)


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_mutation_is_caught(mutation, request, record_property):
    started = time.perf_counter()
    caught = first_failure(mutation, FAST, request)
    assert caught is not None, (
        f"mutation {mutation.name} survived ({mutation.breaks}): no test of the fixed set failed with "
        f"{mutation.target} changed from {mutation.old!r} to {mutation.new!r}")
    caught_by, how = caught
    record_property("caught_by", caught_by)
    print(f"\nmutation {mutation.name}: caught by {caught_by} ({how}) in {time.perf_counter() - started:.1f} s")
    assert caught_by == mutation.caught_by, (
        f"mutation {mutation.name} is caught first by {caught_by}, not by {mutation.caught_by} as mutations.py and "
        f"docs/testing.md say: update its caught_by and the table (mutations.table())")


@pytest.mark.parametrize("mutation", [m for m in MUTATIONS if m.loop], ids=[m.name for m in MUTATIONS if m.loop])
def test_acceptance_rule_mutation_fails_the_loop_test_alone(mutation, request):
    """The loop-level chi-square test catches each rule of speculative_accept and sample end to end, alone."""
    started = time.perf_counter()
    caught = first_failure(mutation, [BY_ID[mutation.loop]], request)
    assert caught is not None and caught[0] == mutation.loop, (
        f"mutation {mutation.name} survives {mutation.loop} alone ({mutation.breaks})")
    print(f"\nmutation {mutation.name}: {mutation.loop} fails alone in {time.perf_counter() - started:.1f} s")


def test_every_mutation_applies_and_is_documented():
    """Each snippet is still in the product exactly once, each catcher is in the fixed set (and each test of it a
    catcher), each rule of speculative_accept and sample names its loop-level test, and docs/testing.md holds
    mutations.table()."""
    for mutation in MUTATIONS:
        original, mutant = mutated_function(mutation)
        assert mutant is not original
        assert mutation.caught_by in {case.id for case in FAST}, f"{mutation.name}: {mutation.caught_by} is not in FAST"
        if function_of(mutation) in ("speculative_accept", "sample"):
            assert mutation.loop in {case.id for case in LOOP}, f"{mutation.name}: names no loop-level test"
    assert {case.id for case in FAST} == {m.caught_by for m in MUTATIONS}, "a test of FAST catches no mutation first"
    assert {case.id for case in LOOP} == {m.loop for m in MUTATIONS} - {""}
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS)
    assert table() in DOC.read_text(), f"docs/testing.md's mutation table differs from mutations.table():\n{table()}"


def test_only_an_assertion_or_a_listed_refusal_is_a_catch(request):
    """The harness's own rule, on stand-in tests: an assertion and pytest.fail are catches; a TypeError (a test
    whose signature drifted), an argument the test does not take and an unlisted refusal fail loudly; the
    refusal a mutation lists is a catch."""
    def asserts():
        assert 1 == 2

    def fails():
        pytest.fail("differs")

    def drifted():
        raise TypeError("test() got an unexpected keyword argument 'k'")

    def refuses():
        raise RuntimeError("grammar matcher refused tokens it had allowed: x")

    plain, grammar = MUTATIONS[0], next(m for m in MUTATIONS if m.refusal)
    assert first_failure(plain, [Case("a", asserts)], request) == ("a", "AssertionError")
    assert first_failure(plain, [Case("f", fails)], request) == ("f", "pytest.fail")
    assert first_failure(grammar, [Case("r", refuses)], request) == ("r", "RuntimeError")
    for mutation, case in ((plain, Case("t", drifted)), (plain, Case("p", asserts, {"k": 3})),
                           (plain, Case("r", refuses))):
        with pytest.raises(AssertionError, match="not an assertion of the test"):
            first_failure(mutation, [case], request)
