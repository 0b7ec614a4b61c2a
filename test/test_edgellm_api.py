"""Every Edge-LLM name, signature and enum value spec_edge uses exists in the real `_edgellm_runtime` of the
pinned tensorrt-edgellm wheel, imported here without a GPU against stub libraries (edgellm_native.py).

What is checked for backends/edgellm.py (its EDGELLM_API table: class -> members used; EDGELLM_RECEIVERS:
expression -> the Edge-LLM class it holds), by an AST walk of its source (problems()):
  - every `rt.X...` chain resolves in the binary, and X (and X.Y) is listed in EDGELLM_API;
  - every call `rt.X(...)` (constructor or module function) and `receiver.member(...)` matches an overload of
    the real signature (positional count, keyword names, required parameters);
  - every attribute used on a receiver exists on its class and is listed; an assigned one is a settable
    property; a property is never called;
  - every EDGELLM_API entry exists in the binary (member, or enum value).
The build's engine stage (device/edgellm_build.py: LLMBuilder; edgellm_layout.builder_limits: the LLMBuilderConfig
fields of every tensorrt profile) is checked against the same surface.
The committed snapshot the stand-in is built from (fixtures/edgellm_api.json) equals the live binary, and the
checker reports a wrong name / keyword / read-only assignment in a deliberately wrong snippet.
Skipped only when the wheel is not installed (scripts/setup.sh installs it).
"""
from __future__ import annotations

import ast
import importlib
import json
from pathlib import Path

import pytest

import edgellm_native
from edgellm_native import accepts, callable_signatures

ADAPTER = "spec_edge.runtime.backends.edgellm"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    if edgellm_native.package_dir() is None:
        pytest.skip("tensorrt-edgellm is not installed (scripts/setup.sh installs it: pip install --no-deps "
                    "tensorrt-edgellm==0.11.0)")
    assert edgellm_native.installed_version() == edgellm_native.VERSION
    return edgellm_native.introspect(tmp_path_factory.mktemp("edgellm_stubs"))


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "rt" and names:
        return names[::-1]
    return None


def _call_shape(call: ast.Call) -> tuple[int, set[str]]:
    return len(call.args), {kw.arg for kw in call.keywords if kw.arg}


def problems(source: str, table: dict[str, tuple[str, ...]], receivers: dict[str, str], api: dict) -> list[str]:
    """What in `source` does not match the binary's surface `api` or is missing from `table`."""
    out: list[str] = []
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            chain = _chain(node)
            if chain is not None:
                head = chain[0]
                if head not in api:
                    out.append(f"rt.{head}: not in the binary")
                    continue
                if head not in table:
                    out.append(f"rt.{head}: used but not listed in EDGELLM_API")
                entry = api[head]
                if len(chain) > 1:
                    member = chain[1]
                    known = set(entry.get("members", {})) | set(entry.get("enum", {}))
                    if member not in known:
                        out.append(f"rt.{head}.{member}: not in the binary")
                    elif member not in table.get(head, ()):
                        out.append(f"rt.{head}.{member}: used but not listed in EDGELLM_API[{head!r}]")
                parent = parents.get(node)
                if isinstance(parent, ast.Call) and parent.func is node and len(chain) == 1:
                    overloads = callable_signatures(api, head, None)
                    n, keywords = _call_shape(parent)
                    if overloads is None or not any(accepts(o, n, keywords) for o in overloads):
                        out.append(f"rt.{head}(...) with {n} positional, keywords {sorted(keywords)}: no overload "
                                   f"accepts it ({overloads})")
                if isinstance(parent, ast.Call) and parent.func is node and len(chain) == 2:
                    spec = entry.get("members", {}).get(chain[1], {})
                    if spec.get("kind") in ("method", "staticmethod"):
                        overloads = callable_signatures(api, head, chain[1])
                        n, keywords = _call_shape(parent)
                        if not any(accepts(o, n, keywords) for o in overloads or []):
                            out.append(f"rt.{head}.{chain[1]}(...) with {n} positional, keywords {sorted(keywords)}:"
                                       f" no overload accepts it")
                continue
        if not isinstance(node, ast.Attribute):
            continue
        receiver = ast.unparse(node.value)
        if receiver == "self.rt":
            out.append(f"self.rt.{node.attr}: name the module `rt` (rt = self.rt) so its uses are checked")
            continue
        if receiver not in receivers:
            continue
        cls = receivers[receiver]
        members = api[cls]["members"] if cls in api else {}
        where = f"{receiver}.{node.attr} ({cls})"
        if node.attr not in members:
            out.append(f"{where}: not in the binary")
            continue
        if node.attr not in table.get(cls, ()):
            out.append(f"{where}: used but not listed in EDGELLM_API[{cls!r}]")
        spec, parent = members[node.attr], parents.get(node)
        if isinstance(node.ctx, ast.Store) and not (spec["kind"] == "property" and spec["settable"]):
            out.append(f"{where}: assigned, but it is not a settable property")
        if isinstance(parent, ast.Call) and parent.func is node:
            if spec["kind"] == "property":
                out.append(f"{where}: a property, called")
            else:
                n, keywords = _call_shape(parent)
                overloads = callable_signatures(api, cls, node.attr) or []
                if not any(accepts(o, n, keywords) for o in overloads):
                    out.append(f"{where}(...) with {n} positional, keywords {sorted(keywords)}: no overload accepts "
                               f"it ({overloads})")
    for cls, used in table.items():
        if cls not in api:
            out.append(f"EDGELLM_API[{cls!r}]: not in the binary")
            continue
        known = set(api[cls].get("members", {})) | set(api[cls].get("enum", {}))
        out += [f"EDGELLM_API[{cls!r}]: {m} not in the binary" for m in used if m not in known]
    for receiver, cls in receivers.items():
        if cls not in api:
            out.append(f"EDGELLM_RECEIVERS[{receiver!r}]: {cls} not in the binary")
    return out


