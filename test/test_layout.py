"""The package's layout: imports run one way between the subpackages, no module imports itself
back through others, modules stay readable in one sitting, the package is the serving product (no
training code and no peer harness in it: those are spec_edge_training/ and bench/), and the ROS node and
the HTTP door pull in neither training nor the benchmark code.

Imports are read from the source (ast), lazy ones inside functions included: an import that runs
only on some call still ties the modules together."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "spec_edge"

# what each room may use (besides itself); the top-level config.py is the shared leaf (with its own two
# leaves: the load policy and the retired keys), edgellm_layout.py Edge-LLM's names and folders (the build writes
# what it describes, the runtime reads it), artifacts.py the build before serve (above the runtime it loads), cli.py
# the top
ALLOWED = {
    "speculation_policy": set(),
    "config_retired": {"speculation_policy"},
    "config": {"speculation_policy", "config_retired"},
    "graphs": {"config"},
    "heads": {"config", "graphs"},
    "edgellm_layout": {"config", "graphs", "heads"},
    "device": {"config", "edgellm_layout", "graphs", "heads"},
    "runtime": {"config", "speculation_policy", "edgellm_layout", "graphs", "heads"},
    "artifacts": {"config", "graphs", "heads", "runtime"},
    "tools": {"config", "speculation_policy", "graphs", "runtime", "artifacts"},
    "http": {"config", "runtime", "artifacts"},
    "ros2": {"config", "runtime", "artifacts", "http"},  # the node runs the HTTP door beside its ROS interfaces
    "cli": {"config", "edgellm_layout", "graphs", "heads", "device", "runtime", "artifacts", "tools", "ros2", "http"},
}
# what makes model files: the runtime loads what these made and imports none of them (build before serve)
BUILD = ("spec_edge.graphs.export", "spec_edge.graphs.quantize", "spec_edge.graphs.ort_attention",
         "spec_edge.artifacts")
# the loop module and the modules that drive it (the engine owns the loop, the scheduler iterates it)
LOOP, LOOP_DRIVERS = "spec_edge.runtime.speculative", {"spec_edge.runtime.engine", "spec_edge.runtime.scheduler"}
# each door's module and the runtime module its requests enter
DOORS = {"spec_edge.ros2.node": "spec_edge.runtime.scheduler", "spec_edge.http.door": "spec_edge.runtime.scheduler",
         "spec_edge.cli": "spec_edge.runtime.scheduler"}
MAX_LINES = 600  # a smell alarm, not a target: a module holds one concept, sized by that concept
LONGER = {  # module -> why it reads better whole
    "spec_edge.runtime.backends.edgellm": "the Edge-LLM adapter: its docstring's mapping table, the names table "
    "test_edgellm_api checks this module's source against (EDGELLM_API / EDGELLM_RECEIVERS), and the two runtime "
    "modes that table's receivers name; the visual engine's folder went to edgellm_visual.py",
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The spec_edge modules `name` imports (resolved to modules, not names inside them)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                root = ".".join(base + ([node.module] if node.module else []))
            else:
                root = node.module or ""
            targets = [f"{root}.{alias.name}" if f"{root}.{alias.name}" in known else root for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a function's dotted name
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("spec_edge"):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def room(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "config"  # spec_edge/__init__.py holds nothing


def test_every_room_is_known_and_documented():
    rooms = {room(name) for name in modules()}
    assert rooms <= set(ALLOWED), f"subpackages without a rule in ALLOWED: {rooms - set(ALLOWED)}"
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and (sub / "__init__.py").exists():
            doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text()))
            assert doc and "import" in doc, f"{sub.name}/__init__.py must say what lives there and what it may import"


def test_imports_run_one_way():
    upward = [f"{a} -> {b}" for a, targets in graph().items() for b in targets
              if room(b) != room(a) and room(b) not in ALLOWED[room(a)]]
    assert not upward, "imports against the layering (see ALLOWED):\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    edges = graph()
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_runtime_loads_and_builds_nothing():
    """Build before serve: nothing a runtime module imports, directly or through others (the heads' and graphs'
    readers included), is device/ or a module that makes model files (BUILD); the doors make the files first
    (spec_edge/artifacts.py), the runtime only loads them."""
    edges = graph()
    building = []
    for start in sorted(name for name in edges if room(name) == "runtime"):
        via, todo = {start: [start]}, [start]
        while todo:
            here = todo.pop()
            for nxt in sorted(edges[here] - set(via)):
                via[nxt] = via[here] + [nxt]
                todo.append(nxt)
        building += [" -> ".join(path) for name, path in via.items() if room(name) == "device" or name in BUILD]
    assert not building, "the runtime reaches build code:\n" + "\n".join(building)


def test_only_the_loop_drivers_import_the_loop():
    """Stats, Draft, Sampler and the Drafter protocol live in modules of their own: no runtime module imports the
    loop module (speculative.py) but the ones that drive it."""
    importers = {a for a, targets in graph().items() if LOOP in targets and room(a) == "runtime"}
    assert importers <= LOOP_DRIVERS, sorted(importers - LOOP_DRIVERS)


def test_each_door_request_path_runs_down():
    """From each door, the modules its requests run through (the runtime module they enter and everything it
    imports) never import a module of a higher room, the door's own included: a request runs down the layers."""
    edges = graph()
    order = list(ALLOWED)  # listed bottom up

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(edges[name])
        return seen

    for door, entry in DOORS.items():
        assert entry in reach(door), f"{door} no longer reaches the runtime at {entry}: update DOORS"
        path = reach(entry)
        up = sorted(f"{a} -> {b}" for a in path for b in edges[a]
                    if order.index(room(b)) > order.index(room(a)))
        assert not up and room(door) not in {room(n) for n in path}, (door, up)


