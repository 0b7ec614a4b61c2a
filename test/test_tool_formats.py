"""The tool formats of other model families, through their real chat templates (test/fixtures/chat_templates/,
each with where it came from): Llama 3.1 / 3.2 JSON calls and Mistral `[TOOL_CALLS]`. The embedded SmolLM2's
tokenizer and model run with the fixture template substituted for its own (no such model is available offline):
the template picks the format, renders tools, earlier calls and tool results without error, the grammar of each
tool_choice forces calls that parse and validate, the parser returns calls with ids the template accepts, and
greedy answers under speculation equal the target-only answer token for token. Each format's XGrammar structural
tag (Edge-LLM's constraint) is checked against its Lark grammar: the calls it spells are ones the grammar accepts,
for the tools the tool_choice allows, with text where the grammar allows text."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from spec_edge.runtime.serving import front_of
from spec_edge import config as cfgmod
from spec_edge.runtime.front import Front
from spec_edge.runtime.requests import ChatMessage, GenerateRequest, RequestError, ToolCall
from spec_edge.runtime.scheduler import run_one
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.runtime.tool_format import (HermesFormat, LlamaJsonFormat, MistralFormat, arguments_schema,
                                           mistral_id, tool_specs)
from speculated import assert_speculated
from test_tools import robot_tools, valid

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model("fp32")
TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
LLAMA32, LLAMA31 = "meta-llama-Llama-3.2-3B-Instruct.jinja", "vllm-tool_chat_template_llama3.1_json.jinja"
NEMO, MISTRAL03 = "mistralai-Mistral-Nemo-Instruct-2407.jinja", "vllm-tool_chat_template_mistral_official.jinja"
SMALL31 = "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja"
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@pytest.fixture(scope="module")
def engine():
    from spec_edge import artifacts

    cfg = cfgmod.from_params({"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32",
                              "graphs.batch_slots": 1, "speculative.k": 4})
    return artifacts.engine(cfg, progress=lambda m: None)


@pytest.fixture(scope="module")
def fronts(engine, tmp_path_factory):
    """{fixture name: a Front of the engine whose tokenizer has that chat template instead of SmolLM2's}."""
    out = {}
    for name in (LLAMA32, LLAMA31, NEMO, MISTRAL03, SMALL31):
        folder = tmp_path_factory.mktemp(name.split(".jinja")[0].replace(".", "_"))
        shutil.copy(engine.graph_dir / "tokenizer.json", folder / "tokenizer.json")
        meta = json.loads((engine.graph_dir / "tokenizer_config.json").read_text())
        meta["chat_template"] = (TEMPLATES / name).read_text()
        (folder / "tokenizer_config.json").write_text(json.dumps(meta))
        front = front_of(engine)
        out[name] = Front(front.cfg, Tokenizer(folder), front.caps, front.compile)
    return out


def test_the_template_picks_the_format(engine, fronts):
    assert isinstance(fronts[LLAMA32].tool_format, LlamaJsonFormat)
    assert isinstance(fronts[LLAMA31].tool_format, LlamaJsonFormat)
    nemo, v03 = fronts[NEMO].tool_format, fronts[MISTRAL03].tool_format
    assert isinstance(nemo, MistralFormat) and not nemo.spaced and nemo.token is None  # no [TOOL_CALLS] token here
    assert isinstance(v03, MistralFormat) and v03.spaced and fronts[SMALL31].tool_format.spaced
    assert isinstance(front_of(engine).tool_format, HermesFormat) and not front_of(engine).tool_format.native


CALL = ToolCall("call_1", "move_to", '{"place": "kitchen"}')
TURNS = (ChatMessage("system", "You are a robot."), ChatMessage("user", "Go to the kitchen, then say hi."),
         ChatMessage("assistant", "", (CALL,)), ChatMessage("tool", "arrived", tool_call_id="call_1"))


@pytest.mark.parametrize("name", [LLAMA32, LLAMA31])
def test_llama_renders_tools_calls_and_results_through_its_template(fronts, name):
    front = fronts[name]
    text = front.chat_text(GenerateRequest(messages=TURNS, tools=robot_tools()))
    # the tools in the first user message (tools_in_user_message), as the template dumps them
    user = text.index("<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions")
    assert text.index(json.dumps(tool_specs(robot_tools())[0], indent=4)) > user
    assert text.index("Go to the kitchen, then say hi.<|eot_id|>") > user and "You are a robot." in text
    # the call as the assistant's whole message, the result in role ipython
    assert ('<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "move_to", "parameters": {"place": "kitchen"}}'
            '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n') in text
    assert '"arrived"' in text and text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    two = TURNS[:2] + (ChatMessage("assistant", "", (CALL, CALL)),)
    with pytest.raises(RequestError, match="one call per assistant turn"):
        front.chat_text(GenerateRequest(messages=two, tools=robot_tools()))


@pytest.mark.parametrize("name,sep", [(NEMO, ""), (MISTRAL03, " "), (SMALL31, " ")])
def test_mistral_renders_tools_calls_and_results_with_ids_its_template_accepts(fronts, name, sep):
    front = fronts[name]
    for given in ("call_1", "a1B2c3D4e"):  # an OpenAI-style id (mapped to 9 letters and digits), a Mistral id (kept)
        turns = TURNS[:2] + (ChatMessage("assistant", "", (ToolCall(given, CALL.name, CALL.arguments),)),
                             ChatMessage("tool", "arrived", tool_call_id=given))
        text = front.chat_text(GenerateRequest(messages=turns, tools=robot_tools()))
        sent = mistral_id(given)
        assert MISTRAL_ID.fullmatch(sent) and (sent == given) == (given == "a1B2c3D4e")
        assert text.index(f"[AVAILABLE_TOOLS]{sep}[") < text.index("Go to the kitchen")
        assert '{"type": "function", "function": {"name": "move_to", "description": "Drive the robot' in text
        assert (f'[TOOL_CALLS]{sep}[{{"name": "move_to", "arguments": {{"place": "kitchen"}}, "id": "{sent}"}}]'
                in text)
        assert f'[TOOL_RESULTS]{sep}{{"content": arrived, "call_id": "{sent}"}}[/TOOL_RESULTS]' in text


def ask(front, engine, monkeypatch, text, **fields):
    monkeypatch.setattr(engine, "tokenizer", front.tokenizer)  # the front renders with its template
    fields = {"tools": robot_tools(), "max_new_tokens": 60, "drafter": "none", **fields}
    return run_one(engine, GenerateRequest(messages=(("user", text),), **fields))


@pytest.mark.parametrize("name", [LLAMA32, NEMO, MISTRAL03])
def test_each_tool_choice_gives_what_it_promises(engine, fronts, monkeypatch, name):
    """required / a name: calls that parse and validate (Llama: one, even with parallel_tool_calls); auto: calls or
    text that does not start like one; none: never a call."""
    front, mistral = fronts[name], name != LLAMA32
    ids = set()
    for text, fields in (("Pick up the red cup.", {"tool_choice": "required", "parallel_tool_calls": False}),
                         ("Go to the kitchen and say hi.", {"tool_choice": "required"}),
                         ("Tell me a joke.", {"tool_choice": "say", "parallel_tool_calls": False,
                                              "max_new_tokens": 120})):
        result, parallel = ask(front, engine, monkeypatch, text, **fields), fields.get("parallel_tool_calls", True)
        # several calls may run into max_new_tokens (the complete ones are the result)
        ends = ("tool_calls", "length") if mistral and parallel else ("tool_calls",)
        assert result.finish_reason in ends and result.text == "" and result.tool_calls, result
        assert all(valid(engine, call) for call in result.tool_calls), result.tool_calls
        if not (mistral and parallel):
            assert len(result.tool_calls) == 1
        if fields["tool_choice"] == "say":
            assert [c.name for c in result.tool_calls] == ["say"]
        assert result.stats.forced > 0  # the call syntax came from the grammar
        ids |= {c.id for c in result.tool_calls}
        assert all(MISTRAL_ID.fullmatch(i) if mistral else i.startswith("call_") for i in ids)
    assert len(ids) >= 3
    for choice in ("auto", "none"):
        result = ask(front, engine, monkeypatch, "What colour is the sky?", tool_choice=choice, max_new_tokens=30)
        if result.tool_calls:
            assert choice == "auto" and all(valid(engine, c) for c in result.tool_calls) and result.text == ""
        else:
            assert result.finish_reason != "tool_calls" and not result.text.lstrip().startswith("{[<"[mistral])
    # a call the answer made goes back through the template with its id
    call = ask(front, engine, monkeypatch, "Go to the hall.", tool_choice="move_to").tool_calls[0]
    back = (ChatMessage("user", "Go to the hall."), ChatMessage("assistant", "", (call,)),
            ChatMessage("tool", '{"arrived": true}', tool_call_id=call.id))
    text = front.chat_text(GenerateRequest(messages=back, tools=robot_tools()))
    assert (f'"id": "{call.id}"' in text and f'"call_id": "{call.id}"' in text) if mistral else \
        f'{{"name": "move_to", "parameters": {call.arguments}}}<|eot_id|>' in text


def test_parsers_and_streams():
    llama, mistral = LlamaJsonFormat(), MistralFormat(spaced=False, token=None)
    content, (call,) = llama.split('{"name": "say", "parameters": {"text": "hi"}}')
    assert content == "" and (call.name, call.arguments) == ("say", '{"text": "hi"}') and call.id.startswith("call_")
    assert llama.split("Hello {there}") == ("Hello {there}", [])
    assert llama.split('{"name": "say", "parameters": {"te') == ("", [])  # cut short (length): no call
    content, calls = mistral.split('[TOOL_CALLS][{"name": "say", "arguments": {"text": "x"}, "id": "abcDEF123"}, '
                                   '{"name": "pick", "arguments": {"object": "cup"}, "id": "abcDEF123"}, {"name": "pi')
    assert content == "" and [(c.id, c.name) for c in calls][0] == ("abcDEF123", "say") and len(calls) == 2
    # the model's id where it gives a new one, else one of ours
    assert MISTRAL_ID.fullmatch(calls[1].id) and calls[1].id != calls[0].id
    assert calls[1].arguments == '{"object": "cup"}'
    # the [TOOL_CALLS] token is special in Mistral's tokenizer: decoding skips it
    assert [c.name for c in mistral.split(' [{"name": "say", "arguments": {"text": "x"}}]')[1]] == ["say"]
    assert mistral.split("Sure [1] is it.") == ("Sure [1] is it.", [])
    for fmt, call_text in ((llama, '{"name"'), (mistral, "[TOOL_CALLS][{")):
        stream = fmt.content_stream()
        assert [stream.push(p) for p in ("\n", " ", call_text[:2], call_text[2:])] == ["", "", "", ""]
        assert stream.finish() == ""
        stream = fmt.content_stream()
        assert [stream.push(p) for p in ("\n", "Hi {x} [y]", " there")] == ["", "\nHi {x} [y]", " there"]
        assert stream.finish() == ""


def test_mistral_grammar_with_the_tool_calls_token(engine):
    """Where the tokenizer has [TOOL_CALLS] as one token the grammar forces that token (llguidance `<[id]>`), not
    its spelling; here SmolLM2's <|im_start|> (id 1) stands for it."""
    token = engine.tokenizer.token_id("<|im_start|>")
    fmt = MistralFormat(spaced=True, token=token)
    schemas = {t.name: json.loads(t.parameters) for t in robot_tools()}
    for choice in ("required", "auto"):
        constraint = engine.grammars.constraint("grammar", fmt.grammar(schemas, choice, parallel=True))
        ids = [token] + engine.tokenizer.encode(' [{"name": "say", "arguments": {"text": "hi"}, "id": "a1B2c3D4e"}]')
        assert constraint.admitted(ids) == len(ids)
        constraint.consume(ids)
        assert constraint.complete
    spelled = engine.grammars.constraint("grammar", fmt.grammar(schemas, "required", parallel=False))
    assert spelled.admitted(engine.tokenizer.encode("[TOOL_CALLS] [")) == 0
    for choice in ("none", "auto"):  # text never starts with the token, nor with "["
        text = engine.grammars.constraint("grammar", fmt.grammar(schemas, choice, parallel=False))
        ids = engine.tokenizer.encode("Hi [x]")
        assert text.admitted(ids) == len(ids) and text.admitted([token]) == (choice == "auto")
        assert text.admitted(engine.tokenizer.encode("[")) == 0


def _nodes(node):
    """Every format object of a structural tag (not the tools' JSON Schemas)."""
    if isinstance(node, dict):
        yield node
        for key, value in node.items():
            if key != "json_schema":
                yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)


