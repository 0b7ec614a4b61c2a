"""The one front every request goes through, from any door (the ROS node, the HTTP door, the CLI, the tools):
Front.prepare turns a GenerateRequest into a Prepared request, once: every check, the chat template, the
tokenization, the grammar compile, the sampling values with the config's defaults, max_new_tokens, the drafter
and k. A refusal is a RequestError whose message says what to change. What a decoder cannot do is data it
declares (Capabilities), checked here; a decoder starts from the Prepared request and checks nothing again.
"""
from __future__ import annotations

import json
import math
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spec_edge.config import AUTO_K, BACKEND_DRAFTERS, DRAFTERS, Config, sampling_problem, speculative_k
from spec_edge.runtime.grammar import GrammarError, grammar_spec, read_text
from spec_edge.runtime.images import count_markers, decode
from spec_edge.runtime.requests import IMAGE_MARKER, ChatMessage, GenerateRequest, RequestError
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.tokenizer import Tokenizer
from spec_edge.runtime.tool_format import arguments_schema, check_tools, for_template

MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask per token
CHAT_ROLES = ("system", "user", "assistant", "tool")
GUIDED = ("json_schema", "regex", "gbnf", "lark")  # guided decoding kinds (a grammar is GBNF when it has `::=` rules)
OPTIONAL_SAMPLING = ("min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos", "logprobs")


@dataclass(frozen=True)
class ImagePrompt:
    """How a decoder that runs images in its own prompt takes them: each IMAGE_MARKER becomes `text` before the
    prompt is tokenized, which holds `per_image` tokens `token_id` (the rows an image's encoder output fills)."""
    text: str
    token_id: int
    per_image: int


@dataclass(frozen=True)
class Capabilities:
    """What a decoder serves; the front refuses the rest. name: how refusals call it."""
    name: str
    drafters: tuple[str, ...]       # the drafters it runs now ("none" included)
    k_values: tuple[int, ...]       # the k a speculating request may ask for
    k_remedy: str                   # what to do about another k ({k}: the k asked; {k_values}: those and it)
    max_context: int                # prompt + answer tokens one request holds
    max_input: int                  # the longest prompt in tokens
    vocab_size: int                 # the ids logit_bias may name
    eos_ids: tuple[int, ...]        # what ignore_eos suppresses
    guided: tuple[str, ...] = GUIDED
    sampling: tuple[str, ...] = OPTIONAL_SAMPLING  # the optional sampling features it honours
    forced_drafts: bool = True      # a grammar's forced tokens can be the draft
    tools: bool = True              # tool calls (runtime/tool_format.py)
    drafter_needs: tuple[tuple[str, str], ...] = ()  # (drafter, what it lacks to run here) of those it does not
    renders: bool = False           # it renders and counts a chat itself (a remote server): no prompt text or ids here
    images: int = 0                 # the most images one request may carry (0: a text-only model)
    image_prompt: ImagePrompt | None = None  # the prompt's image tokens (None: the marker stays text, e.g. Edge-LLM's)
    drafter_k: tuple[tuple[str, tuple[int, ...], str], ...] = ()  # (drafter, the k it proposes, the refusal of
    # another k: {k}) for the drafters built for some k only (Medusa: its head count, P-EAGLE: its draft graphs)

    def ks(self, drafter: str, up_to: int) -> list[int]:
        """The exported k <= up_to that drafter can propose (speculative.k auto chooses among them)."""
        limit = next((ks for name, ks, _ in self.drafter_k if name == drafter), None)
        return [k for k in sorted(self.k_values) if k <= up_to and (limit is None or k in limit)]