def _adapter():
    mod = importlib.import_module(ADAPTER)
    return Path(mod.__file__).read_text(), mod.EDGELLM_API, mod.EDGELLM_RECEIVERS


def test_snapshot_is_the_live_binary(live):
    """The stand-in (edgellm_standin.py) is built from this snapshot: it must be the real surface."""
    snapshot = json.loads(edgellm_native.SNAPSHOT.read_text())
    assert snapshot["version"] == edgellm_native.VERSION and snapshot["payload"] == edgellm_native.PAYLOAD
    assert snapshot["api"] == live, ("the committed snapshot differs from the installed binary: regenerate it with "
                                     "`PYTHONPATH=$PWD .venv/bin/python test/edgellm_native.py` and review the diff")


def test_the_adapter_uses_only_what_the_binary_has(live):
    source, table, receivers = _adapter()
    assert problems(source, table, receivers, live) == []
    used = sum(len(members) or 1 for members in table.values())
    assert used >= 60, f"EDGELLM_API lists {used} names"  # what the adapter calls; see the report in docs


def test_every_listed_name_is_used_by_the_adapter(live):
    """The table holds what the source uses, no more (so it says what the adapter depends on)."""
    source, table, receivers = _adapter()
    words = {node.attr for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)}
    names = {node.id for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Name)}
    unused = [f"{cls}.{m}" for cls, members in table.items() for m in members
              if m != "__init__" and m not in words]
    unused += [cls for cls in table if cls not in words | names | set(receivers.values())]
    assert unused == []


WRONG = '''
def serve(rt, engine_dir):
    runtime = rt.LLMRuntime(engine_dir, draft_topk=1)
    call = rt.LLMGenerationRequest()
    call.max_new_tokens = 4
    channel = rt.StreamChannel.create()
    chunk = channel.wait_pop()
    rt.FinishReason.EOS
    rt.LLMGenerator()
    handle = rt.RequestEngine(engine_dir).submit(call)
    handle.result()
    self.rt.FinishReason.EOS
    chunk.token_ids = []
    return call
'''


def test_the_checker_fails_on_wrong_names_and_keywords(live):
    """The check has teeth: a misspelt keyword, an unknown property, a missing argument, a wrong enum value,
    an unknown class, an unknown method, an assignment to a read-only property are each reported."""
    table = {"LLMRuntime": ("__init__",), "LLMGenerationRequest": ("__init__", "max_new_tokens"),
             "StreamChannel": ("create", "wait_pop"), "FinishReason": ("EOS",), "RequestEngine": ("__init__",),
             "RequestHandle": ("result",), "StreamChunk": ("token_ids",)}
    receivers = {"call": "LLMGenerationRequest", "handle": "RequestHandle", "chunk": "StreamChunk",
                 "channel": "StreamChannel"}
    found = "\n".join(problems(WRONG, table, receivers, live))
    assert "rt.LLMRuntime(...) with 1 positional, keywords ['draft_topk']" in found
    assert "call.max_new_tokens (LLMGenerationRequest): not in the binary" in found
    assert "channel.wait_pop (StreamChannel)(...) with 0 positional" in found  # timeout_ms is required
    assert "rt.FinishReason.EOS: not in the binary" in found
    assert "rt.LLMGenerator: not in the binary" in found
    assert "handle.result (RequestHandle): not in the binary" in found
    assert "chunk.token_ids (StreamChunk): assigned, but it is not a settable property" in found
    assert "EDGELLM_API['LLMGenerationRequest']: max_new_tokens not in the binary" in found
    assert "self.rt.FinishReason: name the module `rt`" in found
    # and the same snippet with the real names passes
    right = (WRONG.replace("    self.rt.FinishReason.EOS\n", "").replace("draft_topk=1", "context_cache_config=None").replace("call.max_new_tokens", "call.max_generate_length")
             .replace("wait_pop()", "wait_pop(20)").replace("rt.FinishReason.EOS", "rt.FinishReason.END_ID")
             .replace("    rt.LLMGenerator()\n", "").replace("handle.result()", "handle.cancel()")
             .replace("    chunk.token_ids = []\n", ""))
    table = {"LLMRuntime": ("__init__",), "LLMGenerationRequest": ("__init__", "max_generate_length"),
             "StreamChannel": ("create", "wait_pop"), "FinishReason": ("END_ID",), "RequestEngine": ("__init__", "submit"),
             "RequestHandle": ("cancel",), "StreamChunk": ()}
    assert problems(right, table, receivers, live) == []


