"""Prompt files for `spec-edge bench`: the shipped set and the parser's refusals."""
from __future__ import annotations

import pytest

from spec_edge.tools.prompts import KINDS, PromptFileError, load_prompts


def test_shipped_prompt_set_covers_every_kind():
    prompts = load_prompts()
    assert {p["kind"] for p in prompts} == set(KINDS)
    quick = load_prompts(quick=True)
    assert {p["kind"] for p in quick} == set(KINDS) and len(quick) < len(prompts)
    assert len({p["id"] for p in prompts}) == len(prompts)


def test_filters_and_plain_text(tmp_path):
    assert {p["kind"] for p in load_prompts(kinds=["edit"])} == {"edit"}
    text = tmp_path / "mine.txt"
    text.write_text("# my prompts\nGo to the door.\n\nPick up the cup.\n")
    prompts = load_prompts(text)
    assert [p["prompt"] for p in prompts] == ["Go to the door.", "Pick up the cup."]
    assert all(p["kind"] == "free-form" for p in prompts)


@pytest.mark.parametrize("line,message", [
    ('{"prompt": "x", "kind": "poetry"}', "kind 'poetry'"),
    ('{"prompt": ""}', "non-empty"),
    ('{"prompt": "x"', "not valid JSON"),
    ('["x"]', "JSON object"),
])
def test_bad_lines_name_the_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine", "kind": "code"}\n' + line + "\n")
    with pytest.raises(PromptFileError, match=f"p.jsonl:2: .*{message}"):
        load_prompts(path)


def test_duplicate_ids_and_empty_files(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n')
    with pytest.raises(PromptFileError, match="used twice"):
        load_prompts(path)
    path.write_text("\n# nothing\n")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts(path)
    with pytest.raises(PromptFileError, match="unknown prompt kinds"):
        load_prompts(kinds=["poetry"])
