"""The launch / launch_ros API that launch/llm.launch.py uses, pinned from their source (test/fixtures/launch_api.json),
and a stand-in built from that pin for machines without them (launch_ros is not on PyPI; CI has neither).

Pinning (once, by hand, from clones of github.com/ros2/launch and github.com/ros2/launch_ros):

    .venv/bin/python test/launch_api.py --launch CLONE_OF_ros2/launch --launch-ros CLONE_OF_ros2/launch_ros

reads each name's class (its bases, its __init__'s parameters: name, kind, whether it has a default) or
function with ast, never importing it, and writes the fixture with the commits it was read from. The stand-in's
classes accept exactly the pinned parameters (a keyword the real __init__ would refuse raises TypeError here too,
**kwargs follow the pinned base classes as the real super().__init__(**kwargs) chain does) and keep what they
were given, so a test can read what the launch file declared. Where launch and launch_ros import, the test uses
them and checks the pin against their signatures.
"""
from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import types
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "launch_api.json"

# (repository, module, name, file in the repository): what llm.launch.py imports, then the bases its keyword
# arguments travel through (Node -> ExecuteProcess -> ExecuteLocal -> Action; OnStateTransition -> ... -> EventHandler)
NAMES = [
    ("launch", "launch", "LaunchDescription", "launch/launch/launch_description.py"),
    ("launch", "launch.actions", "DeclareLaunchArgument", "launch/launch/actions/declare_launch_argument.py"),
    ("launch", "launch.actions", "EmitEvent", "launch/launch/actions/emit_event.py"),
    ("launch", "launch.actions", "RegisterEventHandler", "launch/launch/actions/register_event_handler.py"),
    ("launch", "launch.actions", "OpaqueFunction", "launch/launch/actions/opaque_function.py"),
    ("launch", "launch.event_handlers", "OnProcessExit", "launch/launch/event_handlers/on_process_exit.py"),
    ("launch", "launch.actions", "ExecuteProcess", "launch/launch/actions/execute_process.py"),
    ("launch", "launch.actions", "ExecuteLocal", "launch/launch/actions/execute_local.py"),
    ("launch", "launch", "Action", "launch/launch/action.py"),
    ("launch", "launch", "Condition", "launch/launch/condition.py"),
    ("launch", "launch.conditions", "IfCondition", "launch/launch/conditions/if_condition.py"),
    ("launch", "launch.conditions", "UnlessCondition", "launch/launch/conditions/unless_condition.py"),
    ("launch", "launch.events", "matches_action", "launch/launch/events/matchers.py"),
    ("launch", "launch.substitutions", "LaunchConfiguration", "launch/launch/substitutions/launch_configuration.py"),
    ("launch", "launch.substitutions", "PythonExpression", "launch/launch/substitutions/python_expression.py"),
    ("launch", "launch", "EventHandler", "launch/launch/event_handler.py"),
    ("launch", "launch.event_handlers.on_action_event_base", "OnActionEventBase",
     "launch/launch/event_handlers/on_action_event_base.py"),
    ("launch", "launch", "Event", "launch/launch/event.py"),
    ("launch_ros", "launch_ros.actions", "Node", "launch_ros/launch_ros/actions/node.py"),
    ("launch_ros", "launch_ros.actions", "LifecycleNode", "launch_ros/launch_ros/actions/lifecycle_node.py"),
    ("launch_ros", "launch_ros.event_handlers", "OnStateTransition",
     "launch_ros/launch_ros/event_handlers/on_state_transition.py"),
    ("launch_ros", "launch_ros.events.lifecycle", "ChangeState", "launch_ros/launch_ros/events/lifecycle/change_state.py"),
]
KINDS = {"posonly": inspect.Parameter.POSITIONAL_ONLY, "positional": inspect.Parameter.POSITIONAL_OR_KEYWORD,
         "var_positional": inspect.Parameter.VAR_POSITIONAL, "keyword": inspect.Parameter.KEYWORD_ONLY,
         "var_keyword": inspect.Parameter.VAR_KEYWORD}


