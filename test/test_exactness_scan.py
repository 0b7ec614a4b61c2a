"""No exactness test may pass on plain decoding: a scan of the test files' syntax (docs/testing.md, "Every
exactness test proves it speculated").

A test *speculates* where it runs the loop with a drafter: a call with a `drafter=` argument that is not
None / "none", or a call to a function (of its module or of tiny.py) whose `drafter` parameter gets such an
argument, or a call to a proof helper. Each of those runs must be followed, per case, by a *proof*: a call
to speculated.assert_speculated, or to a function of the module or of tiny.py that calls it (a proof
helper), placed inside every loop the run is in (one proof per grammar / prompt / option / drafter, never a
sum over them: a sum hides the empty cases). Two things are not cases: a loop over `seed` (the samples of one
distribution) and a loop whose runs all feed one request list (a batch is one case per request: the proof
loops over the batch's results). A test that speculates but proves nothing about the loop's output is
listed in NOT_EXACTNESS with the reason."""
from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).parent

# tests that run a drafter beside a target-only run but assert no "speculative == target-only": why, per test
NOT_EXACTNESS: dict[str, str] = {
    "test_speculation_load.py::test_a_smaller_asked_k_is_not_raised":
        "asserts the k a request reports and the off reason, not its tokens",
    "test_suffix.py::test_serving_goes_on_over_a_corrupt_store_file":
        "asserts serving goes on over a corrupt store file (the store starts empty); the suffix drafter's exactness "
        "with accepted drafts from a reloaded store is test_a_persisted_store_survives_a_restart_and_drafts_the_first_request",
}
# exactness tests this scan finds without a per-case proof, in files outside issue 46's item 3 list (each is a
# known gap, to be proven and removed from here; a new test cannot be added here unnoticed: the list is exact)
PENDING: dict[str, str] = {
}


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _is_off(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value in (None, "none")


_CALLS: dict[int, tuple[ast.AST, list[ast.Call]]] = {}  # id -> (the node, kept alive so no id is reused; its calls)


def _calls(node: ast.AST) -> list[ast.Call]:
    """Every call under node (kept: the fixed points below walk each function many times)."""
    if id(node) not in _CALLS:
        _CALLS[id(node)] = (node, [c for c in ast.walk(node) if isinstance(c, ast.Call)])
    return _CALLS[id(node)][1]


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def _proof_helpers(functions: dict[str, ast.FunctionDef], known: set[str]) -> set[str]:
    """Names of the functions that call assert_speculated (or another proof helper), transitively."""
    helpers = set(known) | {"assert_speculated"}
    grew = True
    while grew:
        grew = False
        for name, node in functions.items():
            if name not in helpers and any(_name(c.func) in helpers for c in _calls(node)):
                helpers.add(name)
                grew = True
    return helpers


def _drafter_params(functions: dict[str, ast.FunctionDef]) -> dict[str, tuple[int, bool]]:
    """function name -> (the position of its `drafter` parameter, whether its default is None / "none")."""
    out = {}
    for name, node in functions.items():
        names = [a.arg for a in node.args.args]
        if "drafter" in names:
            at = names.index("drafter")
            defaults = [None] * (len(names) - len(node.args.defaults)) + list(node.args.defaults)
            out[name] = (at, defaults[at] is not None and _is_off(defaults[at]))
    return out


def _drafter_arg(call: ast.Call, drafter_params: dict[str, tuple[int, bool]]):
    """(given, off) for a call of a function with a `drafter` parameter, else None."""
    param = drafter_params.get(_name(call.func))
    if param is None:
        return None
    at, default_off = param
    for keyword in call.keywords:
        if keyword.arg == "drafter":
            return True, _is_off(keyword.value)
    if len(call.args) > at:
        return True, _is_off(call.args[at])
    return False, default_off


def _speculates(call: ast.Call, drafter_params: dict[str, int], runners: set[str], proofs: set[str]) -> bool:
    """The call runs the loop with a drafter (or is a proof helper, which does)."""
    name = _name(call.func)
    if name == "replace":  # dataclasses.replace / Config.replace set fields: they run nothing
        return False
    if name in runners or (name in proofs and name != "assert_speculated"):
        return True
    for keyword in call.keywords:
        if keyword.arg == "drafter" and not _is_off(keyword.value):
            return True
    for arg in [*call.args, *(keyword.value for keyword in call.keywords)]:  # a request's fields as a dict
        if isinstance(arg, ast.Dict) and any(isinstance(key, ast.Constant) and key.value == "drafter"
                                             and not _is_off(value) for key, value in zip(arg.keys, arg.values)):
            return True
    given = _drafter_arg(call, drafter_params)
    return given is not None and given[0] and not given[1]


def _runners(functions: dict[str, ast.FunctionDef], drafter_params: dict[str, int], proofs: set[str],
             known: set[str]) -> set[str]:
    """Functions without a `drafter` parameter that run a drafter whatever they are given, transitively."""
    runners = set(known)
    grew = True
    while grew:
        grew = False
        for name, node in functions.items():
            if name in runners or name in drafter_params or name.startswith("test_"):
                continue
            if any(_speculates(c, drafter_params, runners, proofs) for c in _calls(node)):
                runners.add(name)
                grew = True
    return runners


def _target_only(call: ast.Call, drafter_params: dict[str, int], references: set[str]) -> bool:
    """The call runs the target alone: speculate=False, drafter None / "none" given explicitly, a SlotRequest
    without a drafter, or a function that does (a reference: plain, target_only, exact_first ...)."""
    name = _name(call.func)
    if name == "replace":
        return False
    if name in references:
        return True
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if isinstance(keywords.get("speculate"), ast.Constant) and keywords["speculate"].value is False:
        return True
    if "drafter" in keywords and _is_off(keywords["drafter"]):
        return True
    if name == "SlotRequest" and "drafter" not in keywords and None not in keywords:  # None: **fields
        return True
    given = _drafter_arg(call, drafter_params)
    return given is not None and given[1]


def _references(functions: dict[str, ast.FunctionDef], drafter_params: dict[str, int], known: set[str]) -> set[str]:
    """Functions (not tests) that run the target alone or compute its exact distribution, transitively."""
    references = set(known) | {"exact_first"}
    grew = True
    while grew:
        grew = False
        for name, node in functions.items():
            if name in references or name.startswith("test_"):
                continue
            if any(_target_only(c, drafter_params, references) for c in _calls(node)):
                references.add(name)
                grew = True
    return references


class _Walker(ast.NodeVisitor):
    """Every call of a test with the loops (for/while/comprehension) it sits in."""

    def __init__(self):
        self.loops: list[ast.AST] = []
        self.calls: list[tuple[ast.Call, tuple[ast.AST, ...]]] = []

    def _loop(self, node):
        self.loops.append(node)
        self.generic_visit(node)
        self.loops.pop()

    visit_For = visit_While = visit_ListComp = visit_GeneratorExp = visit_DictComp = visit_SetComp = _loop

    def visit_Call(self, node):
        self.calls.append((node, tuple(self.loops)))
        self.generic_visit(node)


def _not_a_case(loop: ast.AST) -> bool:
    """A loop over seeds (samples of one distribution) is not a case."""
    if isinstance(loop, ast.For):
        return isinstance(loop.target, ast.Name) and loop.target.id == "seed"
    return False


def _batch_loop(loop: ast.AST) -> bool:
    """A comprehension building a batch's requests: the batch's proof loops over its results instead."""
    return isinstance(loop, (ast.ListComp, ast.GeneratorExp))


def scan(path: Path, tiny_functions: dict[str, ast.FunctionDef]) -> list[str]:
    """The speculating tests of one file without a per-case proof, as 'file::test: why'."""
    tree = ast.parse(path.read_text())
    functions = _functions(tree)
    tiny_proofs = _proof_helpers(tiny_functions, set())
    proofs = _proof_helpers(functions, tiny_proofs)
    drafter_params = {**_drafter_params(tiny_functions), **_drafter_params(functions)}
    tiny_runners = _runners(tiny_functions, drafter_params, tiny_proofs, set())
    runners = _runners(functions, drafter_params, proofs, tiny_runners)
    references = _references(functions, drafter_params, _references(tiny_functions, drafter_params, set()))
    problems = []
    for name, node in functions.items():
        if not name.startswith("test_"):
            continue
        key = f"{path.name}::{name}"
        walker = _Walker()
        walker.visit(node)
        runs = [(c, loops) for c, loops in walker.calls if _speculates(c, drafter_params, runners, proofs)]
        compared = any(_target_only(c, drafter_params, references) or _name(c.func) in proofs
                       for c, _ in walker.calls)
        if not runs or not compared or key in NOT_EXACTNESS:
            continue
        proof_calls = [(c, loops) for c, loops in walker.calls if _name(c.func) in proofs]
        if not proof_calls:
            problems.append(f"{key}: runs a drafter (line {runs[0][0].lineno}) and never proves it speculated")
            continue
        samples_only = all(any(_not_a_case(loop) for loop in loops) for _, loops in runs)
        for call, loops in proof_calls:
            if _name(call.func) == "assert_speculated" and any(isinstance(a, ast.Starred) for a in call.args) \
                    and not samples_only:
                problems.append(f"{key}: line {call.lineno} sums the proof over runs (assert_speculated(*...)): "
                                f"prove each case")
        for call, loops in runs:
            if _name(call.func) in proofs:
                continue  # a proof helper proves its own runs
            cases = {id(loop) for loop in loops if not _not_a_case(loop) and not _batch_loop(loop)}
            if not any(cases <= {id(loop) for loop in proof_loops} for _, proof_loops in proof_calls):
                problems.append(f"{key}: the run at line {call.lineno} has no proof inside the loops it runs in")
                break
    return problems


def all_problems() -> list[str]:
    tiny_functions = _functions(ast.parse((HERE / "tiny.py").read_text()))
    problems = []
    for path in sorted(HERE.glob("test_*.py")):
        problems += scan(path, tiny_functions)
    return problems


def test_every_exactness_test_proves_per_case_that_it_speculated():
    problems = all_problems()
    pending = {p.split(":", 3)[0] + "::" + p.split(":")[2] for p in problems} & set(PENDING)
    new = [p for p in problems if p.split(":", 3)[0] + "::" + p.split(":")[2] not in PENDING]
    assert not new, "exactness tests that can pass on plain decoding:\n" + "\n".join(new)
    assert pending == set(PENDING), f"proven now: remove {sorted(set(PENDING) - pending)} from PENDING"


def test_the_scan_finds_a_missing_and_a_summed_proof(tmp_path):
    """The scan itself can fail: a run without a proof, and a proof summed over a loop of prompts."""
    tiny_functions = _functions(ast.parse((HERE / "tiny.py").read_text()))
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "def test_none(engine):\n"
        "    plain = run_alone(engine.runner, SlotRequest(prompt_ids=[1], max_new_tokens=4))\n"
        "    assert run_alone(engine.runner, SlotRequest(prompt_ids=[1], drafter=NgramDrafter())) == plain\n"
        "def test_summed(engine):\n"
        "    runs = []\n"
        "    for prompt in PROMPTS:\n"
        "        got, _, stats = run_alone(engine.runner, SlotRequest(prompt_ids=prompt, drafter=d, k=3))\n"
        "        runs.append(stats)\n"
        "    assert_speculated(*runs)\n"
        "def test_each(engine):\n"
        "    for prompt in PROMPTS:\n"
        "        got, _, stats = run_alone(engine.runner, SlotRequest(prompt_ids=prompt, drafter=d, k=3))\n"
        "        assert_speculated(stats, what=prompt)\n"
        "def test_plain(engine):\n"
        "    run_alone(engine.runner, SlotRequest(prompt_ids=[1], drafter=None))\n")
    problems = scan(bad, tiny_functions)
    assert [p.split(":")[2] for p in problems] == ["test_none", "test_summed", "test_summed"], problems
