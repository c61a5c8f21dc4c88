"""The registry is the single list of algorithms; docs and exports follow it."""
from pathlib import Path

import pytest
import torch

import funcopt
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
    p = torch.zeros(3, requires_grad=True)
    assert spec.cls([p]).param_groups[0] == spec.torch_cls([p]).param_groups[0]


def test_unknown_algorithm_lookup_names_known_ones():
    with pytest.raises(KeyError, match="Adam"):
        registry.get("Shampoo")
