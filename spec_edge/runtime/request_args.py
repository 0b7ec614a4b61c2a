"""The command-line flags of a request that `spec-edge generate` and `spec-edge ask` share: the target's distribution,
guided decoding, tool calls and images; request_fields(args) gives the GenerateRequest fields they set."""
from __future__ import annotations

import argparse

from spec_edge.runtime.grammar import text_or_file
from spec_edge.runtime.requests import ImageInput, RequestError
from spec_edge.runtime.tool_format import tools_from_json


def logit_bias_arg(text: str) -> tuple[int, float]:
    """One `--logit-bias ID:BIAS` value -> (token id, bias)."""
    token, sep, bias = text.partition(":")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--logit-bias takes TOKEN_ID:BIAS (e.g. 42:-100), got {text!r}") from None


FILE_SIGNATURES = {b"\xff\xd8\xff": "jpeg", b"\x89PNG\r\n\x1a\n": "png"}  # a file's first bytes -> encoding


def image_file(path: str) -> ImageInput:
    """An `--image FILE` -> ImageInput, its encoding as the file's own first bytes say (RequestError for a file
    that is not a JPEG or PNG, or cannot be read)."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as err:
        raise RequestError(f"--image {path}: cannot read it ({err.strerror})") from None
    encoding = next((enc for magic, enc in FILE_SIGNATURES.items() if data.startswith(magic)), None)
    if encoding is None:
        raise RequestError(f"--image {path} is neither a JPEG nor a PNG file (by its first bytes): convert it to one")
    return ImageInput(data=data, encoding=encoding)


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the request fields that change the target's distribution or report it, guide the output or
    offer tools."""
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
    group = parser.add_argument_group("guided decoding (at most one; the text, or a file path)")
    group.add_argument("--json-schema", help="JSON Schema the output must be valid against")
    group.add_argument("--grammar", help="grammar of the output: Lark (`start: ...`) or GBNF (`root ::= ...`)")
    group.add_argument("--regex", help="regular expression the whole output must match")
    group = parser.add_argument_group("tool calls (docs/tools.md; the calls are --json's `tool_calls`)")
    group.add_argument("--tools", metavar="FILE.json", help="the tools: a JSON list of OpenAI tools "
                       '({"type": "function", "function": {"name", "description", "parameters"}}) or of '
                       "{name, description, parameters} (the file or the text)")
    group.add_argument("--tool-choice", default="auto", help="auto | none | required | a tool's name (default auto)")
    group.add_argument("--no-parallel-tool-calls", action="store_true", help="at most one call")
    parser.add_argument("--image", action="append", default=[], metavar="FILE",
                        help="a JPEG or PNG image for a vision model (repeatable), bound in order to the prompt's "
                             "<__media__> markers; with none, all go before the prompt (docs/images.md)")


def request_fields(args: argparse.Namespace) -> dict:
    """The GenerateRequest fields of add_request_arguments' flags (RequestError for a tools list it cannot read)."""
    return dict(min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty, logit_bias=tuple(args.logit_bias),
                ignore_eos=args.ignore_eos, logprobs=args.logprobs, json_schema=text_or_file(args.json_schema),
                grammar=text_or_file(args.grammar), regex=text_or_file(args.regex),
                tools=tools_from_json(text_or_file(args.tools)) if args.tools else (), tool_choice=args.tool_choice,
                parallel_tool_calls=not args.no_parallel_tool_calls,
                images=tuple(image_file(path) for path in args.image))