ARGS = {"move_to": {"place": "kitchen"}, "pick": {"object": "cup"}, "say": {"text": "hi"}}


@pytest.mark.parametrize("family", ["generic", "llama", "mistral-spaced", "mistral-nemo", "mistral-token"])
def test_each_format_spells_its_grammar_as_a_structural_tag(engine, family):
    """The structural tag of each tool_choice (Edge-LLM's constraint) and the Lark grammar (the CPU path's) speak of
    the same calls: every call the tag spells (its tags' begin, arguments of the tool's schema, end) is an answer
    the grammar accepts, for exactly the tools the choice allows; text where (and only where) the grammar takes
    text; one call, or several with parallel_tool_calls (never for Llama). Mistral's [TOOL_CALLS] token (SmolLM2's
    <|im_start|> stands for it) is a `token` of the tag, named by its text. xgrammar is not a dependency: the
    languages were compared string by string with xgrammar 0.2.1 (docs/tensorrt.md, "Tool calls on Edge-LLM")."""
    token = engine.tokenizer.token_id("<|im_start|>")
    fmt = {"generic": HermesFormat(native=False), "llama": LlamaJsonFormat(),
           "mistral-spaced": MistralFormat(spaced=True, token=None),
           "mistral-nemo": MistralFormat(spaced=False, token=None),
           "mistral-token": MistralFormat(spaced=True, token=token)}[family]
    schemas = {t.name: json.loads(t.parameters) for t in robot_tools()}
    encode = engine.tokenizer.encode

    def message(call: str) -> list[int]:  # one call as the whole answer
        if not isinstance(fmt, MistralFormat):
            return encode(call)
        opener = [token] if fmt.token is not None else encode(fmt.opener)
        return opener + encode((" [" if fmt.spaced else "[") + call + "]")

    def accepts(grammar: str, ids: list[int]) -> bool:
        constraint = engine.grammars.constraint("grammar", grammar)
        return constraint.admitted(ids) == len(ids) and (constraint.consume(ids) or constraint.complete)

    for choice in ("none", "auto", "required", "say"):
        for parallel in (False, True):
            tag, grammar = fmt.structural_tag(schemas, choice, parallel), fmt.grammar(schemas, choice, parallel)
            assert tag["type"] == "structural_tag" and json.loads(json.dumps(tag)) == tag
            nodes = list(_nodes(tag["format"]))
            tags = [n for n in nodes if n["type"] == "tag"]
            names = [re.search(r'"name": "(\w+)"', t["begin"]).group(1) for t in tags]
            assert names == {"none": [], "say": ["say"]}.get(choice, list(schemas)), (choice, names)
            for name, t in zip(names, tags):
                assert accepts(grammar, message(t["begin"] + json.dumps(ARGS[name]) + t["end"])), (choice, t)
                [arguments] = [n for n in _nodes(t["content"]) if n["type"] == "json_schema"]
                assert arguments["json_schema"] == arguments_schema(schemas[name])
            texts = choice in ("none", "auto")
            in_calls = {id(x) for t in tags for x in _nodes(t)}  # (Mistral's id is a regex inside a call)
            assert any(n["type"] in ("any_text", "regex") and id(n) not in in_calls for n in nodes) == texts
            assert accepts(grammar, encode("Hello there.")) == texts
            several = [n["stop_after_first"] for n in nodes if n["type"] == "tags_with_separator"]
            assert several == ([] if isinstance(fmt, LlamaJsonFormat) or choice == "none" else [not parallel])
            if family == "mistral-token" and choice != "none":
                assert {"type": "token", "token": "[TOOL_CALLS]"} in nodes


