"""Named one-line mutations of the rules exactness and the sampling distribution rest on.

Each Mutation replaces one exact snippet of one product function's source (spec_edge/runtime/sampling.py,
the accept / window / grammar parts of spec_edge/runtime/speculative.py) and applied() installs the mutated
function in place of the original: in its module and wherever it was imported by name (speculative.py's
`from spec_edge.runtime.sampling import ...`, the test modules'). The snippet must occur exactly once, so a
product change that moves the code fails the check by name ("no longer applies") instead of letting a
mutation silently test nothing. test_mutations.py runs a fixed set of fast tests per mutation: the first that
fails must fail on an assertion (or on the product refusal the mutation lists) and be the test the mutation
names (caught_by); an acceptance-rule mutation must also fail its loop-level distribution test alone (loop).
docs/testing.md's table is table() below, checked equal.

Why not mutmut / cosmic-ray: they mutate files on disk and rerun a test command per mutant (a fresh process
that exports the tiny models again, ~20 s each on 2 cores, before any test runs), generate hundreds of
mutants of lines that do not bear on exactness (messages, stats, timing), and are not in the venv. These
named mutations run in the test session's own process over its already exported tiny engine.
"""
from __future__ import annotations

import __future__
import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    target: str     # "module:function" or "module:Class.method"
    old: str        # a snippet of the function's source, found exactly once
    new: str
    breaks: str     # what goes wrong, in words
    caught_by: str  # the pytest id of the first test of test_mutations' fixed set that fails with it installed
    refusal: str = ""  # the product's own refusal that also counts as the catch ("Type: message" prefix regex)
    loop: str = ""     # the loop-level distribution test that must fail with it alone (the acceptance rule)


S, L = "spec_edge.runtime.sampling", "spec_edge.runtime.speculative"
G, D = "spec_edge.runtime.grammar", "spec_edge.runtime.drafters.base"
REFUSED = r"RuntimeError: grammar matcher refused tokens it had allowed"  # grammar.Constraint.consume
UNIT = "test_sampling.py::test_acceptance_rule_preserves_p_target"
TEMPERED = "test_sampling.py::test_generated_tokens_follow_target_distribution[tempered-self] n=1200"
GREEDY_SELF = "test_sampling.py::test_generated_tokens_follow_target_distribution[greedy-self] n=300"
GUIDED_SELF = "test_guided.py::test_greedy_constrained_speculative_equals_constrained_plain[self-drafted]"
HISTORY = "test_request_fields.py::test_each_row_sees_its_own_history"
EDGES = "test_exactness_edges.py::"

