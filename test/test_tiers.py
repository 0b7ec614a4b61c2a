"""The tiers and the real model's forms stay what docs/testing.md ("Tiers") says: the release tier is exactly the
files its table names, and every test file that runs the embedded default on <repo>/engines marks its forms
(real_model), so the session makes them before the first test instead of whichever test comes first."""
from __future__ import annotations

import re
from pathlib import Path

from real_forms import REAL_FORMS

TEST = Path(__file__).resolve().parent
DOCS = TEST.parent / "docs" / "testing.md"
RUNS_REAL = re.compile(r"""REPO / ["']engines["']|test_params\(""")  # the real model's graphs in <repo>/engines
HELPERS = {"conftest.py", "rosutil.py"}
RELEASE = re.compile(r"^(pytestmark = .*|\s*@)pytest\.mark\.release\b", re.M)  # a module's mark or a test's


def test_files() -> list[Path]:
    return sorted(TEST.glob("test_*.py")) + sorted((TEST / "ros").glob("test_*.py"))


test_files.__test__ = False  # a helper, not a test


def tiers_section() -> str:
    text = DOCS.read_text()
    return text[text.index("## Tiers"):text.index("\n## ", text.index("## Tiers") + 1)]


def test_release_tier_is_the_documented_one():
    marked = {str(p.relative_to(TEST)) for p in test_files() if RELEASE.search(p.read_text())}
    rows = re.findall(r"^\| `([\w/]+\.py)(?:::\w+)?`", tiers_section(), flags=re.M)  # a file, or one test of it
    assert marked and sorted(marked) == sorted(rows), (sorted(marked), rows)


def test_every_real_model_file_marks_its_forms():
    unmarked = [str(p.relative_to(TEST)) for p in test_files() if p.name not in HELPERS
                and RUNS_REAL.search(p.read_text()) and "pytest.mark.real_model(" not in p.read_text()]
    assert not unmarked, f"{unmarked} run the real model: mark them pytest.mark.real_model(<form>)"
    named = {form for p in test_files() for marks in re.findall(r"mark\.real_model\(([^)]*)\)", p.read_text())
             for form in re.findall(r'"([\w-]+)"', marks)}
    assert named <= set(REAL_FORMS) and set(REAL_FORMS) <= named, (named, set(REAL_FORMS))  # none unused
