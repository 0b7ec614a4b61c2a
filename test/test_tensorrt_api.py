"""Every TensorRT name and call the code uses exists, with a signature that accepts the call, in
the real TensorRT 10.13 Python bindings (JetPack 7's version), without a GPU or libnvinfer.

How: PyPI's `tensorrt-cu12-bindings` wheel is the real `tensorrt.so` extension (package
`tensorrt_bindings`); only its libraries (libnvinfer & co, `tensorrt-cu12-libs`) are out of reach.
To merely import, the extension needs nine C functions from three libraries (STUB_SYMBOLS, read
with `nm -D --undefined-only tensorrt.so`); a stub library exporting exactly those, compiled here
with the system C compiler, is enough for introspection: classes, enums, properties, pybind11
docstrings (which carry the signatures). Every constructor then fails ("factory function returned
nullptr"), so nothing is run: names and signatures are what this checks.

What is checked, per module that calls TensorRT (TENSORRT_MODULES, each with a TENSORRT_API
table kept next to its code: TensorRT class -> the members it uses on objects of that class, and a
TENSORRT_RECEIVERS table: expression (`engine`, `call.context`) -> the TensorRT class it holds):
  - every `trt.A.B...` attribute chain in the module's source resolves (AST walk);
  - every `trt.X(...)` call and every call `obj.member(...)` of a member in TENSORRT_API matches an
    overload of that member (positional count, keyword names, required parameters);
  - a member assigned (`obj.member = v`) is a property with a setter; a property is never called;
  - every attribute used on a receiver exists on its class and is listed in TENSORRT_API;
  - every member in TENSORRT_API exists on its class; every attribute the module uses that is a
    member of a class it lists is itself listed (so the table cannot silently fall behind);
  - methods of our subclasses of TensorRT classes (progress monitor, stream reader) exist on the
    base with the same number of parameters.
Skipped only when the bindings wheel is not installed (scripts/setup.sh installs it).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TENSORRT_MODULES = ("spec_edge.device.builder", "spec_edge.device.engine_file", "spec_edge.runtime.backends.tensorrt",
                    "spec_edge.runtime.backends.trt_memory", "spec_edge.runtime.backends.trt_head",
                    "spec_edge.runtime.backends.trt_batch")
# what tensorrt.so needs from libnvinfer / libnvonnxparser / libnvinfer_plugin to import (10.13.3.9)
STUB_SYMBOLS = {
    "libnvinfer.so.10": ["createInferBuilder_INTERNAL", "createInferRefitter_INTERNAL", "createInferRuntime_INTERNAL",
                         "getBuilderPluginRegistry", "getPluginRegistry"],
    "libnvonnxparser.so.10": ["createNvOnnxParser_INTERNAL", "createNvOnnxParserRefitter_INTERNAL",
                              "getNvOnnxParserVersion"],
    "libnvinfer_plugin.so.10": ["initLibNvInferPlugins"],
}
WANT_VERSION = "10.13."
# attribute names the modules also use on non-TensorRT objects (torch tensors, dicts, files)
NOT_TENSORRT = {"shape", "name", "dtype", "size", "get", "read", "seek", "serialize"}

INTROSPECT = r"""
import inspect, json, re, sys
import tensorrt_bindings as trt

def describe(obj, depth):
    out = {}
    for name in dir(obj):
        if name.startswith("__") and name != "__init__":
            continue
        try:
            value = inspect.getattr_static(obj, name)
        except AttributeError:
            continue
        if isinstance(value, property):
            out[name] = {"kind": "property", "settable": value.fset is not None}
        elif isinstance(value, (staticmethod, classmethod)) or inspect.isroutine(value) or callable(value) and not isinstance(value, type):
            doc = getattr(getattr(obj, name), "__doc__", None) or ""
            out[name] = {"kind": "method", "doc": doc}
        elif isinstance(value, type):
            entry = {"kind": "class", "doc": (value.__init__.__doc__ or "") if hasattr(value, "__init__") else ""}
            if depth > 0:
                entry["members"] = describe(value, depth - 1)
            out[name] = entry
        else:
            out[name] = {"kind": "value"}
    return out