MUTATIONS = [
    # -- speculative sampling's acceptance rule (sampling.speculative_accept) --
    Mutation("bonus-from-row-k-1", f"{S}:speculative_accept", "return k, sample(p_target[k], rng)",
             "return k, sample(p_target[k - 1], rng)", "a fully accepted window's bonus token drawn from the last "
             "draft's row", "test_sampling.py::test_every_draft_accepted_draws_the_bonus_from_row_k", loop=TEMPERED),
    Mutation("residual-is-p", f"{S}:speculative_accept", "residual = np.maximum(p_target[i] - q_draft[i], 0.0)",
             "residual = p_target[i].copy()", "a rejected sampled draft resampled from p, not max(0, p - q)", UNIT,
             loop=TEMPERED),
    Mutation("residual-is-q-minus-p", f"{S}:speculative_accept",
             "residual = np.maximum(p_target[i] - q_draft[i], 0.0)", "residual = np.maximum(q_draft[i] - p_target[i], 0.0)",
             "the residual's sides swapped", UNIT, loop=TEMPERED),
    Mutation("one-hot-residual-keeps-draft", f"{S}:speculative_accept", "residual[draft] = 0.0", "pass",
             "a rejected deterministic draft can be drawn again",
             "test_sampling.py::test_one_hot_draft_preserves_p_target", loop=GREEDY_SELF),
    Mutation("accept-with-p", f"{S}:speculative_accept", "rng.random() * q_x < p_x", "rng.random() < p_x",
             "a sampled draft accepted with p(x), not min(1, p(x) / q(x))", UNIT, loop=TEMPERED),
    Mutation("accept-ratio-inverted", f"{S}:speculative_accept", "rng.random() * q_x < p_x", "rng.random() * p_x < q_x",
             "accepted with min(1, q(x) / p(x))", UNIT, loop=TEMPERED),
    Mutation("rejected-draft-kept", f"{S}:speculative_accept", "return i, sample(residual, rng)",
             "return i + 1, sample(residual, rng)", "the rejected draft counted as accepted", UNIT, loop=TEMPERED),
    # -- greedy acceptance (sampling.greedy_accept) --
    Mutation("greedy-accepts-first-mismatch", f"{S}:greedy_accept",
             "if int(target_ids[n_accepted]) != draft:\n            break",
             "if int(target_ids[n_accepted]) != draft:\n            n_accepted += 1\n            break",
             "the first draft that differs from the target's argmax is kept",
             "test_speculative.py::test_greedy_speculative_equals_plain[layerskip-4]"),
    Mutation("greedy-bonus-from-last-draft-row", f"{S}:greedy_accept", "return n_accepted, int(target_ids[n_accepted])",
             "return n_accepted, int(target_ids[min(n_accepted, len(draft_ids) - 1)])",
             "a fully accepted window's bonus is the last draft's row's argmax", f"{EDGES}test_prefix_reuse_equals_cold"),
    # -- drawing from a row (sampling.sample), the row's distribution (sampling.probabilities), a drafter's q row --
    Mutation("sample-ignores-row-total", f"{S}:sample", "rng.random() * cumulative[-1]", "rng.random()",
             "an unnormalised residual is drawn as if it summed to 1", UNIT, loop=TEMPERED),
    Mutation("temperature-ignored", f"{S}:probabilities", "np.asarray(logits, dtype=np.float64) / params.temperature",
             "np.asarray(logits, dtype=np.float64)", "the logits are not divided by the temperature",
             "test_sampling.py::test_temperature_divides_the_logits"),
    Mutation("top-k-keeps-one-more", f"{S}:probabilities",
             "kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]",
             "kth = np.partition(scaled, vocab - params.top_k - 1, axis=-1)[:, vocab - params.top_k - 1][:, None]",
             "top-k keeps k + 1 ids", "test_sampling.py::test_top_p_and_top_k_restrict_support"),
    Mutation("top-p-drops-the-crossing-id", f"{S}:probabilities", "(cumulative - sorted_probs) < params.top_p",
             "cumulative < params.top_p", "top-p drops the id that crosses p",
             "test_sampling.py::test_top_p_and_top_k_restrict_support"),
    Mutation("min-p-absolute", f"{S}:probabilities", "params.min_p * probs.max(axis=-1, keepdims=True)", "params.min_p",
             "min_p compared with the probability itself, not relative to the top one",
             "test_request_fields.py::test_min_p_keeps_ids_near_the_top"),
    Mutation("pick-q-is-raw-softmax", f"{S}:Sampler.pick", "return sample(probs, self.rng), probs",
             "return sample(probs, self.rng), probabilities(logits_row[None, :], SamplingParams(temperature=1.0))[0]",
             "a drafter's q row (every sampling drafter picks through Sampler.pick) is the raw softmax, not the "
             "distribution its draft was drawn from", f"{EDGES}test_sampled_draft_q_rows_are_the_rows_drawn_from"),
    Mutation("draft-q-rows-reversed", f"{D}:Draft.from_picks", "np.stack(q_rows)", "np.stack(q_rows[::-1])",
             "a draft's q rows in the wrong order (each draft judged against another position's q)",
             f"{EDGES}test_sampled_draft_q_rows_are_the_rows_drawn_from"),
    # -- the processed logits (sampling.processed_logits) --
    Mutation("window-history-dropped", f"{S}:processed_logits", "counts[window[i - 1]] += 1.0", "pass",
             "verify row i does not count the drafts before it", HISTORY),
    Mutation("repetition-penalty-sign", f"{S}:processed_logits", "np.where(row[seen] > 0,", "np.where(row[seen] < 0,",
             "the repetition penalty raises negative logits and lowers positive ones the wrong way", HISTORY),
    Mutation("presence-frequency-swapped", f"{S}:processed_logits",
             "params.frequency_penalty * counts + params.presence_penalty * (counts > 0)",
             "params.presence_penalty * counts + params.frequency_penalty * (counts > 0)",
             "presence and frequency penalties swapped", HISTORY),
    Mutation("logit-bias-dropped", f"{S}:processed_logits", "row += bias", "pass", "the logit bias is not added",
             HISTORY),
    Mutation("suppressed-kept", f"{S}:processed_logits", "row[list(params.suppressed)] = -np.inf", "pass",
             "ignore_eos's ids stay choosable", HISTORY),
    # -- the grammar's masks (grammar.mask_logits, grammar.mask_probs) --
    Mutation("mask-logits-first-row-only", f"{G}:mask_logits", "np.where(allowed, logits,",
             "np.where(allowed[:1], logits,", "every row masked by the first row's grammar state",
             f"{EDGES}test_grammar_masks"),
    Mutation("mask-probs-not-renormalised", f"{G}:mask_probs", "return np.divide(q, total, out=np.zeros_like(q), "
             "where=total > 0)", "return q", "a masked q row not renormalised", f"{EDGES}test_grammar_masks"),
    # -- the loop: a verify window's rows (speculative.accept_rows) --
    Mutation("grammar-mask-not-advanced", f"{L}:accept_rows", "allowed = constraint.masks(draft.tokens)",
             "allowed = constraint.masks([])[[0] * (len(draft.tokens) + 1)]",
             "every verify row masked by the grammar state before the window", GUIDED_SELF, refusal=REFUSED),
    Mutation("q-not-masked", f"{L}:accept_rows", "q = mask_probs(q, allowed[:-1])", "q = q",
             "a sampled draft's q rows not masked and renormalised under the grammar",
             "test_guided.py::test_verify_masks_and_renormalises_the_draft_q"),
    # -- the loop: what a call appends, where the slot goes on (speculative.BatchLoop._call) --
    Mutation("correction-replaced-by-draft", f"{L}:BatchLoop._call", "chunk = draft.tokens[:n_accepted] + [next_token]",
             "chunk = (draft.tokens + [next_token])[:n_accepted + 1]", "the rejected draft emitted instead of the "
             "target's own token", "test_speculative.py::test_greedy_speculative_equals_plain[layerskip-4]"),
    Mutation("no-rollback", f"{L}:BatchLoop._call", "slot.pos += n_accepted + 1", "slot.pos += len(draft.tokens) + 1",
             "the position moves past the rejected drafts' cache rows",
             "test_speculative.py::test_greedy_speculative_equals_plain[layerskip-4]"),
    Mutation("step-does-not-advance", f"{L}:BatchLoop._call", "slot.pos += 1", "pass",
             "a plain step's token is not moved past: the next call overwrites its cache row",
             f"{EDGES}test_eos_and_length_cut_inside_a_verify_window"),
    Mutation("verify-history-misses-pending", f"{L}:BatchLoop._call", "slot.sampler, slot.generated)",
             "slot.sampler, slot.generated[:-1])", "verify rows processed without the pending token in their history",
             "test_speculative.py::test_greedy_speculative_equals_plain[ngram-4]"),
    Mutation("step-row-unmasked", f"{L}:BatchLoop._call",
             "logits = out[j, :1] if constraint is None else mask_logits(out[j, :1], constraint.masks([]))",
             "logits = out[j, :1]", "a plain step under a grammar chooses from the unmasked row", GUIDED_SELF,
             refusal=REFUSED),
    # -- the loop: a chunk's cut at EOS / max_new_tokens (speculative.take_chunk) --
    Mutation("eos-kept", f"{L}:take_chunk", 'chunk, reason = chunk[:i], "eos"', 'chunk, reason = chunk[:i + 1], "eos"',
             "the EOS token kept in the output", f"{EDGES}test_eos_and_length_cut_inside_a_verify_window"),
    Mutation("length-cut-one-late", f"{L}:take_chunk", "chunk[:max_new_tokens - len(new_tokens)]",
             "chunk[:max_new_tokens - len(new_tokens) + 1]", "a chunk cut by max_new_tokens keeps one token more",
             f"{EDGES}test_eos_and_length_cut_inside_a_verify_window"),
    # -- the loop: prefix reuse (speculative.BatchLoop.add, speculative.BatchLoop._leave) --
    Mutation("reuse-takes-the-whole-prompt", f"{L}:BatchLoop.add", "limit = len(prompt) - 1",
             "limit = len(prompt)", "a prompt the slot holds entirely is not prefilled at "
             "all (its last token's logits choose the first token)", f"{EDGES}test_prefix_reuse_equals_cold"),
    Mutation("record-claims-the-pending-token", f"{L}:BatchLoop._leave", "tuple(slot.seq[:slot.pos])",
             "tuple(slot.seq[:slot.pos + 1])", "the slot's record claims the pending token's row, never fed",
             f"{EDGES}test_prefix_reuse_equals_cold"),
    # -- the loop: the first token, a draft's cut (speculative.BatchLoop._prefill_chunk, speculative.cut_draft) --
    Mutation("first-token-unmasked", f"{L}:BatchLoop._prefill_chunk",
             "rows = mask_logits(rows, slot.request.constraint.masks([]))", "rows = rows",
             "the prompt's last row (the first token) not masked by the grammar", GUIDED_SELF, refusal=REFUSED),
    Mutation("cut-keeps-forbidden-token", f"{L}:cut_draft", "n = constraint.admitted(draft.tokens)",
             "n = min(len(draft.tokens), constraint.admitted(draft.tokens) + 1)",
             "a draft is verified up to and including its first forbidden token",
             f"{EDGES}test_cut_draft_keeps_the_kept_drafts_q_rows"),
    Mutation("cut-q-rows-from-the-end", f"{L}:cut_draft", "draft.q_draft[:n]", "draft.q_draft[-n:]",
             "a cut draft keeps the q rows of the tokens cut off", f"{EDGES}test_cut_draft_keeps_the_kept_drafts_q_rows"),
]


