"""Tool calls on the embedded default (SmolLM2-135M, whose template has no tools: the generic format): required /
a named tool always give calls that parse and validate against the tool's schema; auto text stays text; none
never calls; the content streams without call markup; greedy answers under speculation (ngram and a draft model
on the fp32 form; the committed EAGLE-3 head on its own form in the release tier; grammar-forced drafts on and off)
are the target-only answer token for token; refusals name the fix. Whether the 135M model picks the right tool is
its quality, not the contract (docs/tools.md)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from spec_edge.runtime.serving import front_of
from spec_edge import config as cfgmod
from spec_edge.runtime import speculative
from spec_edge.runtime.requests import ChatMessage, GenerateRequest, RequestError, Tool, ToolCall
from spec_edge.runtime.scheduler import run_one
from spec_edge.runtime.tool_format import ContentStream, HermesFormat, tools_from_json
from real_forms import REAL_FORMS
from speculated import assert_speculated

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model("fp32")
TOOLS = REPO / "bench" / "robot_tools.json"  # move_to(place: a room), pick(object), say(text): the issue's


def robot_tools() -> tuple[Tool, ...]:
    return tools_from_json(TOOLS.read_text())


INSTRUCTIONS = ["Go to the kitchen.", "Pick up the red cup.", "Tell me a joke.", "Drive to the garage and wait."]


def form_engine(form: str):
    """An engine of the real model's form `form` (test/real_forms.py, made by the session), at k 4."""
    from spec_edge import artifacts

    cfg = cfgmod.from_params({"runtime.engine_dir": str(REPO / "engines"), **REAL_FORMS[form], "speculative.k": 4})
    return artifacts.engine(cfg, progress=lambda m: None)


@pytest.fixture(scope="module")
def engine():
    return form_engine("fp32")


def valid(engine, call: ToolCall, tools=robot_tools()) -> bool:
    """The call names a tool and its arguments match that tool's schema (llguidance's own matcher, strict)."""
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None:
        return False
    constraint = engine.grammars.constraint("json_schema", tool.parameters)
    ids = engine.tokenizer.encode(call.arguments)
    return constraint.admitted(ids) == len(ids) and (constraint.consume(ids) or constraint.complete)


def ask(engine, text, **fields):
    fields = {"tools": robot_tools(), "max_new_tokens": 60, "drafter": "none", **fields}
    return run_one(engine, GenerateRequest(messages=(("user", text),), **fields))


def test_required_and_named_calls_parse_and_validate(engine):
    ids = set()
    for text in INSTRUCTIONS:
        result = ask(engine, text, tool_choice="required", parallel_tool_calls=False)
        assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1 and result.text == ""
        assert all(valid(engine, call) for call in result.tool_calls), result.tool_calls
        ids |= {call.id for call in result.tool_calls}
        assert result.stats.forced > 0  # the call syntax and the tool's keys came from the grammar
    assert len(ids) == len(INSTRUCTIONS) and all(i.startswith("call_") for i in ids)
    named = ask(engine, "Go to the kitchen.", tool_choice="say", max_new_tokens=120)  # maxLength 120
    assert [c.name for c in named.tool_calls] == ["say"] and valid(engine, named.tool_calls[0])


def test_auto_text_stays_text_and_none_never_calls(engine):
    streamed = []
    for choice in ("auto", "none"):
        result = run_one(engine, GenerateRequest(messages=(("user", "What colour is the sky?"),), tools=robot_tools(),
                                                 tool_choice=choice, max_new_tokens=40),
                                 on_text=lambda delta, n: streamed.append(delta))
        assert not result.tool_calls and "<tool_call>" not in result.text and result.finish_reason != "tool_calls"
        assert "".join(streamed) == result.text
        streamed.clear()


def test_tool_turns_render_and_the_content_streams_without_markup(engine):
    call = ToolCall("call_1", "move_to", '{"place": "kitchen"}')
    messages = (ChatMessage("user", "Go to the kitchen, then say hi."), ChatMessage("assistant", "", (call,)),
                ChatMessage("tool", "arrived", tool_call_id="call_1"))
    text = front_of(engine).chat_text(GenerateRequest(messages=messages, tools=robot_tools()))
    assert '<tool_call>\n{"name": "move_to", "arguments": {"place": "kitchen"}}\n</tool_call>' in text
    assert "<tool_response>\narrived\n</tool_response>" in text and '"name": "pick"' in text
    stream, out = ContentStream("<tool_call>"), []
    for piece in ["Sure", ", going ", "now.\n<tool", "_call>\n{", '"name"']:
        out.append(stream.push(piece))
    assert "".join(out) == "Sure, going now." and stream.finish() == ""
    held = ContentStream("<tool_call>")
    assert held.push("a <tool") == "a" and held.finish() == " <tool"
    fmt = HermesFormat(native=False)
    content, calls = fmt.split('Hi.\n<tool_call>\n{"name": "say", "arguments": {"text": "x"}}\n</tool_call>\n'
                               '<tool_call>\n{"name": "pick", "arguments": {"object": "cu')
    assert content == "Hi." and [(c.name, c.arguments) for c in calls] == [("say", '{"text": "x"}')]