json.dump({"version": trt.__version__, "api": describe(trt, 2)}, sys.stdout)
"""


# -- the bindings, importable for introspection -----------------------------------------------------


def _bindings_dir() -> Path:
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the tensorrt-cu12-bindings wheel is not installed (scripts/setup.sh installs it: "
                    "pip install --no-deps tensorrt-cu12-bindings==10.13.3.9 on x86-64)")
    return Path(next(iter(spec.submodule_search_locations)))


def _compile_stubs(out: Path) -> None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler (cc/gcc) to build the libnvinfer stand-ins: apt install gcc"
    for soname, symbols in STUB_SYMBOLS.items():
        source = out / f"{soname}.c"
        source.write_text("".join(f"void *{name}(void) {{ return 0; }}\n" for name in symbols))
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out / soname), f"-Wl,-soname,{soname}", str(source)],
                       check=True, capture_output=True)


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> dict:
    package = _bindings_dir()
    stubs = tmp_path_factory.mktemp("nvinfer_stubs")
    _compile_stubs(stubs)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{stubs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
               PYTHONPATH=str(package.parent))
    done = subprocess.run([sys.executable, "-c", INTROSPECT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (f"the bindings in {package} do not import against the stubs (a symbol "
                                  f"missing from STUB_SYMBOLS? see `nm -D --undefined-only "
                                  f"{package / 'tensorrt.so'}`):\n{done.stderr[-2000:]}")
    data = json.loads(done.stdout)
    assert data["version"].startswith(WANT_VERSION), f"installed bindings are {data['version']}, want {WANT_VERSION}x"
    return data["api"]


# -- pybind11 signatures ----------------------------------------------------------------------------


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([<{":
            depth += 1
        elif ch in ")]>}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def signatures(doc: str, name: str) -> list[list[tuple[str, bool]]]:
    """The overloads of `name` in a pybind11 docstring: [(param, has_default), ...] without self."""
    flat = " ".join(doc.split())
    found = []
    for match in re.finditer(rf"(?:^|\s)(?:\d+\.\s)?{re.escape(name)}\(", flat):
        start, depth, i = match.end(), 1, match.end()
        while i < len(flat) and depth:
            depth += {"(": 1, ")": -1}.get(flat[i], 0)
            i += 1
        params = []
        for part in _split_params(flat[start:i - 1]):
            pname = part.split(":")[0].split("=")[0].strip()
            params.append((pname, "=" in part))
        if params and params[0][0] == "self":
            params = params[1:]
        if [p for p, _ in params] == ["*args", "**kwargs"]:
            continue  # the overload dispatcher's own line
        found.append(params)
    return found


def accepts(overload: list[tuple[str, bool]], n_positional: int, keywords: set[str]) -> bool:
    names = [p for p, _ in overload]
    if n_positional > len(overload) or not keywords <= set(names[n_positional:]):
        return False
    return all(has_default or pname in keywords for pname, has_default in overload[n_positional:])


# -- what the code uses -----------------------------------------------------------------------------


def _source(module: str) -> tuple[ast.Module, dict]:
    mod = importlib.import_module(module)  # imports without tensorrt (lazy imports)
    table = getattr(mod, "TENSORRT_API", None)
    assert isinstance(table, dict) and table, f"{module} calls TensorRT but has no TENSORRT_API table"
    return ast.parse(Path(mod.__file__).read_text()), table


def _chain(node: ast.AST) -> list[str] | None:
    """['A', 'B'] for trt.A.B (any depth), else None."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "trt" and names:
        return names[::-1]
    return None


def _resolve(api: dict, chain: list[str]) -> dict | None:
    entry, members = None, api
    for part in chain:
        if part == "__version__":
            return {"kind": "value"}
        if members is None or part not in members:
            return None
        entry = members[part]
        members = entry.get("members")
    return entry


def _call_shape(call: ast.Call) -> tuple[int, set[str]] | None:
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None
    return len(call.args), {k.arg for k in call.keywords}


