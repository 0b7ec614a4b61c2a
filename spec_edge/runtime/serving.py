"""What every request backend shares: the RequestBackend protocol the CLI, the ROS node and the tools call,
and the request fields every backend reads the same way (the chat text of a request, its sampling / length /
drafter fields with the config's defaults filled in)."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from spec_edge.config import DRAFTERS, Config, sampling_problem, speculative_k
from spec_edge.runtime.requests import GenerateRequest, GenerateResult, RequestError, chat_roles, check_roles, check_text
from spec_edge.runtime.sampling import SamplingParams
from spec_edge.runtime.speculative import BatchLoop
from spec_edge.runtime.tokenizer import Tokenizer


class RequestBackend(Protocol):
    """What the CLI, the ROS node and the tools call: a whole request in, its result out. Two kinds
    satisfy it: engine.Engine (ONNX Runtime: the speculative loop here, over step-level Runners) and
    edgellm.EdgeLLMEngine (runtime.backend tensorrt: NVIDIA's Edge-LLM runtime serves the request end to
    end). generate raises requests.RequestError for a request it refuses (nothing run); on_text(delta,
    n_tokens) gets each piece of safe-to-show text; cancel() is polled and its non-empty answer becomes the
    finish reason; queued: requests in the caller's queue as it starts, itself included (the load policy).
    concurrent: generate may be called from several threads at once (else the caller serialises).
    loop: the Engine's speculative loop (runtime/speculative.BatchLoop), which a caller serving many requests
    drives itself (Engine.start, loop.add, loop.iterate: runtime/scheduler.py); None for a backend that serves
    whole requests only (Edge-LLM)."""

    cfg: Config
    concurrent: bool
    loop: BatchLoop | None

    def validate(self, request: GenerateRequest) -> None: ...

    def generate(self, request: GenerateRequest, on_text: Callable[[str, int], None] | None = None,
                 cancel: Callable[[], str | None] | None = None, queued: int = 1) -> GenerateResult: ...

    def warm(self, system_prompt: str = "") -> int: ...

    def info(self) -> dict: ...

    def close(self) -> None: ...


def chat_text(tokenizer: Tokenizer, request: GenerateRequest, default_system: str) -> str:
    """The prompt text of a request: its messages (or prompt as the user's message), the system prompt
    (the request's, else default_system, else the template's default) first, rendered through the chat
    template (request.chat) or joined by newlines. RequestError for empty or non-text fields and for roles the
    template does not know."""
    if request.messages:
        check_roles(request.messages, chat_roles(tokenizer.chat_template))
        messages = list(request.messages)
        for i, (role, content) in enumerate(messages):
            check_text(f"messages[{i}] ({role})", content)
    else:
        if not request.prompt.strip():
            raise RequestError("prompt is empty: send the text to answer")
        check_text("prompt", request.prompt)
        messages = [("user", request.prompt)]
    system = request.system_prompt or default_system
    check_text("system prompt", system)
    if system and not any(role == "system" for role, _ in messages):
        messages.insert(0, ("system", system))
    if not any(content.strip() for _, content in messages):
        raise RequestError("all messages are empty: send the text to answer")
    return tokenizer.render_chat(messages) if request.chat else "\n".join(c for _, c in messages)


MAX_LOGPROBS = 20  # the most top log-probabilities a request may ask per token


def resolve_fields(cfg: Config, request: GenerateRequest, max_context: int, vocab_size: int,
                   eos_ids: tuple[int, ...]) -> tuple[SamplingParams, int, int | None, str, int]:
    """(sampling, max_new_tokens, seed or None, drafter name, k) of a request with cfg's defaults filled in,
    for a context of max_context tokens (prompt + answer) and a vocabulary of vocab_size ids (ignore_eos
    suppresses eos_ids); RequestError for a value out of range."""
    defaults = cfg.sampling

    def pick(value, default):
        return default if value is None else float(value)

    bias: dict[int, float] = {}
    for token, value in request.logit_bias:
        if not 0 <= int(token) < vocab_size:
            raise RequestError(f"logit_bias names token id {token}, outside the vocabulary [0, {vocab_size}): "
                               "use ids from the tokenize service")
        if not math.isfinite(float(value)):
            raise RequestError(f"logit_bias for token {token} must be a finite number, got {value} (to forbid a "
                               "token send a large negative bias such as -100)")
        bias[int(token)] = bias.get(int(token), 0.0) + float(value)
    if request.ignore_eos and (request.json_schema or request.grammar or request.regex):
        raise RequestError("ignore_eos cannot be combined with json_schema / grammar / regex (a guided output ends "
                           "with EOS once it parses): drop one of them")
    logprobs = int(request.logprobs)
    if not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}] (0 = none), got {logprobs}")
    params = SamplingParams(
        temperature=defaults.temperature if request.temperature is None else float(request.temperature),
        top_k=defaults.top_k if request.top_k is None else int(request.top_k),
        top_p=defaults.top_p if request.top_p is None else float(request.top_p),
        min_p=pick(request.min_p, defaults.min_p),
        repetition_penalty=pick(request.repetition_penalty, defaults.repetition_penalty),
        presence_penalty=pick(request.presence_penalty, defaults.presence_penalty),
        frequency_penalty=pick(request.frequency_penalty, defaults.frequency_penalty),
        logit_bias=tuple(sorted(bias.items())), suppressed=tuple(eos_ids) if request.ignore_eos else (),
        logprobs=logprobs)
    if problem := sampling_problem(params):
        raise RequestError(problem)
    limit = max_context - 1
    # the configured default adapts to a smaller context; an explicit request value must fit
    max_new = min(defaults.max_new_tokens, limit) if request.max_new_tokens is None else int(request.max_new_tokens)
    if not 1 <= max_new <= limit:
        raise RequestError(f"max_new_tokens must be in [1, {limit}] (the context holds {max_context} tokens), "
                           f"got {max_new}")
    seed = defaults.seed if request.seed is None else int(request.seed)
    if seed < -1:
        raise RequestError(f"seed must be >= 0 (reproducible sampling) or -1 (nondeterministic), got {seed}")
    drafter = cfg.speculative.drafter if not request.drafter else request.drafter
    if drafter not in DRAFTERS:
        raise RequestError(f"unknown drafter '{drafter}': use one of {', '.join(DRAFTERS)}")
    if not request.speculate:
        drafter = "none"
    k = speculative_k(cfg) if not request.k else int(request.k)  # auto: the largest exported k
    return params, max_new, (seed if seed >= 0 else None), drafter, k