@pytest.mark.parametrize("name", [LLAMA32, NEMO])
def test_greedy_calls_under_speculation_equal_target_only(engine, fronts, monkeypatch, name):
    """ngram with grammar-forced drafts on and off, required and auto."""
    monkeypatch.setattr(engine, "tokenizer", fronts[name].tokenizer)  # the front renders with its template
    for text, choice in (("Go to the hall.", "required"), ("Pick up the ball and say done.", "auto")):
        request = GenerateRequest(messages=(("user", text),), tools=robot_tools(), tool_choice=choice,
                                  max_new_tokens=32)
        plain = run_one(engine, GenerateRequest(**{**request.__dict__, "speculate": False}))
        assert plain.stats.verify_calls == 0
        for forced in (False, True):
            got = run_one(engine, GenerateRequest(**{**request.__dict__, "drafter": "ngram", "k": 4,
                                                     "forced_drafts": forced}))
            assert got.token_ids == plain.token_ids
            assert [(c.name, c.arguments) for c in got.tool_calls] == [(c.name, c.arguments) for c in plain.tool_calls]
            # auto: the random model answers in free text (no call, nothing forced) where lookup finds nothing it
            # accepts; the verify windows (rejections, corrections) under the tool grammar are what that case proves
            assert_speculated(got.stats, accepted=choice == "required",
                              what=f"ngram on {name}, {choice}, forced={forced}")