@pytest.mark.parametrize("fields,message", [
    ({"tools": (Tool("a"), Tool("a"))}, "given twice"),
    ({"tools": (Tool("a b"),)}, "must be 1-64"),
    ({"tools": (Tool("a", parameters="{nope"),)}, "not valid JSON"),
    ({"tools": (Tool("a", parameters='{"type": "object", "properties": {"x": {"type": "nosuch"}}}'),)},
     r"tools\[0\] \(a\) parameters: this JSON Schema cannot be enforced at properties\.x\.type: "),
    ({"tools": (Tool("a"),), "tool_choice": "b"}, "neither auto"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": (Tool("a"),), "regex": "x"}, "cannot be combined"),
    ({"tools": (Tool("a"),), "ignore_eos": True}, "cannot be combined"),
    ({"tools": (Tool("a"),), "chat": False}, "chat template"),
])
def test_refusals(engine, fields, message):
    with pytest.raises(RequestError, match=message):
        front_of(engine).prepare(GenerateRequest(prompt="Go.", **fields))


CALL_PROMPTS = (("Go to the hall.", "required"), ("Pick up the ball and say done.", "auto"))


def speculated_calls_equal_target_only(engine, drafters: tuple[str, ...], draft_model: bool) -> None:
    """Each prompt of CALL_PROMPTS, each drafter, grammar-forced drafts off and on (and, with draft_model, the
    target as its own draft model: a ModelDrafter like the draft drafter's, under the request's grammar): the
    greedy tokens and calls are the target-only ones, and each case proves it verified and accepted drafts."""
    from spec_edge.runtime.backends.ort_runner import b1_runner
    from spec_edge.runtime.drafters.draft_model import ModelDrafter
    from tiny import run_alone

    self_runner = b1_runner(engine.graph_dir) if draft_model else None
    for text, choice in CALL_PROMPTS:
        request = GenerateRequest(messages=(("user", text),), tools=robot_tools(), tool_choice=choice,
                                  max_new_tokens=32)
        plain = run_one(engine, GenerateRequest(**{**request.__dict__, "speculate": False}))
        assert plain.stats.verify_calls == 0
        calls = plain.tool_calls and [(c.name, c.arguments) for c in plain.tool_calls]
        for drafter in drafters:
            for forced in (False, True):
                got = run_one(engine, GenerateRequest(**{**request.__dict__, "drafter": drafter, "k": 4,
                                                         "forced_drafts": forced}))
                assert (got.token_ids, got.tool_calls and [(c.name, c.arguments) for c in got.tool_calls]) == \
                    (plain.token_ids, calls)
                assert_speculated(got.stats, what=f"{drafter} forced={forced} on {text!r}")
        if draft_model:
            prepared = front_of(engine).prepare(request)
            ids, _, stats = run_alone(engine.runner, speculative.SlotRequest(
                prompt_ids=prepared.prompt_ids, max_new_tokens=32, eos_ids=engine.eos_ids, k=4,
                drafter=ModelDrafter(self_runner, name="self"), constraint=prepared.guide))
            assert ids == plain.token_ids
            assert_speculated(stats, what=f"draft model on {text!r}")


def test_greedy_calls_under_speculation_equal_target_only(engine):
    """ngram and a draft model (the target as its own draft model), each case proven to have speculated."""
    speculated_calls_equal_target_only(engine, ("ngram",), draft_model=True)


@pytest.mark.release
@pytest.mark.real_model("eagle3")
def test_greedy_calls_under_eagle3_equal_target_only():
    """The committed EAGLE-3 head on its own form (the one test_engine_switch_real makes; its target returns
    hidden states, a form no CI test needs): release tier, docs/testing.md."""
    speculated_calls_equal_target_only(form_engine("eagle3"), ("eagle3",), draft_model=False)


def test_cli_prints_the_calls_in_json(engine, capsys, tmp_path):
    """`spec-edge generate --tools FILE --tool-choice required --no-parallel-tool-calls --json`: one call, valid."""
    import yaml

    from spec_edge import cli

    profile = tmp_path / "p.yaml"  # the engine fixture's settings (one slot, k 4: no cost measurement at load)
    profile.write_text(yaml.safe_dump({"/**": {"ros__parameters": {"graphs": {"batch_slots": 1},
                                                                   "speculative": {"k": 4}}}}))
    argv = ["generate", "--prompt", "Pick up the red cup.", "--tools", str(TOOLS), "--tool-choice", "required",
            "--no-parallel-tool-calls", "--json", "--engine-dir", str(REPO / "engines"), "--weights", "fp32",
            "--config", str(profile), "--max-new-tokens", "60"]
    assert cli.main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    (call,) = out["tool_calls"]
    assert out["finish_reason"] == "tool_calls" and valid(engine, ToolCall(**call))


# a chat template that takes tools and knows <tool_call> (written here in the shape of Qwen2.5's / Hermes'; no such
# model is available offline): the format renders through it instead of the generic listing
NATIVE = ("{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
          "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
          "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': "
          "c.function.arguments} | tojson }}\n</tool_call>{% endfor %}{% if m.tool_call_id %} [{{ m.tool_call_id }}]"
          "{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_with_tools_renders_them_itself(engine, tmp_path):
    import shutil

    from spec_edge.runtime.tokenizer import Tokenizer
    from spec_edge.runtime.tool_format import for_template

    shutil.copy(engine.graph_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    meta = json.loads((engine.graph_dir / "tokenizer_config.json").read_text()) | {"chat_template": NATIVE}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(meta))
    tokenizer = Tokenizer(tmp_path)
    fmt = for_template(tokenizer.chat_template)
    assert fmt.native and not for_template(engine.tokenizer.chat_template).native
    call = ToolCall("call_7", "pick", '{"object": "cup"}')
    text = fmt.render(tokenizer, [ChatMessage("user", "Pick the cup."), ChatMessage("assistant", "", (call,)),
                                  ChatMessage("tool", "done", tool_call_id="call_7")], robot_tools())
    assert "<tools>move_to;pick;say;</tools>" in text and "done [call_7]" in text
    # Hugging Face's tojson (the tokenizer's): keys in their order
    assert '<tool_call>\n{"name": "pick", "arguments": {"object": "cup"}}\n</tool_call>' in text
