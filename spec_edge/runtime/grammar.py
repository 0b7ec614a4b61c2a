"""Guided decoding: a JSON Schema, a grammar (Lark / GBNF) or a regex the output must match.

The engine is llguidance (docs/guided.md says why): a Rust matcher over our own tokenizer.json
with the operations speculative decoding needs, all on the CPU:
  validate_tokens(draft)  how many of a draft the grammar admits: the draft is cut there
  consume / rollback      the matcher moves with the accepted tokens (rollback = moving back)
  compute_ff_tokens       the tokens the grammar forces next (JSON keys, punctuation, an enum value)
  token bitmask           which ids may come next, one row per verify position

Grammars are compiled once per distinct (kind, text) and kept (Grammars.compile, called by the
engine's request validation, off the loop); a request gets a Constraint: a copy of the compiled
matcher that follows that request's tokens. EOS is allowed only where the grammar may stop.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from spec_edge.runtime.tokenizer import Tokenizer

KINDS = ("json_schema", "grammar", "regex")


class GrammarError(ValueError):
    """A schema / grammar / regex that cannot be used; the message (the parser's) says why. The
    engine turns it into a RequestError."""


# JSON output in one layout, `{"key": value, "key": value}`: no free whitespace, so the grammar forces
# every key and separator (forced tokens are free drafts) and the output stays on one line
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_spec(json_schema: str = "", grammar: str = "", regex: str = "") -> tuple[str, str] | None:
    """(kind, text) of a request's guided-decoding fields, None when all are empty; two or more
    set is a GrammarError (a request takes at most one)."""
    given = [(kind, text) for kind, text in zip(KINDS, (json_schema, grammar, regex)) if text]
    if len(given) > 1:
        raise GrammarError(f"{' and '.join(kind for kind, _ in given)} are both set: send at most one of "
                           f"json_schema, grammar, regex")
    return given[0] if given else None


def text_or_file(value: str | None) -> str:
    """A --json-schema / --grammar / --regex value: the contents of the file it names when that
    file exists, else the text itself ("" for None)."""
    from pathlib import Path

    if not value:
        return ""
    try:
        path = Path(value)
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a schema text too long to be a file name
        pass
    return value


def read_text(kind: str, text: str) -> dict | bool | None:
    """The checks every backend makes before it compiles (kind, text): GrammarError for a blank text and for a
    json_schema that is not a JSON object (or true / false); the parsed schema for json_schema, else None."""
    if not text.strip():
        raise GrammarError(f"{kind} is blank: send the {kind} text or leave the field empty")
    if kind != "json_schema":
        return None
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise GrammarError(f"json_schema is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError(f"json_schema must be a JSON object (a JSON Schema), got {type(schema).__name__}")
    return schema


def _grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar definition of (kind, text); GrammarError for what cannot be read."""
    import llguidance

    schema = read_text(kind, text)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    if kind == "grammar":  # Lark, or GBNF (llama.cpp; `::=` rules), which llguidance converts to Lark
        try:
            return llguidance.grammar_from("grammar", text)
        except (ValueError, KeyError, IndexError) as err:  # the GBNF converter's parse errors
            raise GrammarError(f"grammar does not parse: {err}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    raise GrammarError(f"unknown grammar kind '{kind}': use one of {', '.join(KINDS)}")


class Grammars:
    """The compiled grammars of one engine (its tokenizer, vocabulary and EOS ids), cached by (kind, text)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: Sequence[int], cache_size: int = 64):
        self._hf = tokenizer
        self.vocab_size = vocab_size              # V of the target's logits
        self.eos_ids = tuple(eos_ids)
        self.cache_size = cache_size
        self._tokenizer = None                    # llguidance.LLTokenizer, built on first use (~0.5 s)
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()             # the node validates on its thread, the worker compiles too

    def llg_tokenizer(self):
        import llguidance

        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(self._hf.backend.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=list(self.eos_ids))
        return self._tokenizer

    def compile(self, kind: str, text: str):
        """The compiled matcher of (kind, text) in its start state (kept; copy it per request).
        GrammarError with the parser's message for an invalid schema / grammar / regex."""
        import llguidance

        key = (kind, text)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            matcher = llguidance.LLMatcher(self.llg_tokenizer(), _grammar_text(kind, text), log_level=0)
            if matcher.is_error():  # the parser's message, on one line
                message = "; ".join(line.strip() for line in matcher.get_error().splitlines() if line.strip())
                raise GrammarError(f"{kind} is invalid: {message}")
            self._compiled[key] = matcher
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            return matcher

    def constraint(self, kind: str, text: str) -> Constraint:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return Constraint(self.compile(kind, text).deep_copy(), self.vocab_size, kind)


class Constraint:
    """One request's grammar state. It has consumed exactly the tokens generated so far (the
    pending token included); masks() looks ahead along a draft path and comes back."""

    def __init__(self, matcher, vocab_size: int, kind: str = "grammar"):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.kind = kind
        self._bitmask = None

    def consume(self, tokens: Sequence[int]) -> None:
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"grammar matcher refused tokens it had allowed: {self.matcher.get_error()}")

    def admitted(self, tokens: Sequence[int]) -> int:
        """How many of tokens, from the first, the grammar allows next (a draft is cut there)."""
        return self.matcher.validate_tokens(list(tokens))

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (may be empty)."""
        return list(self.matcher.compute_ff_tokens())

    @property
    def done(self) -> bool:
        """Only EOS may come next (the grammar is complete and cannot be extended)."""
        return self.matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """The text so far is a full match (the output may end here)."""
        return self.matcher.is_accepting()

    def masks(self, path: Sequence[int]) -> np.ndarray:
        """(len(path) + 1, V) bool: row i = the ids allowed after path[:i] (path: draft tokens the
        grammar admits). The matcher ends where it started."""
        import llguidance.numpy as llg_np

        rows = len(path) + 1
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = llg_np.allocate_token_bitmask(rows, self.vocab_size)  # (rows, ceil(V / 32)) int32
        for i in range(rows):
            llg_np.fill_next_token_bitmask(self.matcher, self._bitmask, i)
            if i < len(path):
                self.consume([path[i]])
        if path:
            self.matcher.rollback(len(path))
        bits = np.unpackbits(self._bitmask[:rows].view(np.uint8), axis=1, bitorder="little")
        return bits[:, :self.vocab_size].astype(bool)  # (rows, V)


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(T, V) logits with -inf where (T, V) allowed is False (a new array)."""
    return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)


def mask_probs(q: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(k, V) drafter probabilities restricted to the allowed ids and renormalised (a row with no
    allowed mass stays zero: its draft token was forbidden, so the draft was cut before it)."""
    q = np.where(allowed, q, 0.0)
    total = q.sum(axis=-1, keepdims=True)
    return np.divide(q, total, out=np.zeros_like(q), where=total > 0)