def test_the_http_door_serves_a_llama_template(engine, fronts, monkeypatch):
    """The door needs nothing of its own per format: the openai client's parsed call, and the call and its result
    going back in (Llama's one call, tool_choice none after it)."""
    import logging

    import openai

    from spec_edge.http.door import Door
    from spec_edge.runtime.scheduler import Scheduler

    monkeypatch.setattr(engine, "tokenizer", fronts[LLAMA32].tokenizer)  # the front renders with its template
    cfg = cfgmod.from_params({"runtime.engine_dir": str(REPO / "engines"), "graphs.weights": "fp32",
                              "graphs.batch_slots": 1, "speculative.k": 4, "http.port": 0, "http.api_key": "k"})
    logger = logging.getLogger("test_tool_formats")
    door = Door(cfg, logger).start()
    scheduler = Scheduler(engine, cfg, logger)
    door.serve(scheduler)
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{door.port}/v1", api_key="k", max_retries=0)
        tools = json.loads((REPO / "bench" / "robot_tools.json").read_text())
        ask = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Go to the kitchen."}], tools=tools,
                   tool_choice="required", max_tokens=60, temperature=0)
        choice = c.chat.completions.create(**ask).choices[0]
        (call,) = choice.message.tool_calls  # parallel_tool_calls defaults to true: Llama's format has one call
        assert choice.finish_reason == "tool_calls" and choice.message.content is None and call.id.startswith("call_")
        assert valid(engine, ToolCall(call.id, call.function.name, call.function.arguments))
        back = ask["messages"] + [choice.message.model_dump(exclude_none=True),
                                  {"role": "tool", "tool_call_id": call.id, "content": "done"}]
        final = c.chat.completions.create(**{**ask, "tool_choice": "none", "max_tokens": 20, "messages": back})
        assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    finally:
        scheduler.stop(1.0)
        door.stop()


