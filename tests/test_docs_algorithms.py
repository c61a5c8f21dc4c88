"""The pages that list funcopt's algorithms list all of them, or say how many.

README's first paragraph gives the registry's count; no page enumerates a
subset of the registry as if it were the suite (a run of four or more
algorithm names that is not the whole registry, in a paragraph that neither
names every algorithm nor gives the count).  ``docs/optimizers.md`` is
generated from the registry (``tests/test_registry.py`` keeps it equal);
``docs/benchmarks.md`` and ``docs/compat.md`` record runs (benchmarks, torch's
test suites) of the algorithms they name.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from funcopt.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[1]
RECORDS = {"docs/optimizers.md", "docs/benchmarks.md", "docs/compat.md"}
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))

_NAME = re.compile(r"`?(?:funcopt\.|torch\.optim\.)?\b(" + "|".join(map(re.escape, REGISTRY)) + r")\b`?")
_GAP = re.compile(r"^[\s,/]*(?:(?:and|or)\s+)?$")  # what may separate the names of one enumeration


def _runs(text: str) -> List[List[str]]:
    """Enumerations of algorithm names (``SGD, Adam, AdamW and Adagrad``) in ``text``."""
    runs: List[List[str]] = []
    end = None
    for m in _NAME.finditer(text):
        if end is not None and _GAP.match(text[end:m.start()]):
            runs[-1].append(m.group(1))
        else:
            runs.append([m.group(1)])
        end = m.end()
    return runs


def test_runs_finds_an_enumeration():  # the detector below can fire
    assert _runs("optimizers for PyTorch (SGD, Adam, AdamW, Adagrad).") == [["SGD", "Adam", "AdamW", "Adagrad"]]
    assert _runs("`funcopt.SGD`, `funcopt.Adam` and `torch.optim.Adagrad`; then Lion") == [
        ["SGD", "Adam", "Adagrad"], ["Lion"]]


def test_readme_first_paragraph_gives_the_count():
    first = (ROOT / "README.md").read_text().split("\n\n")[1]  # after the title
    assert re.search(rf"\b{len(REGISTRY)}\b", first), f"README's first paragraph must say {len(REGISTRY)}: {first!r}"
    assert "docs/optimizers.md" in first


@pytest.mark.parametrize("page", [p for p in PAGES if str(p.relative_to(ROOT)) not in RECORDS],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_lists_a_stale_subset(page: Path):
    stale = []
    for para in re.split(r"\n\s*\n", page.read_text()):
        named = {m.group(1) for m in _NAME.finditer(para)}
        if named == set(REGISTRY) or re.search(rf"\b{len(REGISTRY)}\b", para):
            continue
        stale += [run for run in _runs(para) if len(set(run)) >= 4]
    assert not stale, (f"{page.name} enumerates {stale}: name all {len(REGISTRY)} algorithms, say "
                       f"{len(REGISTRY)} in that paragraph")
