"""Prompt files for spec-edge bench (and the scripts beside them): .jsonl entries with a
kind, or plain text, one prompt per line."""
from __future__ import annotations

import json
from pathlib import Path

KINDS = ("robot-command", "edit", "free-form", "code")
DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "bench" / "prompts.jsonl"


class PromptFileError(ValueError):
    """A prompt file that cannot be used; the message names the line."""


def load_prompts(path: Path | None = None, kinds: list[str] | None = None, quick: bool = False) -> list[dict]:
    """Prompts from a .jsonl file ({"id", "kind", "prompt", "quick"?} per line; kind one of KINDS) or a
    plain text file (one prompt per line, kind "free-form"). Blank lines and lines starting with # are
    skipped. quick=True keeps the entries marked "quick" (all of them when none is)."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist")
    prompts: list[dict] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if path.suffix == ".jsonl" or text.startswith("{"):
            try:
                entry = json.loads(text)
            except json.JSONDecodeError as err:
                raise PromptFileError(f"{path}:{number}: not valid JSON ({err.msg})") from None
            if not isinstance(entry, dict):
                raise PromptFileError(f"{path}:{number}: expected a JSON object")
        else:
            entry = {"prompt": text}
        prompt = entry.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptFileError(f"{path}:{number}: 'prompt' must be a non-empty string")
        kind = entry.get("kind", "free-form")
        if kind not in KINDS:
            raise PromptFileError(f"{path}:{number}: kind '{kind}' is not one of {', '.join(KINDS)}")
        pid = str(entry.get("id") or f"line{number}")
        if pid in seen:
            raise PromptFileError(f"{path}:{number}: id '{pid}' is used twice")
        seen.add(pid)
        prompts.append({"id": pid, "kind": kind, "prompt": prompt, "quick": bool(entry.get("quick", False))})
    if not prompts:
        raise PromptFileError(f"{path} holds no prompts")
    if kinds:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise PromptFileError(f"unknown prompt kinds {unknown}; use {', '.join(KINDS)}")
        prompts = [p for p in prompts if p["kind"] in kinds]
    if quick and any(p["quick"] for p in prompts):
        prompts = [p for p in prompts if p["quick"]]
    return prompts