MARKUP = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tool_call_body>", "<tools>",
          "</tools>"]


@pytest.mark.parametrize("family", ["generic", "mistral"])
def test_text_never_holds_the_formats_markup(engine, family):
    """Under tool_choice none and auto the text may not contain any of the format's tags (the embedded model echoed
    <tool_response> ... </tool_response> and made up <tool_call_body> after a tool result): a robot may speak the
    text as it is. Plain text, and (auto) the calls, still pass; the structural tag excludes the same markup."""
    fmt = HermesFormat(native=False) if family == "generic" else MistralFormat(spaced=True, token=None)
    markup = MARKUP if family == "generic" else ["[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[AVAILABLE_TOOLS]"]
    schemas = {t.name: json.loads(t.parameters) for t in robot_tools()}
    encode = engine.tokenizer.encode
    for choice in ("none", "auto"):
        grammar = fmt.grammar(schemas, choice, parallel=True)
        for tag in markup:
            text = encode(f"Sure. {tag}\narrived\n")
            assert engine.grammars.constraint("grammar", grammar).admitted(text) < len(text), (choice, tag)
        plain = encode("Sure, I am in the kitchen <3 and a < b.")
        assert engine.grammars.constraint("grammar", grammar).admitted(plain) == len(plain), choice
        excludes = [n["excludes"] for n in _nodes(fmt.structural_tag(schemas, choice, True)["format"])
                    if n["type"] == "any_text"]
        assert excludes and all(set(fmt.markup) <= set(e) for e in excludes), excludes
    call = encode('Going.<tool_call>\n{"name": "say", "arguments": {"text": "hi"}}\n</tool_call>')
    if family == "generic":  # a call after text is still one (the opener ends the text)
        constraint = engine.grammars.constraint("grammar", fmt.grammar(schemas, "auto", parallel=True))
        assert constraint.admitted(call) == len(call)