def function_of(mutation: Mutation) -> str:
    return mutation.target.split(":")[1]


def table() -> str:
    """docs/testing.md's table of the mutations (test_mutations.py checks the page holds it as it is)."""
    def catch(m: Mutation) -> str:
        refusal = f" (or the product's refusal `{m.refusal}`)" if m.refusal else ""
        return f"`{m.caught_by}`{refusal}"

    rows = ["| mutation | function | what it breaks | first test of the fixed set that fails | loop-level test "
            "that fails alone |", "|---|---|---|---|---|"]
    rows += [f"| `{m.name}` | `{function_of(m)}` | {m.breaks} | {catch(m)} | {f'`{m.loop}`' if m.loop else ''} |"
             for m in MUTATIONS]
    return "\n".join(rows) + "\n"


class StaleMutation(AssertionError):
    """The product no longer holds the mutation's snippet exactly once."""


def _resolve(target: str):
    """(module, owner: the module or the class, attribute name, original function)."""
    module_name, path = target.split(":")
    module = importlib.import_module(module_name)
    *owner_path, attr = path.split(".")
    owner = module
    for part in owner_path:
        owner = getattr(owner, part)
    return module, owner, attr, inspect.getattr_static(owner, attr)


def mutated_function(mutation: Mutation):
    """(the original function, its mutated twin compiled in the original's module namespace)."""
    module, _, attr, original = _resolve(mutation.target)
    source = textwrap.dedent(inspect.getsource(original))
    if source.count(mutation.old) != 1:
        raise StaleMutation(f"mutation {mutation.name} no longer applies: {mutation.target} holds "
                            f"{source.count(mutation.old)} copies of {mutation.old!r}; update test/mutations.py")
    code = compile(source.replace(mutation.old, mutation.new), f"<mutation {mutation.name}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict = {}
    exec(code, module.__dict__, namespace)  # noqa: S102 (the product's own source, one snippet replaced)
    return original, namespace[attr]


@contextmanager
def applied(mutation: Mutation) -> Iterator[None]:
    """The mutation installed for the duration: on its owner (module or class) and, for a module-level
    function, in every loaded spec_edge or test module that imported it by name."""
    _, owner, attr, _ = _resolve(mutation.target)
    original, mutant = mutated_function(mutation)
    replaced = [(owner, attr)]
    if inspect.ismodule(owner):
        test_dir = __file__.rsplit("/", 1)[0]
        for module in list(sys.modules.values()):
            name, file = getattr(module, "__name__", ""), getattr(module, "__file__", None) or ""
            if module is not owner and (name.startswith("spec_edge") or file.startswith(test_dir)):
                replaced += [(module, key) for key, value in list(vars(module).items()) if value is original]
    for where, key in replaced:
        setattr(where, key, mutant)
    try:
        yield
    finally:
        for where, key in replaced:
            setattr(where, key, original)