def test_modules_stay_readable_in_one_sitting():
    """One concept per module is the rule (reviewed); past MAX_LINES a module is a smell to look at."""
    long = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = {name: n for name, n in long.items() if n > MAX_LINES and name not in LONGER}
    assert not over, f"modules over {MAX_LINES} lines (split them, or say in LONGER why they read better whole): {over}"


def test_the_package_holds_no_training_and_no_peer_harness():
    """Training (an optimizer, a backward pass) and the peers' engines (llama.cpp, transformers' generate) are
    nowhere in spec_edge/: they live in spec_edge_training/ and bench/ beside it, and nothing here imports those."""
    assert not (PACKAGE / "training").exists() and not (PACKAGE / "tools" / "peers.py").exists()
    found = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                targets = [node.module or ""]
            else:
                targets = []
            found += [f"{name} imports {t}" for t in targets
                      if t.split(".")[0] in ("llama_cpp", "spec_edge_training", "bench") or t.startswith("torch.optim")]
            if isinstance(node, ast.Attribute) and node.attr in ("backward", "optim", "generate", "zero_grad"):
                found.append(f"{name}:{node.lineno} uses .{node.attr}")
            if isinstance(node, ast.keyword) and node.arg in ("assistant_model", "prompt_lookup_num_tokens"):
                found.append(f"{name}:{node.lineno} passes {node.arg}=")
    assert not found, "\n".join(found)


def test_the_node_and_the_http_door_pull_in_no_training_or_benchmark_code():
    edges = graph()
    seen, todo = set(), ["spec_edge.ros2.node", "spec_edge.ros2.client", "spec_edge.http.door"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(edges[name])
    assert not {n for n in seen if room(n) == "tools"}, sorted(seen)


BLOCKED = ("spec_edge_training", "bench", "spec_edge.tools")
IMPORT_BLOCKED = f"""
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in {BLOCKED!r}):
            raise ImportError(f"blocked: {{name}}")
sys.meta_path.insert(0, Block())
"""


def run_fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", IMPORT_BLOCKED + code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(PACKAGE.parent)))


def test_the_http_door_imports_without_training_or_bench():
    """At run time, in a fresh interpreter: the HTTP door and the engine import with spec_edge_training, bench/
    and spec_edge.tools unimportable (a finder that refuses them), and none of them is in sys.modules after."""
    out = run_fresh("""
import spec_edge.http.door, spec_edge.runtime.engine, spec_edge.artifacts
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("spec_edge_training", "bench", "torch")
                   or m.startswith("spec_edge.tools")))
""")
    assert out.returncode == 0 and out.stdout.strip() == "ok []", out.stdout + out.stderr[-2000:]


def test_the_node_imports_without_training_or_bench():
    """The same for the ROS node and client."""
    pytest.importorskip("rclpy")
    out = run_fresh("""
import spec_edge.ros2.node, spec_edge.ros2.client, spec_edge.runtime.engine
node_cls = spec_edge.ros2.node.GenerateNode
print("ok", sorted(m for m in sys.modules if m.split(".")[0] in ("spec_edge_training", "bench")
                   or m.startswith("spec_edge.tools")))
""")
    assert out.returncode == 0 and out.stdout.strip() == "ok []", out.stdout + out.stderr[-2000:]