def test_after_a_tool_result_the_answer_is_plain_text(engine):
    """The embedded model after a tool result (its generic format: the result as a <tool_response> block), under
    none and auto: the answer's text has no markup (greedy, so the same answer each run)."""
    tools = robot_tools()
    call = ToolCall("call_1", "move_to", '{"place": "kitchen"}')
    turns = (("user", "Go to the kitchen and tell me what you see."), ChatMessage("assistant", "", (call,)),
             ChatMessage("tool", '{"arrived": true, "sees": ["a red cup", "a table"]}', tool_call_id="call_1"))
    for choice in ("none", "auto"):
        result = run_one(engine, GenerateRequest(messages=turns, tools=tools, tool_choice=choice, max_new_tokens=80))
        assert "<tool" not in result.text and "</tool" not in result.text, (choice, result.text)


def test_a_tool_schema_that_cannot_be_enforced_names_the_tool_and_keyword(engine):
    """Refused with the tool (index and name) and the compiler's reason naming the keyword, never the calls'
    internal Lark grammar (which also showed the schema as rewritten, additionalProperties added)."""
    from spec_edge.runtime.requests import Tool

    ok = Tool("ok", "", json.dumps({"type": "object"}))
    for schema, keyword in (({"type": "object", "if": {"properties": {"a": {}}}, "then": {}}, '"if"'),
                            ({"type": "object", "properties": {"x": {"type": "string", "format": "hostnamez"}}},
                             "format"),
                            ({"type": "object", "properties": {"x": {"$ref": "#/nope"}}}, "/nope"),
                            ({"type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}},
                             "at properties.x.pattern:")):
        with pytest.raises(RequestError) as err:
            front_of(engine).prepare(GenerateRequest(prompt="Go.", tools=(ok, Tool("go", "", json.dumps(schema)))))
        message = str(err.value)
        assert message.startswith("tools[1] (go) parameters: this JSON Schema cannot be enforced"), message
        assert keyword in message, message
        assert not any(piece in message for piece in ("%json", "args_", "body_", "x-guidance", "additionalProperties"))
