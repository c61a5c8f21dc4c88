"""The registry is the single list of algorithms; docs and exports follow it."""
import itertools
from pathlib import Path

import pytest
import torch

import funcopt
from _oracles import without_instance_keys
from funcopt import registry

DOCS = Path(__file__).resolve().parents[1] / "docs" / "optimizers.md"


def test_docs_table_is_generated_from_registry():
    assert DOCS.read_text() == registry.markdown(), (
        "docs/optimizers.md is stale; regenerate it (command at its top)"
    )


@pytest.mark.parametrize("name", list(registry.REGISTRY))
def test_entry_is_consistent(name):
    spec = registry.REGISTRY[name]
    assert getattr(funcopt, name) is spec.cls
    # the oracle: torch.optim's class of the same name, or (an algorithm torch
    # lacks) a torch.optim.Optimizer written from the paper
    assert spec.torch_cls is getattr(torch.optim, name, spec.torch_cls)
    assert issubclass(spec.torch_cls, torch.optim.Optimizer)
    # lookup by name, funcopt class and torch class all give the entry
    assert registry.get(name) is registry.get(spec.cls) is registry.get(spec.torch_cls) is spec
    # construction defaults equal torch's (same param_groups keys and values)
    p = torch.zeros(spec.probe_shape, requires_grad=True)  # a shape torch's class accepts (Muon: 2-D)
    theirs = spec.torch_cls([p]).param_groups[0]
    assert without_instance_keys(spec, spec.cls([p]).param_groups[0], theirs) == theirs


def test_unknown_algorithm_lookup_names_known_ones():
    with pytest.raises(KeyError, match="Adam"):
        registry.get("Shampoo")


def _covered(points, keys):
    """Every (key, value) pair-of-pairs the points hold (values by grid index)."""
    out = set()
    for kw in points:
        cells = [(k, repr(kw[k])) for k in keys]
        out |= {(a, b) for i, a in enumerate(cells) for b in cells[i:]}
    return out


@pytest.mark.parametrize("name", list(registry.REGISTRY))
def test_pairs_cover_every_value_and_pair_of_the_grid(name, monkeypatch):
    monkeypatch.delenv("FUNCOPT_FULL_GRID", raising=False)
    spec = registry.REGISTRY[name]
    combos, pairs = list(spec.combos()), spec.pairs()
    keys = list(spec.grid)
    assert all(p in combos for p in pairs), "pairs() returned a point torch does not accept"
    assert len({repr(sorted(p.items())) for p in pairs}) == len(pairs), "a point twice"
    assert _covered(pairs, keys) == _covered(combos, keys)
    assert pairs == spec.pairs(), "not deterministic"
    if len(keys) >= 4:
        assert len(pairs) < len(combos)
    monkeypatch.setenv("FUNCOPT_FULL_GRID", "1")
    assert spec.pairs() == combos


def test_pairwise_cover_respects_missing_rows():
    # 3 binary columns, row (1, 1, 1) absent (as if torch refused it): the pairs
    # it alone would hold cannot be asked for; all others are covered
    rows = [r for r in itertools.product(range(2), repeat=3) if r != (1, 1, 1)]
    chosen = [rows[i] for i in registry._pairwise_cover(rows)]
    want = {(a, b) for r in rows for i, a in enumerate(enumerate(r)) for b in list(enumerate(r))[i:]}
    got = {(a, b) for r in chosen for i, a in enumerate(enumerate(r)) for b in list(enumerate(r))[i:]}
    assert got == want
    assert len(chosen) < len(rows)
    assert registry._pairwise_cover([]) == []
    # 6 binary columns, full product: a strength-2 cover needs far fewer than 64 rows
    full = list(itertools.product(range(2), repeat=6))
    assert len(registry._pairwise_cover(full)) <= 8