@pytest.mark.parametrize("module", TENSORRT_MODULES)
def test_tensorrt_names_and_calls_exist_in_10_13(api, module):
    tree, table = _source(module)
    problems = []
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    listed: dict[str, list[str]] = {}
    for cls, members in table.items():
        entry = api.get(cls)
        if entry is None or entry["kind"] != "class":
            problems.append(f"TENSORRT_API names class trt.{cls}, which TensorRT {WANT_VERSION}x lacks")
            continue
        for member in members:
            if member not in entry["members"]:
                problems.append(f"trt.{cls} has no member '{member}'")
            listed.setdefault(member, []).append(cls)
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute) \
            else None
        if chain:
            entry = _resolve(api, chain)
            if entry is None:
                problems.append(f"line {node.lineno}: trt.{'.'.join(chain)} does not exist in TensorRT {WANT_VERSION}x")
                continue
            call = parents.get(node)
            if isinstance(call, ast.Call) and call.func is node and entry["kind"] in ("class", "method"):
                shape = _call_shape(call)
                name = "__init__" if entry["kind"] == "class" else chain[-1]
                if shape and entry["kind"] == "method" and len(chain) > 1:  # trt.Class.method(self, ...)
                    shape = (shape[0] - 1, shape[1])
                overloads = signatures(entry.get("doc", ""), name)
                if shape and overloads and not any(accepts(o, *shape) for o in overloads):
                    problems.append(f"line {node.lineno}: trt.{'.'.join(chain)}(...) with {shape[0]} positional "
                                    f"and {sorted(shape[1])} keyword arguments matches no overload: {overloads}")
        elif isinstance(node, ast.Attribute) and node.attr in listed and _chain(node.value) is None:
            entries = [api[c]["members"][node.attr] for c in listed[node.attr] if node.attr in api[c]["members"]]
            parent = parents.get(node)
            if isinstance(parent, ast.Call) and parent.func is node:
                methods = [e for e in entries if e["kind"] == "method"]
                if not methods:
                    problems.append(f"line {node.lineno}: .{node.attr}(...) calls a TensorRT property")
                    continue
                shape = _call_shape(parent)
                overloads = [o for e in methods for o in signatures(e["doc"], node.attr)]
                if shape and overloads and not any(accepts(o, *shape) for o in overloads):
                    problems.append(f"line {node.lineno}: .{node.attr}(...) with {shape[0]} positional and "
                                    f"{sorted(shape[1])} keyword arguments matches no overload of "
                                    f"{'/'.join(listed[node.attr])}.{node.attr}: {overloads}")
            elif isinstance(node.ctx, ast.Store) and not any(e.get("settable") for e in entries):
                problems.append(f"line {node.lineno}: .{node.attr} = ... but no listed class has a settable "
                                f"property '{node.attr}'")
    receivers = getattr(importlib.import_module(module), "TENSORRT_RECEIVERS", {})
    for node in ast.walk(tree):  # obj.member where obj is known to hold a TensorRT class
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) in receivers:
            cls = receivers[ast.unparse(node.value)]
            if node.attr not in api.get(cls, {}).get("members", {}):
                problems.append(f"line {node.lineno}: {ast.unparse(node)}: trt.{cls} has no member '{node.attr}'")
            elif node.attr not in table.get(cls, ()):
                problems.append(f"line {node.lineno}: {ast.unparse(node)} is not in TENSORRT_API['{cls}']")
    known = {m for cls in table if cls in api for m in api[cls].get("members", {})}
    used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and _chain(n) is None}
    used |= {n.args[1].value for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
             and n.func.id == "hasattr" and len(n.args) == 2 and isinstance(n.args[1], ast.Constant)}
    defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    defined |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                and isinstance(n.value, ast.Name) and n.value.id == "self"}  # our own attributes
    unlisted = sorted((used & known) - set(listed) - NOT_TENSORRT - defined)
    if unlisted:
        problems.append(f"members of listed TensorRT classes used but not in TENSORRT_API: {unlisted}")
    for node in ast.walk(tree):  # our subclasses of TensorRT classes override real methods
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                chain = _chain(base)
                entry = _resolve(api, chain) if chain else None
                if not chain:
                    continue
                if entry is None or entry["kind"] != "class":
                    problems.append(f"line {node.lineno}: base trt.{'.'.join(chain)} does not exist")
                    continue
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and not item.name.startswith("_"):
                        base_member = entry.get("members", {}).get(item.name)
                        if base_member is None:
                            problems.append(f"line {item.lineno}: {node.name}.{item.name} overrides nothing in "
                                            f"trt.{'.'.join(chain)}")
                            continue
                        # the docstring is the C++ side's; the trampoline may pass one argument
                        # less (IStreamReaderV2.read: destination is filled from what we return)
                        n_ours = len(item.args.args) - 1
                        theirs = signatures(base_member.get("doc", ""), item.name)
                        if theirs and not any(len(o) == n_ours or len(o) == n_ours + 1 for o in theirs):
                            problems.append(f"line {item.lineno}: {node.name}.{item.name} takes {n_ours} "
                                            f"arguments, trt.{'.'.join(chain)}.{item.name}: {theirs}")
    assert not problems, f"{module} against TensorRT {WANT_VERSION}x:\n  " + "\n  ".join(problems)


# -- the checker itself can fail ----------------------------------------------------------------------


def test_signature_parser_reads_pybind11_docstrings():
    doc = ("set_timing_cache(self: tensorrt.IBuilderConfig, cache: tensorrt.ITimingCache, ignore_mismatch: bool)"
           " -> bool\n\n  Attach a timing cache.\n")
    (overload,) = signatures(doc, "set_timing_cache")
    assert overload == [("cache", False), ("ignore_mismatch", False)]
    assert accepts(overload, 1, {"ignore_mismatch"}) and accepts(overload, 2, set())
    assert not accepts(overload, 1, set()) and not accepts(overload, 3, set()) and not accepts(overload, 1, {"x"})
    doc = ("create_execution_context(*args, **kwargs)\nOverloaded function.\n\n1. create_execution_context(self: E, "
           "strategy: S = <S.STATIC: 0>) -> C\n\n2. create_execution_context(self: E, runtime_config: R = \n"
           "<R object>) -> C\n")
    assert signatures(doc, "create_execution_context") == [[("strategy", True)], [("runtime_config", True)]]


def test_every_module_that_calls_tensorrt_is_checked():
    """A module with a `trt.` attribute chain or a TensorRT import is in TENSORRT_MODULES (runs
    without the bindings: it keeps the list above from falling behind the code)."""
    package = ROOT / "spec_edge"
    calling = set()
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        imports += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and not n.level]
        uses = any(isinstance(n, ast.Attribute) and _chain(n) for n in ast.walk(tree)) or any(
            name.split(".")[0] == "tensorrt" for name in imports)
        if uses:
            calling.add(".".join(path.relative_to(ROOT).with_suffix("").parts))
    assert calling == set(TENSORRT_MODULES), f"modules calling TensorRT vs TENSORRT_MODULES: {sorted(calling)}"