def test_the_build_stage_uses_only_what_the_binary_has(live):
    """spec-edge build's engine stage (device/edgellm_build.py): LLMBuilderConfig() takes no argument, every field
    edgellm_layout.builder_limits() sets, for every tensorrt profile in config/, is a settable property of it, and
    LLMBuilder(onnx_dir, engine_dir, config).build() matches the real signatures; the same for the visual engine
    (VisualBuilderConfig, edgellm_layout.visual_limits of every VLM profile, VisualBuilder), whose defaults are the
    ones edgellm_layout restates."""
    from spec_edge.config import load
    from spec_edge import edgellm_layout
    from spec_edge.edgellm_layout import builder_limits

    api = live
    assert accepts(callable_signatures(api, "LLMBuilderConfig", None)[0], 0, set())
    assert any(accepts(o, 3, set()) for o in callable_signatures(api, "LLMBuilder", None))
    assert any(accepts(o, 0, set()) for o in callable_signatures(api, "LLMBuilder", "build"))
    fields = api["LLMBuilderConfig"]["members"]
    profiles = [cfg for cfg in map(load, sorted((ROOT / "config").glob("*.yaml"))) if cfg.runtime.backend == "tensorrt"]
    assert len(profiles) >= 6
    for cfg in profiles:
        for folder, roles in builder_limits(cfg).items():
            for role, values in roles.items():
                for name in values:
                    assert fields.get(name, {}).get("kind") == "property" and fields[name]["settable"], \
                        f"{cfg.runtime.profile} {folder} {role}: LLMBuilderConfig.{name} is not a settable field"
    assert accepts(callable_signatures(api, "VisualBuilderConfig", None)[0], 0, set())
    assert any(accepts(o, 3, set()) for o in callable_signatures(api, "VisualBuilder", None))
    assert any(accepts(o, 0, set()) for o in callable_signatures(api, "VisualBuilder", "build"))
    defaults = api["VisualBuilderConfig"]["defaults"]
    assert (defaults["min_image_tokens"], defaults["max_image_tokens_per_image"]) == (
        edgellm_layout.MIN_IMAGE_TOKENS, edgellm_layout.MAX_IMAGE_TOKENS_PER_IMAGE)
    visual = [cfg for cfg in profiles if edgellm_layout.visual_limits(cfg)]
    assert visual, "no VLM profile (graphs.max_image_tokens) in config/"
    for cfg in visual:
        for name in edgellm_layout.visual_limits(cfg):
            member = api["VisualBuilderConfig"]["members"].get(name, {})
            assert member.get("kind") == "property" and member["settable"], f"VisualBuilderConfig.{name}"
    for name in ("multimodal_engine_dir",):  # the runtimes' second parameter, passed positionally
        assert name in api["LLMRuntime"]["members"]["__init__"]["doc"].split("engine_dir: str,")[1][:40]
        assert name in api["RequestEngine"]["members"]["__init__"]["doc"].split("engine_dir: str,")[1][:40]


def _binary_bytes() -> bytes:
    return edgellm_native.extension(edgellm_native.package_dir()).read_bytes()


