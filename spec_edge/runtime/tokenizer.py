"""Tokenizer, chat template and a UTF-8-safe streaming detokenizer (no transformers at run time)."""
from __future__ import annotations

import json
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
        self._template = None
        if self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
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

    def render_chat(self, messages: list[tuple[str, str]]) -> str:
        """The prompt text for (role, content) messages, ending with the assistant's turn."""
        if self._template is None:
            return "\n".join(content for _, content in messages)
        return self._template.render(
            messages=[{"role": role, "content": content} for role, content in messages],
            add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)


def _raise(message: str):
    raise ValueError(message)


class StreamDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character and
    never show a stop string (or the start of one that may still complete)."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""          # decoded text of ids (stop-truncated once stopped)
        self.emitted = 0        # characters of text already handed out
        self.stopped = False

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that is now safe to show (may be '')."""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text, self.stopped = text[:at], True
        self.text = text
        safe = len(text)
        if not self.stopped:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
                safe = len(text.rstrip("\ufffd"))
            for stop in self.stop:  # hold back a tail that could be the start of a stop string
                for n in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:n]):
                        safe = min(safe, len(text) - n)
                        break
        delta = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def finish(self) -> str:
        """The rest of the text at the end of the request."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta
