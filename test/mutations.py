"""Named one-line mutations of the rules exactness and the sampling distribution rest on.

Each Mutation replaces one exact snippet of one product function's source (spec_edge/runtime/sampling.py,
the accept / window / grammar parts of spec_edge/runtime/speculative.py) and applied() installs the mutated
function in place of the original: in its module and wherever it was imported by name (speculative.py's
`from spec_edge.runtime.sampling import ...`, the test modules'). The snippet must occur exactly once, so a
product change that moves the code fails the check by name ("no longer applies") instead of letting a
mutation silently test nothing. test_mutations.py runs a fixed set of fast tests per mutation; docs/testing.md
lists each mutation and the test that catches it.

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
    target: str    # "module:function" or "module:Class.method"
    old: str       # a snippet of the function's source, found exactly once
    new: str
    breaks: str    # what goes wrong, in words
    survives: str = ""  # a known survivor: why no test catches it yet (the check expects it to survive)


S, L = "spec_edge.runtime.sampling", "spec_edge.runtime.speculative"

MUTATIONS = [
    # -- speculative sampling's acceptance rule (sampling.speculative_accept) --
    Mutation("bonus-from-row-k-1", f"{S}:speculative_accept", "return k, sample(p_target[k], rng)",
             "return k, sample(p_target[k - 1], rng)", "a fully accepted window's bonus token drawn from the last "
             "draft's row"),
    Mutation("residual-is-p", f"{S}:speculative_accept", "residual = np.maximum(p_target[i] - q_draft[i], 0.0)",
             "residual = p_target[i].copy()", "a rejected sampled draft resampled from p, not max(0, p - q)"),
    Mutation("residual-is-q-minus-p", f"{S}:speculative_accept",
             "residual = np.maximum(p_target[i] - q_draft[i], 0.0)", "residual = np.maximum(q_draft[i] - p_target[i], 0.0)",
             "the residual's sides swapped"),
    Mutation("one-hot-residual-keeps-draft", f"{S}:speculative_accept", "residual[draft] = 0.0", "pass",
             "a rejected deterministic draft can be drawn again"),
    Mutation("accept-with-p", f"{S}:speculative_accept", "rng.random() * q_x < p_x", "rng.random() < p_x",
             "a sampled draft accepted with p(x), not min(1, p(x) / q(x))"),
    Mutation("accept-ratio-inverted", f"{S}:speculative_accept", "rng.random() * q_x < p_x", "rng.random() * p_x < q_x",
             "accepted with min(1, q(x) / p(x))"),
    Mutation("rejected-draft-kept", f"{S}:speculative_accept", "return i, sample(residual, rng)",
             "return i + 1, sample(residual, rng)", "the rejected draft counted as accepted"),
    # -- greedy acceptance (sampling.greedy_accept) --
    Mutation("greedy-accepts-first-mismatch", f"{S}:greedy_accept",
             "if int(target_ids[n_accepted]) != draft:\n            break",
             "if int(target_ids[n_accepted]) != draft:\n            n_accepted += 1\n            break",
             "the first draft that differs from the target's argmax is kept"),
    Mutation("greedy-bonus-from-last-draft-row", f"{S}:greedy_accept", "return n_accepted, int(target_ids[n_accepted])",
             "return n_accepted, int(target_ids[min(n_accepted, len(draft_ids) - 1)])",
             "a fully accepted window's bonus is the last draft's row's argmax"),
    # -- drawing from a row (sampling.sample) and the row's distribution (sampling.probabilities) --
    Mutation("sample-ignores-row-total", f"{S}:sample", "rng.random() * cumulative[-1]", "rng.random()",
             "an unnormalised residual is drawn as if it summed to 1"),
    Mutation("temperature-ignored", f"{S}:probabilities", "np.asarray(logits, dtype=np.float64) / params.temperature",
             "np.asarray(logits, dtype=np.float64)", "the logits are not divided by the temperature"),
    Mutation("top-k-keeps-one-more", f"{S}:probabilities",
             "kth = np.partition(scaled, vocab - params.top_k, axis=-1)[:, vocab - params.top_k][:, None]",
             "kth = np.partition(scaled, vocab - params.top_k - 1, axis=-1)[:, vocab - params.top_k - 1][:, None]",
             "top-k keeps k + 1 ids"),
    Mutation("top-p-drops-the-crossing-id", f"{S}:probabilities", "(cumulative - sorted_probs) < params.top_p",
             "cumulative < params.top_p", "top-p drops the id that crosses p"),
    Mutation("min-p-absolute", f"{S}:probabilities", "params.min_p * probs.max(axis=-1, keepdims=True)", "params.min_p",
             "min_p compared with the probability itself, not relative to the top one"),
    # -- the processed logits (sampling.processed_logits) --
    Mutation("window-history-dropped", f"{S}:processed_logits", "counts[window[i - 1]] += 1.0", "pass",
             "verify row i does not count the drafts before it"),
    Mutation("repetition-penalty-sign", f"{S}:processed_logits", "np.where(row[seen] > 0,", "np.where(row[seen] < 0,",
             "the repetition penalty raises negative logits and lowers positive ones the wrong way"),
    Mutation("presence-frequency-swapped", f"{S}:processed_logits",
             "params.frequency_penalty * counts + params.presence_penalty * (counts > 0)",
             "params.presence_penalty * counts + params.frequency_penalty * (counts > 0)",
             "presence and frequency penalties swapped"),
    Mutation("logit-bias-dropped", f"{S}:processed_logits", "row += bias", "pass", "the logit bias is not added"),
    Mutation("suppressed-kept", f"{S}:processed_logits", "row[list(params.suppressed)] = -np.inf", "pass",
             "ignore_eos's ids stay choosable"),
    # -- the loop: a verify window's rows (speculative.accept_rows) --
    Mutation("grammar-mask-not-advanced", f"{L}:accept_rows", "allowed = constraint.masks(draft.tokens)",
             "allowed = constraint.masks([])[[0] * (len(draft.tokens) + 1)]",
             "every verify row masked by the grammar state before the window"),
    Mutation("q-not-masked", f"{L}:accept_rows", "q = mask_probs(q, allowed[:-1])", "q = q",
             "a sampled draft's q rows not masked and renormalised under the grammar"),
    # -- the loop: what a verify call appends, where the slot goes on (speculative.BatchLoop._call) --
    Mutation("correction-replaced-by-draft", f"{L}:BatchLoop._call", "chunk = draft.tokens[:n_accepted] + [next_token]",
             "chunk = (draft.tokens + [next_token])[:n_accepted + 1]", "the rejected draft emitted instead of the "
             "target's own token"),
    Mutation("no-rollback", f"{L}:BatchLoop._call", "slot.pos += n_accepted + 1", "slot.pos += len(draft.tokens) + 1",
             "the position moves past the rejected drafts' cache rows"),
    Mutation("verify-history-misses-pending", f"{L}:BatchLoop._call", "slot.sampler, slot.generated)",
             "slot.sampler, slot.generated[:-1])", "verify rows processed without the pending token in their history"),
    Mutation("step-row-unmasked", f"{L}:BatchLoop._call",
             "logits = out[j, :1] if constraint is None else mask_logits(out[j, :1], constraint.masks([]))",
             "logits = out[j, :1]", "a plain step under a grammar chooses from the unmasked row"),
    # -- the loop: the first token, a draft's cut (speculative.BatchLoop._prefill_chunk, speculative.cut_draft) --
    Mutation("first-token-unmasked", f"{L}:BatchLoop._prefill_chunk",
             "rows = mask_logits(rows, slot.request.constraint.masks([]))", "rows = rows",
             "the prompt's last row (the first token) not masked by the grammar"),
    Mutation("cut-keeps-forbidden-token", f"{L}:cut_draft", "n = constraint.admitted(draft.tokens)",
             "n = min(len(draft.tokens), constraint.admitted(draft.tokens) + 1)",
             "a draft is verified up to and including its first forbidden token"),
]


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