def test_the_tool_surface_is_the_binarys_and_returns_no_calls(live):
    """What docs/tensorrt.md ("Tool calls on Edge-LLM") says of Edge-LLM's own tool fields, read off the live
    binary: the request and its messages carry tools (the stand-in has them: it is built from this surface), and
    nothing a request returns carries a tool call (its server parses calls in Python), so the adapter constrains and
    parses calls itself and leaves these fields unset."""
    members = {name: set(entry.get("members", {})) for name, entry in live.items()}
    assert {"tools", "tool_choice", "parallel_tool_calls", "apply_chat_template"} <= members["LLMGenerationRequest"]
    assert {"tool_calls", "has_tool_calls", "tool_call_id"} <= members["Message"]
    assert {"name", "description", "parameters", "strict"} <= members["ToolDefinition"]
    assert {"mode", "function_name"} <= members["ToolChoice"]
    assert set(live["ToolChoiceMode"]["enum"]) == {"NONE", "AUTO", "REQUIRED", "FUNCTION"}
    assert {"id", "type", "name", "arguments", "arguments_is_string"} <= members["MessageToolCall"]
    returned = members["LLMGenerationResponse"] | members["StreamChunk"]
    assert not [m for m in returned if "tool" in m or "call" in m], returned
    assert "STRUCTURAL_TAG" in live["GuideType"]["enum"]
    source, table, receivers = _adapter()
    assert not [m for m in ("tools", "tool_choice", "parallel_tool_calls") if f"call.{m}" in source]


# each structural-tag type and key we send -> a string of the binary that shows xgrammar's parser reads it: the name
# as a literal of its own, or one of the parser's messages about that format / field (xgrammar structural_tag.cc)
XGRAMMAR_EVIDENCE = {
    "structural_tag": 'Structural tag\'s type must be a string "structural_tag"',
    "format": "Structural tag must have a format field", "type": "Format's type must be a string",
    "any_text": "\0any_text\0", "excludes": "\0excludes\0",
    "or": "Or format must have an elements field", "sequence": "Sequence format must have an elements field",
    "elements": "Sequence format must have an elements field", "tags_with_separator": "\0tags_with_separator\0",
    "tags": "Tags with separator format must have a tags field",
    "separator": "Tags with separator format's separator field", "at_least_one": "\0at_least_one\0",
    "stop_after_first": "\0stop_after_first\0", "tag": 'Tag format\'s type must be a string "tag"',
    "begin": "Tag format's begin field must be", "content": "Tag format must have a content field",
    "end": "Tag format must have an end field", "json_schema": "JSON schema format must have a json_schema field",
    "regex": "Regex format must have a pattern field", "pattern": "Regex format must have a pattern field",
    "const_string": "\0const_string\0", "value": "ConstString format must have a value field",
    "optional": "Optional format must have a content field", "token": "TokenFormat must have a token field",
}


def test_the_tool_call_structural_tag_speaks_the_binarys_xgrammar(live):
    """The format types and keys of every tool format's structural tag (tool_format.*.structural_tag, what
    edgellm.tool_guide sends) are in the binary (its vendored xgrammar structural_tag.cc, the vocabulary of xgrammar
    0.2.1): each by a distinguishing string of the parser (XGRAMMAR_EVIDENCE: the name as a null-terminated literal
    of its own, or the parser's message about that format / field; a short name like "or" or "end" is a substring
    of any large binary, so its bare presence proves nothing); and the stand-in's json_schema refusal is the
    binary's list and message."""
    from spec_edge.runtime.tool_format import HermesFormat, LlamaJsonFormat, MistralFormat
    import edgellm_standin

    binary = _binary_bytes()
    schemas = {"say": {"type": "object", "properties": {"text": {"type": "string"}}}, "stop": {"type": "object"}}
    names: set[str] = set()

    def walk(node) -> None:  # the keys and "type" values of the format, not of the tools' JSON Schemas
        if isinstance(node, dict):
            names.update(node)
            names.add(node["type"])
            for key, value in node.items():
                if key != "json_schema" and isinstance(value, (dict, list)):
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    formats = (HermesFormat(native=False), LlamaJsonFormat(), MistralFormat(spaced=True, token=None),
               MistralFormat(spaced=False, token=5))
    for fmt in formats:
        for choice in ("none", "auto", "required", "say"):
            for parallel in (False, True):
                walk(fmt.structural_tag(schemas, choice, parallel))
    assert {"structural_tag", "any_text", "excludes", "or", "sequence", "tags_with_separator", "tag",
            "json_schema", "at_least_one", "stop_after_first", "separator", "begin", "end", "regex", "pattern",
            "const_string", "value", "optional", "content", "token"} <= names
    assert sorted(names - set(XGRAMMAR_EVIDENCE)) == []  # every name we send has its evidence below
    for name in sorted(names):
        assert XGRAMMAR_EVIDENCE[name].encode() in binary, (name, XGRAMMAR_EVIDENCE[name])
    for keyword in edgellm_standin.UNENFORCED_KEYWORDS:
        assert b"\0" + keyword.encode() + b"\0" in binary, keyword
    assert b"\0" + edgellm_standin.UNENFORCED.encode() + b"\0" in binary
