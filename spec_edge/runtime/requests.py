"""A request and its result, as the doors (the CLI, the ROS node, the tools) hand them to the engine; its checks
are runtime/front.py's. (The load policy that speculates less under a queue: spec_edge/speculation_policy.py.)"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

from spec_edge.runtime.sampling import TokenLogprobs
from spec_edge.runtime.stats import Stats

FINISH_REASONS = ("eos", "stop", "length", "context_full", "cancelled", "error")


class RequestError(ValueError):
    """A request that cannot be served as asked; the message says what to change."""


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str = ""
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); used instead of prompt when given
    system_prompt: str = ""                     # "" = config default, then the template's default
    max_new_tokens: int | None = None           # None = config default
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # the target's distribution (runtime/sampling.py): None = the config's sampling section
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    ignore_eos: bool = False                    # EOS is never chosen (its logits -inf): runs to max_new_tokens
    logprobs: int = 0                           # each token's log-probability and its top N (0 = none, <= 20)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    speculate: bool = True
    drafter: str | None = None
    k: int | None = None
    chat: bool = True                           # False: the prompt is fed as raw text
    # guided decoding (runtime/grammar.py): at most one of a JSON Schema, a grammar (Lark or GBNF), a regex
    json_schema: str = ""
    grammar: str = ""
    regex: str = ""
    forced_drafts: bool | None = None           # None = speculative.forced_drafts


@dataclass
class GenerateResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: Stats
    prompt_tokens: int = 0
    message: str = ""
    queued_at_start: int = 1         # requests in the caller's queue as it started, itself included
    speculation_off_reason: str = ""  # why the load policy gave it less than its k (none or smaller; "" = not)

    @property
    def logprobs(self) -> list[TokenLogprobs]:
        """One per token of token_ids when the request asked for logprobs (else empty)."""
        return self.stats.logprobs[:len(self.token_ids)]

    def as_dict(self) -> dict:
        out = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
               "prompt_tokens": self.prompt_tokens, "message": self.message,
               "queued_at_start": self.queued_at_start, "speculation_off_reason": self.speculation_off_reason,
               "stats": self.stats.as_dict()}
        if self.stats.logprobs:
            out["logprobs"] = [entry.as_dict() for entry in self.logprobs]
        return out


def logit_bias_arg(text: str) -> tuple[int, float]:
    """One `--logit-bias ID:BIAS` value -> (token id, bias)."""
    token, sep, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes TOKEN_ID:BIAS (e.g. 42:-100), got {text!r}") from None


def add_distribution_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the request fields that change the target's distribution or report it (`spec-edge
    generate` and `spec-edge ask`); request_fields(args) reads them."""
    group = parser.add_argument_group("the target's distribution (runtime/sampling.py; exact under speculation)")
    group.add_argument("--min-p", type=float, help="drop ids below MIN_P x the top probability (after temperature)")
    group.add_argument("--repetition-penalty", type=float, help="> 0, 1 = off: ids in the prompt or the output")
    group.add_argument("--presence-penalty", type=float, help="subtracted from the logit of every id the output holds")
    group.add_argument("--frequency-penalty", type=float, help="subtracted once per occurrence in the output")
    group.add_argument("--logit-bias", type=logit_bias_arg, action="append", default=[], metavar="ID:BIAS",
                       help="add BIAS to token ID's logit (repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="never choose EOS: run to --max-new-tokens")
    group.add_argument("--logprobs", type=int, default=0, metavar="N",
                       help="report each token's log-probability and its top N (0-20; --json: `logprobs`)")


def distribution_fields(args: argparse.Namespace) -> dict:
    """The GenerateRequest fields of add_distribution_arguments' flags."""
    return dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=tuple(args.logit_bias),
                ignore_eos=args.ignore_eos, logprobs=args.logprobs)