@dataclass(frozen=True)
class Prepared:
    """A request every check passed, in the values a decoder runs it with."""
    request: GenerateRequest        # as sent (its stop strings)
    text: str                       # the prompt text (chat template applied)
    prompt_ids: list[int]
    sampling: SamplingParams
    max_new_tokens: int
    seed: int | None
    drafter: str                    # "none": it does not draft (speculate false, or none asked)
    k: int                          # drafts per verify call asked (speculative_k of the config when unset)
    guide: Any = None               # the decoder's compiled grammar for this request (None: unguided)
    forced_drafts: bool = False     # the grammar's forced tokens are drafts (only with a guide, k and speculate)
    tool_format: Any = None         # the tool_format.ToolFormat that parses the output's calls (tools, choice not none)
    messages: tuple[ChatMessage, ...] = ()  # the checked messages, system prompt first (what a remote server renders)
    images: tuple[np.ndarray, ...] = ()  # each (H, W, 3) uint8 RGB, in the order of the IMAGE_MARKERs in the messages


def check_text(name: str, text: str) -> None:
    """Refuse text that is not UTF-8 (a lone surrogate: how Python holds undecodable bytes, e.g. of argv) or holds
    a control character other than newline, tab and carriage return (NUL among them: a ROS string ends at it, so
    through the node it cuts the text before the node sees it). U+FFFD is a character like any other."""
    for i, char in enumerate(text):
        if char in "\n\t\r":
            continue
        category = unicodedata.category(char)
        if category == "Cs":
            raise RequestError(f"{name} is not valid UTF-8 (an undecodable byte at character {i}): send UTF-8 text")
        if category == "Cc":
            raise RequestError(f"{name} contains control character U+{ord(char):04X} at character {i}: "
                               f"remove it (only newline, tab and carriage return are accepted)")


