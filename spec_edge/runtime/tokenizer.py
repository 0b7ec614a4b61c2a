"""Tokenizer, chat template and a UTF-8-safe streaming detokenizer (no transformers at run time)."""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment


class Tokenizer:
    def __init__(self, graph_dir: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        graph_dir = Path(graph_dir)
        self.backend = HFTokenizer.from_file(str(graph_dir / "tokenizer.json"))
        meta = json.loads((graph_dir / "tokenizer_config.json").read_text())
        self.bos_token: str = meta.get("bos_token", "")
        self.eos_token: str = meta.get("eos_token", "")
        self.add_bos: bool = meta.get("add_bos", False)
        # the template: tokenizer_config.json's, else a chat_template.jinja beside it (Edge-LLM's export moves
        # it there and drops the key)
        template_file = graph_dir / "chat_template.jinja"
        self.chat_template: str = meta.get("chat_template") or (
            template_file.read_text(encoding="utf-8") if template_file.is_file() else "")
        # how a token's text maps to bytes (incomplete_tail): "byte_level" (GPT-2 style ByteLevel decoder),
        # "byte_fallback" (SentencePiece with <0xNN> tokens), else "" (only the decoded text is known)
        decoder = json.loads((graph_dir / "tokenizer.json").read_text(encoding="utf-8")).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
        self._byte_form = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else ""
        self._special = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson
            env.globals["strftime_now"] = _strftime_now
            self._template = env.from_string(self.chat_template)

    def vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def token_id(self, text: str) -> int | None:
        return self.backend.token_to_id(text)

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token) if self.add_bos and self.bos_token else None
        return ([bos] if bos is not None else []) + ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def incomplete_tail(self, ids: list[int], text: str) -> int:
        """How many characters at the end of text = decode(ids) stand for an incomplete UTF-8 sequence (0 or
        1: the decoder shows the start of a character whose other bytes are in tokens not generated yet as one
        U+FFFD). A U+FFFD the tokens really spell (bytes EF BF BD) is text and not counted; for a tokenizer
        whose tokens' bytes are unknown here, a final U+FFFD is taken as incomplete."""
        if not text.endswith("\ufffd"):
            return 0
        if not self._byte_form:
            return 1
        tail = b""
        for token in reversed(ids):  # the last 4 bytes decide
            if len(tail) >= 4:
                break
            tail = self._token_bytes(int(token)) + tail
        return 1 if _incomplete_utf8(tail[-4:]) else 0

    def _token_bytes(self, token: int) -> bytes:
        """The bytes a token adds to decode()'s text (special tokens: none)."""
        if token in self._special:
            return b""
        piece = self.backend.id_to_token(token) or ""
        if self._byte_form == "byte_level" and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        if self._byte_form == "byte_fallback" and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # an added token, a SentencePiece piece

    def render_chat(self, messages: list[tuple[str, str]] | list[dict], tools: list[dict] | None = None) -> str:
        """The prompt text for (role, content) messages (or the template's message dicts, tool calls in them),
        ending with the assistant's turn; tools: the template's `tools` (runtime/tool_format.py)."""
        turns = [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages]
        if self._template is None:
            return "\n".join(turn["content"] for turn in turns)
        return self._template.render(messages=turns, add_generation_prompt=True, bos_token=self.bos_token,
                                     eos_token=self.eos_token, **({"tools": tools} if tools else {}))


def _byte_level_table() -> dict[str, int]:
    """GPT-2's ByteLevel alphabet: the character that stands for each byte in a byte-level token."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\u00a1"), ord("\u00ac") + 1)) + \
        list(range(ord("\u00ae"), ord("\u00ff") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


_BYTE_OF = _byte_level_table()


def _incomplete_utf8(data: bytes) -> bool:
    """True when data ends inside a UTF-8 character whose bytes so far are valid (more would complete it)."""
    for back in range(1, min(4, len(data)) + 1):
        byte = data[-back]
        if byte & 0xC0 == 0x80:  # a continuation byte: look further back for its lead
            continue
        need = 2 if byte & 0xE0 == 0xC0 else 3 if byte & 0xF0 == 0xE0 else 4 if byte & 0xF8 == 0xF0 else 1
        if need <= back:
            return False
        try:  # the bytes so far must be a valid start (E0 80 or ED A0 are not)
            data[-back:].decode("utf-8")
        except UnicodeDecodeError as err:
            return err.reason == "unexpected end of data"
        return False
    return False


def _raise(message: str):
    raise ValueError(message)


def _strftime_now(format: str) -> str:
    """Hugging Face's strftime_now (the date some templates write, e.g. Llama 3.x's, Mistral Small 3.1's)."""
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """Hugging Face's tojson filter (transformers' chat_template_utils.py), which templates are written for: keys
    in their order, no HTML escaping (Jinja's own sorts keys and escapes <, >, &, ')."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character and
    never show a stop string (or the start of one that may still complete). text never ends in an
    incomplete character: while one may still complete, push holds it back; finish drops it (its ids stay
    in ids: the answer was cut inside a character, and the finish reason says why)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""          # decoded text of ids (stop-truncated once stopped)
        self.emitted = 0        # characters of text already handed out
        self.stopped = False
        self._incomplete = 0    # characters at the end of text that stand for an incomplete character

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that is now safe to show (may be '')."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        self._incomplete = 0 if self.stopped else self.tokenizer.incomplete_tail(self.ids, text)
        safe = len(text) - self._incomplete  # an incomplete UTF-8 sequence waits for its next bytes
        if not self.stopped:
            for stop in self.stop:  # hold back a tail that could be the start of a stop string
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        safe = min(safe, len(text) - n)
                        break
        delta = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def finish(self) -> str:
        """The rest of the text at the end of the request (an incomplete last character dropped)."""
        if self._incomplete:
            self.text, self._incomplete = self.text[:len(self.text) - self._incomplete], 0
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def kept_ids(self) -> list[int]:
        """ids, cut after the shortest prefix whose text holds a stop string once stopped (what plain decoding,
        checking after every token, would have stopped at)."""
        if self.stopped:
            for n in range(1, len(self.ids) + 1):
                if any(stop in self.tokenizer.decode(self.ids[:n]) for stop in self.stop):
                    return self.ids[:n]
        return list(self.ids)