def _parameters(fn: ast.FunctionDef, skip_self: bool) -> list[dict]:
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        if skip_self and i == 0:
            continue
        out.append({"name": arg.arg, "kind": "posonly" if arg in a.posonlyargs else "positional",
                    "default": default is not None})
    if a.vararg:
        out.append({"name": a.vararg.arg, "kind": "var_positional", "default": False})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append({"name": arg.arg, "kind": "keyword", "default": default is not None})
    if a.kwarg:
        out.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": False})
    return out


def pin(source: str, name: str) -> dict:
    """{"kind": "class", "bases": [...], "init": [params]} or {"kind": "function", "params": [...]} of name."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            return {"kind": "class", "bases": [ast.unparse(b).split(".")[-1] for b in node.bases],
                    "init": None if init is None else _parameters(init, skip_self=True)}
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return {"kind": "function", "params": _parameters(node, skip_self=False)}
    raise LookupError(f"{name} is not defined at the top of its file")


def write_fixture(clones: dict[str, Path]) -> dict:
    commits = {repo: subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True,
                                    check=True).stdout.strip() for repo, path in clones.items()}
    api = {}
    for repo, module, name, file in NAMES:
        api[name] = {"repository": f"github.com/ros2/{repo}", "module": module, "file": file,
                     **pin((clones[repo] / file).read_text(), name)}
    data = {"commits": commits, "api": api}
    FIXTURE.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def signature(params: list[dict]) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(p["name"], KINDS[p["kind"]],
                                                default=None if p["default"] else inspect.Parameter.empty)
                              for p in params])


def standin_modules() -> dict[str, types.ModuleType]:
    """Modules launch, launch.actions, ..., launch_ros.events.lifecycle whose classes take exactly the pinned
    parameters and keep them: obj.given = {name: value} (every class along the **kwargs chain)."""
    api = json.loads(FIXTURE.read_text())["api"]
    classes: dict[str, type] = {}

    def make(name: str) -> type:
        if name in classes:
            return classes[name]
        entry = api[name]
        bases = tuple(make(b) for b in entry["bases"] if b in api) or (object,)

        def __init__(self, *args, **kwargs):
            # the class's own __init__ binds in full (a missing or unknown argument raises as the real one
            # would); its **kwargs go up the pinned bases, each taking its own (bound partially: a real
            # subclass passes some, e.g. Node gives ExecuteProcess its cmd)
            chain = [c.__name__ for c in type(self).__mro__ if c.__name__ in api and api[c.__name__]["init"]]
            first = True
            for cls_name in chain:
                params = api[cls_name]["init"]
                sig = signature(params)
                bound = sig.bind(*args, **kwargs) if first else sig.bind_partial(**kwargs)
                args, kwargs, first = (), {}, False
                for key, value in bound.arguments.items():
                    if next(p["kind"] for p in params if p["name"] == key) == "var_keyword":
                        kwargs = value
                    else:
                        self.given[key] = value
                if not any(p["kind"] == "var_keyword" for p in params):
                    break
            if kwargs:
                raise TypeError(f"{type(self).__name__}() got unexpected keyword arguments {sorted(kwargs)}")

        def __new__(cls, *args, **kwargs):
            obj = object.__new__(cls)
            obj.given = {}
            return obj

        classes[name] = type(name, bases, {"__init__": __init__, "__new__": __new__, "__module__": entry["module"]})
        return classes[name]

    modules: dict[str, types.ModuleType] = {}
    for name, entry in api.items():
        path = entry["module"]
        for i in range(1, path.count(".") + 2):
            part = ".".join(path.split(".")[:i])
            if part not in modules:
                modules[part] = types.ModuleType(part)
                modules[part].__path__ = []  # a package: its submodules import
        if entry["kind"] == "class":
            setattr(modules[path], name, make(name))
        else:
            sig = signature(entry["params"])

            def function(*args, __name=name, __sig=sig, **kwargs):
                return (__name, dict(__sig.bind(*args, **kwargs).arguments))
            setattr(modules[path], name, function)
    for path, module in modules.items():
        if "." in path:
            parent, child = path.rsplit(".", 1)
            setattr(modules[parent], child, module)
    return modules


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launch", type=Path, required=True)
    parser.add_argument("--launch-ros", type=Path, required=True)
    args = parser.parse_args()
    written = write_fixture({"launch": args.launch, "launch_ros": args.launch_ros})
    print(f"{FIXTURE}: {len(written['api'])} names from {written['commits']}", file=sys.stderr)