class Front:
    """prepare(request) for one decoder: its config, tokenizer, Capabilities and grammar compiler (compile(kind,
    text) -> the per-request grammar state it runs with; GrammarError or RequestError for one it cannot use).
    compile_tools(format, {name: schema}, tool_choice, parallel) -> the grammar state of a request's tool calls, for
    a decoder whose grammar engine does not take the format's Lark grammar (None: compile("grammar", that grammar))."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer | None, caps: Capabilities, compile: Callable[[str, str], Any],
                 compile_tools: Callable[[Any, dict[str, dict], str, bool], Any] | None = None):
        self.cfg, self.tokenizer, self.caps, self.compile = cfg, tokenizer, caps, compile
        self.compile_tools = compile_tools
        self.tool_format = for_template(tokenizer.chat_template, tokenizer.token_id) if tokenizer else None

    def messages(self, request: GenerateRequest) -> list[ChatMessage]:
        """A request's checked messages (or its prompt as the user's message), the system prompt (the request's,
        else serve.system_prompt, else none: the template's default) first."""
        if request.messages:
            messages = [ChatMessage(*m) for m in request.messages]
            for i, m in enumerate(messages):
                if m.role not in CHAT_ROLES:
                    raise RequestError(f"messages[{i}] has role '{m.role}': use one of {', '.join(CHAT_ROLES)}")
                if m.tool_calls and m.role != "assistant" or m.tool_call_id and m.role != "tool":
                    raise RequestError(f"messages[{i}] ({m.role}): tool_calls go on assistant turns, tool_call_id "
                                       "on tool turns")
                check_text(f"messages[{i}] ({m.role})", m.content)
        else:
            if not request.prompt.strip():
                raise RequestError("prompt is empty: send the text to answer")
            check_text("prompt", request.prompt)
            messages = [ChatMessage("user", request.prompt)]
        system = request.system_prompt or self.cfg.serve.system_prompt
        check_text("system prompt", system)
        if system and not any(m.role == "system" for m in messages):
            messages.insert(0, ChatMessage("system", system))
        if not any(m.content.strip() or m.tool_calls for m in messages):
            raise RequestError("all messages are empty: send the text to answer")
        return messages

    def chat_text(self, request: GenerateRequest) -> str:
        """The prompt text of a request: its messages (messages()) rendered through the chat template (request.chat)
        or joined by newlines; tools, tool calls and tool turns through the model's tool format
        (runtime/tool_format.py). A decoder that renders (Capabilities.renders): "" for a chat, once checked."""
        return self._render(request, self.messages(request))

    def _render(self, request: GenerateRequest, messages: list[ChatMessage]) -> str:
        if not request.chat:
            if request.tools or any(m.role == "tool" or m.tool_calls for m in messages):
                raise RequestError("tools and tool turns need the chat template: send chat true")
            return "\n".join(m.content for m in messages)
        if request.tools or any(m.role == "tool" or m.tool_calls for m in messages):
            check_tools(request.tools, request.tool_choice or "auto")
            return "" if self.caps.renders else self.tool_format.render(self.tokenizer, messages, request.tools)
        return "" if self.caps.renders else self.tokenizer.render_chat([(m.role, m.content) for m in messages])

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The token ids of the request's prompt text (chat_text), refused when the prompt does not fit."""
        self._tokenizes()
        return self._encode(self.chat_text(request))

    def shared_prefix(self, system_prompt: str = "") -> list[int]:
        """The token ids of the chat prefix every request with this system prompt ("" = serve.system_prompt, then
        the template's default) shares: what a decoder's warm() puts into its cache (none for one that renders)."""
        if self.caps.renders:
            return []
        one, two = (self.prompt_ids(GenerateRequest(prompt=p, system_prompt=system_prompt)) for p in "ab")
        n = 0
        while n < min(len(one), len(two)) and one[n] == two[n]:
            n += 1
        return one[:n]

    def tokenize(self, text: str, chat: bool) -> list[int]:
        """The ids of text: through the chat template as a Generate prompt is (chat), or as it is."""
        self._tokenizes()
        return self.prompt_ids(GenerateRequest(prompt=text)) if chat else self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        """The text of ids (RequestError for an id outside the vocabulary)."""
        self._tokenizes()
        vocab = self.caps.vocab_size
        if bad := [int(t) for t in ids if not 0 <= int(t) < vocab]:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab}): send ids of this model")
        return self.tokenizer.decode([int(t) for t in ids])

    def _tokenizes(self) -> None:
        if self.tokenizer is None:
            raise RequestError(f"this {self.caps.name} engine has no tokenizer here (the server renders and counts): "
                               "tokenize on the server, or restart with remote.fallback local (its model's tokenizer)")

    def _encode(self, text: str) -> list[int]:
        caps, ids = self.caps, self.tokenizer.encode(text)
        if len(ids) > caps.max_input:
            raise RequestError(f"prompt is {len(ids)} tokens but the context holds {caps.max_context} (prompt + "
                               f"answer) and a prompt at most {caps.max_input}: shorten the prompt or export with a "
                               f"larger graphs.max_context")
        return ids

    def prepare(self, request: GenerateRequest) -> Prepared:
        """The Prepared request (RequestError for one that cannot be served as asked)."""
        caps, defaults = self.caps, self.cfg.sampling
        params = self._sampling(request)
        limit = caps.max_context - 1
        # the configured default adapts to a smaller context; an explicit request value must fit
        max_new = min(defaults.max_new_tokens, limit) if request.max_new_tokens is None else int(request.max_new_tokens)
        if not 1 <= max_new <= limit:
            raise RequestError(f"max_new_tokens must be in [1, {limit}] (the context holds {caps.max_context} "
                               f"tokens), got {max_new}")
        seed = defaults.seed if request.seed is None else int(request.seed)
        if seed < -1:
            raise RequestError(f"seed must be >= 0 (reproducible sampling) or -1 (nondeterministic), got {seed}")
        drafter = request.drafter or self.cfg.speculative.drafter
        if drafter not in DRAFTERS:
            raise RequestError(f"unknown drafter '{drafter}': use one of {', '.join(DRAFTERS)}")
        drafter = drafter if request.speculate else "none"
        k = speculative_k(self.cfg) if not request.k else int(request.k)  # auto: the largest exported k
        self._check_drafter(drafter, k, auto=not request.k and self.cfg.speculative.k == AUTO_K)
        if request.forced_drafts and not caps.forced_drafts:
            raise RequestError("forced drafts (a grammar's forced tokens as the draft) run on runtime.backend: "
                               "onnxruntime only: send forced_drafts unset or false")
        for item in request.stop:
            check_text("stop string", item)
        tools = self._tools(request) if request.tools else None  # (before the prompt: what this engine cannot do)
        messages, images = self._images(request, self.messages(request))
        text = self._render(request, messages)
        ids = [] if caps.renders else self._encode_images(text, len(images))  # (renders: the server refuses a
        # prompt too long, its 400)
        if request.max_new_tokens is not None and len(ids) + max_new > caps.max_context:  # as asked must fit
            raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) = {len(ids) + max_new} "
                               f"exceed the context of {caps.max_context} tokens: ask for at most "
                               f"{caps.max_context - len(ids)} new tokens, shorten the prompt, or export with a "
                               "larger graphs.max_context")
        guide, tool_format = tools or (self._guide(request), None)
        forced = self.cfg.speculative.forced_drafts if request.forced_drafts is None else request.forced_drafts
        # forced drafts are speculation too: off with speculate=false
        forced = (guide is not None and forced and request.speculate and caps.forced_drafts and k in caps.k_values)
        return Prepared(request=request, text=text, prompt_ids=ids, sampling=params, max_new_tokens=max_new,
                        seed=seed if seed >= 0 else None, drafter=drafter, k=k, guide=guide, forced_drafts=forced,
                        tool_format=tool_format, messages=tuple(messages), images=images)

    def _encode_images(self, text: str, n_images: int) -> list[int]:
        """The prompt's ids with each marker as the decoder's image tokens (Capabilities.image_prompt), refused when
        they do not fit or do not pair with the n_images images (the model's own image token typed into the text)."""
        image = self.caps.image_prompt
        if image is None:
            return self._encode(text)
        ids = self._encode(text.replace(IMAGE_MARKER, image.text))
        if (found := ids.count(image.token_id)) != n_images * image.per_image:
            raise RequestError(f"the prompt holds {found} image tokens where its {n_images} images take "
                               f"{n_images * image.per_image}: remove the model's own image tokens from the text and "
                               f"put an {IMAGE_MARKER} marker where each image goes")
        return ids

    def _images(self, request: GenerateRequest,
                messages: list[ChatMessage]) -> tuple[list[ChatMessage], tuple[np.ndarray, ...]]:
        """The messages with a marker per image (none in the text: all of them first in the last user turn) and the
        images decoded (runtime/images.py), refused unless this model takes that many and markers and images pair."""
        caps, n = self.caps, len(request.images)
        if n and not caps.images:
            raise RequestError(f"this {caps.name} engine's model takes no images (a text-only model): send the "
                               "request without images, or serve a profile with a vision model (docs/images.md)")
        if n > caps.images:
            raise RequestError(f"{n} images in one request; this model takes at most {caps.images}: send fewer")
        markers = count_markers([m.content for m in messages])
        if not caps.images or not n and not markers:
            return messages, ()
        if markers == 0:
            last = max(i for i, m in enumerate(messages) if m.role == "user" or i == 0)
            messages = list(messages)
            messages[last] = messages[last]._replace(content=IMAGE_MARKER * n + messages[last].content)
        elif markers != n:
            raise RequestError(f"{n} images but {markers} image markers ({IMAGE_MARKER}) in the text: put one "
                               "marker where each image goes, or none (the images then go first in the last "
                               "user turn)")
        return messages, tuple(decode(image, f"images[{i}]") for i, image in enumerate(request.images))

    def _tools(self, request: GenerateRequest) -> tuple[Any, Any]:
        """(the grammar state of the request's tool_choice, the format that parses its calls; None for none)."""
        if not self.caps.tools:
            raise RequestError(f"tools run on runtime.backend: onnxruntime only (this {self.caps.name} engine has no "
                               "tool calls): send the request without tools, or to a node with runtime.backend: "
                               "onnxruntime")
        if request.json_schema or request.grammar or request.regex or request.ignore_eos:
            raise RequestError("tools cannot be combined with json_schema / grammar / regex or ignore_eos (tool "
                               "calls are their own grammar): drop one of them")
        choice = request.tool_choice or "auto"
        schemas, parallel = check_tools(request.tools, choice), request.parallel_tool_calls
        try:
            guide = (self.compile_tools(self.tool_format, schemas, choice, parallel) if self.compile_tools else
                     self.compile("grammar", self.tool_format.grammar(schemas, choice, parallel)))
            return guide, self.tool_format if choice != "none" else None
        except GrammarError as err:
            raise RequestError(self._tool_schema_problem(request.tools, schemas, choice) or
                               f"tools: the calls' grammar cannot be built: {str(err).splitlines()[0][:200]}") from None

    def _tool_schema_problem(self, tools, schemas: dict[str, dict], choice: str) -> str | None:
        """The first tool whose arguments' schema (as enforced: tool_format.arguments_schema) does not compile alone,
        with the compiler's reason (its keyword), never the calls' internal grammar (None: each compiles alone)."""
        for i, tool in enumerate(tools):
            if choice in schemas and tool.name != choice:
                continue
            schema = arguments_schema(schemas[tool.name])
            try:
                self.compile("json_schema", json.dumps(schema))
            except (GrammarError, RequestError) as err:
                reason = str(err).removeprefix("json_schema is invalid: ").removeprefix("failed to compile JSON schema: ")
                where = self._schema_keyword(schema)
                at = f" at {where}" if where else ""
                return (f"tools[{i}] ({tool.name}) parameters: this JSON Schema cannot be enforced{at}: {reason} "
                        "(docs/tools.md, \"What is enforced\"): rewrite or drop that keyword")
        return None

    def _schema_keyword(self, schema: dict, limit: int = 64) -> str | None:
        """The path of the first keyword (depth first, at most `limit` tried) whose removal lets `schema` compile,
        e.g. `properties.x.pattern` (None: no single keyword is to blame)."""
        paths: list[tuple[str, ...]] = []

        def walk(node: Any, path: tuple[str, ...]) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    walk(value, path + (str(key),))
                    paths.append(path + (str(key),))
            elif isinstance(node, list):
                for j, value in enumerate(node):
                    walk(value, path + (str(j),))

        walk(schema, ())
        for path in paths[:limit]:
            trial = json.loads(json.dumps(schema))
            parent = trial
            for part in path[:-1]:
                parent = parent[int(part)] if isinstance(parent, list) else parent[part]
            del parent[path[-1]]
            try:
                self.compile("json_schema", json.dumps(trial))
            except (GrammarError, RequestError):
                continue
            return ".".join(path)
        return None

    def _sampling(self, request: GenerateRequest) -> SamplingParams:
        caps, defaults = self.caps, self.cfg.sampling
        bias: dict[int, float] = {}
        for token, value in request.logit_bias:
            if not 0 <= int(token) < caps.vocab_size:
                raise RequestError(f"logit_bias names token id {token}, outside the vocabulary [0, "
                                   f"{caps.vocab_size}): use ids from the tokenize service")
            if not math.isfinite(float(value)):
                raise RequestError(f"logit_bias for token {token} must be a finite number, got {value} (to forbid "
                                   "a token send a large negative bias such as -100)")
            bias[int(token)] = bias.get(int(token), 0.0) + float(value)
        if request.ignore_eos and (request.json_schema or request.grammar or request.regex):
            raise RequestError("ignore_eos cannot be combined with json_schema / grammar / regex (a guided output "
                               "ends with EOS once it parses): drop one of them")
        logprobs = int(request.logprobs)
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}] (0 = none), got {logprobs}")

        def pick(value, default):
            return default if value is None else float(value)

        params = SamplingParams(
            temperature=pick(request.temperature, defaults.temperature),
            top_k=defaults.top_k if request.top_k is None else int(request.top_k),
            top_p=pick(request.top_p, defaults.top_p), min_p=pick(request.min_p, defaults.min_p),
            repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=pick(request.presence_penalty, defaults.presence_penalty),
            frequency_penalty=pick(request.frequency_penalty, defaults.frequency_penalty),
            logit_bias=tuple(sorted(bias.items())), suppressed=caps.eos_ids if request.ignore_eos else (),
            logprobs=logprobs)
        if problem := sampling_problem(params):
            raise RequestError(problem)
        asked = (("min_p", params.min_p != 0.0), ("repetition_penalty", params.repetition_penalty != 1.0),
                 ("presence_penalty", params.presence_penalty != 0.0),
                 ("frequency_penalty", params.frequency_penalty != 0.0), ("ignore_eos", request.ignore_eos),
                 ("logprobs", logprobs > 0))
        if unsupported := [name for name, on in asked if on and name not in caps.sampling]:
            raise RequestError(f"{', '.join(unsupported)}: {caps.name}'s runtime has no such option; they run on "
                               "runtime.backend: onnxruntime (leave them unset here: sampling.* at their defaults)")
        return params

    def _check_drafter(self, drafter: str, k: int, auto: bool) -> None:
        """Refuse a drafter this decoder does not run, or a k it cannot verify or the drafter cannot propose
        (auto: speculative.k auto with no k asked, which chooses among caps.ks(drafter, k))."""
        caps = self.caps
        if drafter not in caps.drafters:
            if lacks := dict(caps.drafter_needs).get(drafter):
                raise RequestError(lacks)
            runs = BACKEND_DRAFTERS[self.cfg.runtime.backend]
            if drafter not in runs:
                raise RequestError(f"drafter {drafter} runs on runtime.backend: onnxruntime only; this {caps.name} "
                                   f"engine runs {' or '.join(runs)}")
            raise RequestError(f"this {caps.name} engine was started without drafter {drafter} (speculative.drafter "
                               f"{self.cfg.speculative.drafter}): send drafter none, or restart with drafter {drafter}")
        if drafter == "none":
            return
        if k not in caps.k_values:
            raise RequestError(f"k={k} has no verify graph in this engine (built for k in {list(caps.k_values)}): "
                               + caps.k_remedy.format(k=k, k_values=" ".join(map(str, sorted({*caps.k_values, k})))))
        if auto and not caps.ks(drafter, k):
            raise RequestError(f"speculative.k auto: drafter {drafter} can propose none of the exported k "
                               f"{list(caps.k_values)}: send a k it can, or drafter none")
        refusal = next((text for name, ks, text in caps.drafter_k if name == drafter and k not in ks), None)
        if refusal and not auto:
            raise RequestError(refusal.format(k=k))

    def _guide(self, request: GenerateRequest) -> Any:
        """The decoder's grammar state for the request's json_schema / grammar / regex (None without)."""
        if request.tool_choice not in ("auto", ""):
            check_tools((), request.tool_choice)  # refused: a tool_choice without tools
        try:
            spec = grammar_spec(request.json_schema, request.grammar, request.regex)
            if spec is None:
                return None
            kind, text = spec
            read_text(kind, text)
            if (which := kind if kind != "grammar" else "gbnf" if "::=" in text else "lark") not in self.caps.guided:
                what = which if which == kind else f"{which} {kind}"  # a regex, a json_schema, a gbnf grammar
                raise RequestError(f"a {what} runs on runtime.backend: onnxruntime only (this {self.caps.name} "
                                   f"engine takes {', '.join(self.caps.guided)}): rewrite it, or send it to a node "
                                   "with runtime.backend: onnxruntime")
            return self.compile(kind, text)
        except GrammarError as err:
            raise RequestError(str(err)) from None
