"""The real `_edgellm_runtime` of the pinned tensorrt-edgellm wheel, importable without a GPU, and its
API surface as data (test_edgellm_api.py checks it; edgellm_standin.py builds the stand-in from it).

The extension links libnvinfer.so.10, libnvonnxparser.so.10, libcuda.so.1 and libcudart.so.13 (JetPack
provides them; here they are absent). To merely import it, stub libraries exporting exactly the
symbols it leaves undefined (`nm -D --undefined-only`, those of the four libraries) are compiled with
the system C compiler; libcudart's symbols carry the version node `libcudart.so.13`, so its stub gets a
version script. Every stub function returns 1 / NULL, so a constructor that touches CUDA fails
(`cudaStreamCreateWithFlags`): names, signatures and enum values are what can be read, nothing runs.
The payload is loaded directly (tensorrt_edgellm/_native/select.py picks one by the exact L4T / GPU,
which this machine has not): PAYLOAD, the x86-64 build for TensorRT 10 / CUDA 13 (same binding
source revision as the Thor payloads, variants.json: source_revision).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

VERSION = "0.11.0"
PAYLOAD = "x86-ubuntu2204-cu13-sm80"
SNAPSHOT = Path(__file__).parent / "fixtures" / "edgellm_api.json"
# libraries the extension needs and does not find here; the symbols each must export
STUB_LIBRARIES = ("libnvinfer.so.10", "libnvonnxparser.so.10", "libcuda.so.1", "libcudart.so.13")

INTROSPECT = r"""
import importlib.util, inspect, json, sys
path = sys.argv[1]
spec = importlib.util.spec_from_file_location("tensorrt_edgellm._edgellm_runtime", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)

def doc_of(value):
    import re
    return re.sub(r" at 0x[0-9a-f]+>", ">", " ".join((getattr(value, "__doc__", None) or "").split()))

def describe_class(cls):
    members = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") and name != "__init__":
            continue
        value = inspect.getattr_static(cls, name)
        if isinstance(value, property):
            members[name] = {"kind": "property", "settable": value.fset is not None, "doc": doc_of(value)}
        elif name == "__members__" or isinstance(value, cls):
            members[name] = {"kind": "enum_value", "value": int(getattr(cls, name))}
        elif isinstance(value, staticmethod):
            members[name] = {"kind": "staticmethod", "doc": doc_of(getattr(cls, name))}
        elif callable(value):
            members[name] = {"kind": "method", "doc": doc_of(getattr(cls, name))}
        else:
            members[name] = {"kind": "value", "repr": repr(value)}
    out = {"kind": "class", "members": members}
    if hasattr(cls, "__members__"):
        out["enum"] = {k: int(v) for k, v in cls.__members__.items()}
        out["members"] = {k: v for k, v in members.items() if v["kind"] != "enum_value" and k not in out["enum"]}
    return out

api = {}
for name in sorted(dir(mod)):
    if name.startswith("_"):
        continue
    value = getattr(mod, name)
    if isinstance(value, type):
        api[name] = describe_class(value)
    elif callable(value):
        api[name] = {"kind": "function", "doc": doc_of(value)}
    else:
        api[name] = {"kind": "value", "repr": repr(value)}
# default field values of the builder configs (plain structs: constructing one touches no CUDA)
for name in ("LLMBuilderConfig", "VisualBuilderConfig"):
    obj = getattr(mod, name)()
    api[name]["defaults"] = {m: getattr(obj, m) for m, v in api[name]["members"].items() if v["kind"] == "property"}
json.dump(api, sys.stdout, indent=1, sort_keys=True)
"""


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
            params.append((part.split(":")[0].split("=")[0].strip(), "=" in part))
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


def callable_signatures(api: dict, owner: str, member: str | None) -> list[list[tuple[str, bool]]] | None:
    """The overloads of api[owner] (a module function, member None) or of its member ("__init__", a
    method, a staticmethod); None when it has no readable signature (a class without a constructor)."""
    entry = api[owner]
    if member is None:
        return signatures(entry["doc"], owner) if entry["kind"] == "function" else \
            callable_signatures(api, owner, "__init__")
    doc = entry["members"][member].get("doc", "")
    found = signatures(doc, member)
    return found or None


def package_dir() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_edgellm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed_version() -> str:
    from importlib.metadata import version

    return version("tensorrt-edgellm")


def extension(package: Path) -> Path:
    manifest = json.loads((package / "_native" / "variants.json").read_text())
    row = next((v for v in manifest["variants"] if v["variant_id"] == PAYLOAD), None)
    assert row is not None, f"tensorrt-edgellm {manifest['package_version']} has no payload {PAYLOAD}"
    return package / row["extension"]


def undefined_symbols(library: Path) -> dict[str, list[str]]:
    """STUB_LIBRARIES -> the symbols `library` needs from it (unversioned ones: by name prefix)."""
    listing = subprocess.run(["nm", "-D", "--undefined-only", str(library)], check=True, capture_output=True,
                             text=True).stdout
    out: dict[str, list[str]] = {name: [] for name in STUB_LIBRARIES}
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) != 2 or parts[0] != "U":
            continue
        symbol, _, node = parts[1].partition("@")
        if node in out:
            out[node].append(symbol)
        elif not node and symbol.startswith(("cu", "__cuda")) and not symbol.startswith("cuda"):
            out["libcuda.so.1"].append(symbol)
        elif not node and symbol.startswith("cuda"):
            out["libcudart.so.13"].append(symbol)
        elif not node and symbol.endswith("OnnxParser_INTERNAL") or "NvOnnxParser" in symbol:
            out["libnvonnxparser.so.10"].append(symbol)
        elif not node and re.match(r"(createInfer|getInfer|getPluginRegistry|getBuilderPluginRegistry)", symbol):
            out["libnvinfer.so.10"].append(symbol)
    return out


def compile_stubs(library: Path, out: Path) -> dict[str, list[str]]:
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "no C compiler (cc / gcc) to build the libnvinfer / libcudart stand-ins: apt install gcc"
    needed = undefined_symbols(library)
    for soname, symbols in needed.items():
        source = out / f"{soname}.c"
        source.write_text("".join(f"long {name}(void) {{ return 1; }}\n" if name.startswith("cu") else
                                  f"void *{name}(void) {{ return 0; }}\n" for name in symbols))
        args = [compiler, "-shared", "-fPIC", "-o", str(out / soname), f"-Wl,-soname,{soname}", str(source)]
        if soname == "libcudart.so.13":  # the extension asks for symbol@libcudart.so.13
            script = out / "cudart.map"
            script.write_text("libcudart.so.13 { global: *; };\n")
            args.append(f"-Wl,--version-script={script}")
        subprocess.run(args, check=True, capture_output=True)
    return needed


def introspect(stub_dir: Path) -> dict:
    """The live binary's surface: name -> {kind, members / enum / doc} (see INTROSPECT)."""
    package = package_dir()
    assert package is not None, "tensorrt-edgellm is not installed"
    library = extension(package)
    compile_stubs(library, stub_dir)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{stub_dir}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    done = subprocess.run([sys.executable, "-c", INTROSPECT, str(library)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (f"{library.name} does not import against the stubs (a symbol the stubs miss? see "
                                  f"`nm -D --undefined-only {library}`):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


if __name__ == "__main__":  # write the snapshot: python test/edgellm_native.py
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        surface = introspect(Path(tmp))
    SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
    SNAPSHOT.write_text(json.dumps({"version": installed_version(), "payload": PAYLOAD, "api": surface},
                                   indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}: {len(surface)} names")
