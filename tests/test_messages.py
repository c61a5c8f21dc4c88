"""Error messages: eager and scripted read the same and name what the user wrote.

Dtypes by name (``torch.float64``, never TorchScript's ``dtype 7``), shapes as
``torch.Size``, the gradient's index with its group and position, and for a
wrong container (a single tensor, a numpy array, an exhausted generator, a
non-tensor entry) a message that says what to pass instead.  Nothing changes
when a step is refused.
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import funcopt
from funcopt.script import quiet_jit
from funcopt import base
from funcopt.registry import REGISTRY

MODES = ["eager", "scripted"]


def _opt(name, mode):
    """Two groups of one parameter each, shaped as torch's class takes them
    (``spec.param_shape``: (2,) and (3,), or (2, 1) and (3, 1) for a matrices-only rule)."""
    spec = REGISTRY[name]
    a = torch.zeros(spec.param_shape((2,)), requires_grad=True)
    b = torch.zeros(spec.param_shape((3,)), requires_grad=True)
    opt = spec.cls([{"params": [a]}, {"params": [b]}], lr=0.1)
    return funcopt.script(opt) if mode == "scripted" else opt, [a, b]


def _size(shape):
    return re.escape(str(torch.Size(shape)))


def _longer(shape):
    return (shape[0] + 1,) + tuple(shape[1:])


# (case, gradients for parameter shapes (a, b), error type, message pattern for those shapes)
CASES = [
    ("dtype", lambda a, b: [torch.zeros(a), torch.zeros(b, dtype=torch.float64)], ValueError,
     lambda a, b: r"^funcopt: gradient 1 \(param_groups\[1\], position 0\) has dtype torch\.float64 but its "
     r"parameter has dtype torch\.float32$"),
    ("shape", lambda a, b: [torch.zeros(a), torch.zeros(_longer(b))], ValueError,
     lambda a, b: r"^funcopt: gradient 1 \(param_groups\[1\], position 0\) has shape " + _size(_longer(b))
     + r" but its parameter has shape " + _size(b) + "$"),
    ("single tensor", lambda a, b: torch.zeros(a), TypeError, lambda a, b: r"got a single tensor; pass \[grad\]"),
    ("numpy array", lambda a, b: np.zeros(5), TypeError, lambda a, b: r"numpy array; pass \[torch\.from_numpy"),
    ("numpy entry", lambda a, b: [np.zeros(a), None], TypeError,
     lambda a, b: r"gradient 0 \(param_groups\[0\], position 0\) is a numpy\.ndarray, not a torch tensor"),
    ("consumed generator", lambda a, b: (g for g in []), TypeError, lambda a, b: r"already consumed\?"),
    ("count", lambda a, b: [torch.zeros(a)], ValueError, lambda a, b: r"got 1 gradients for 2 parameters"),
]


@pytest.mark.parametrize("name", list(REGISTRY))
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_eager_and_scripted_errors_read_the_same(name, case):
    make, err, pattern = next((m, e, p) for c, m, e, p in CASES if c == case)
    messages = []
    for mode in MODES:
        opt, params = _opt(name, mode)
        shapes = [tuple(p.shape) for p in params]
        before = [p.detach().clone() for p in params]
        with pytest.raises(err, match=pattern(*shapes)) as info:
            opt.step(make(*shapes))
        messages.append(str(info.value))
        assert all(torch.equal(p.detach(), q) for p, q in zip(params, before))
        assert opt.state_dict()["state"] == {} or REGISTRY[name].cls.init_at_construction
    assert messages[0] == messages[1]


def test_scalar_type_table_matches_torchscript_numbering():
    """``_SCALAR_TYPES[k]`` is the dtype TorchScript prints as ``k``."""
    @torch.jit.script
    def number(x: torch.Tensor) -> str:
        return str(x.dtype)

    with quiet_jit():
        for k, dtype in enumerate(base._SCALAR_TYPES):
            if dtype in (torch.qint8, torch.quint8, torch.qint32, torch.complex32):
                continue  # no plain zeros() for quantized dtypes; complex32 warns it is experimental
            assert number(torch.zeros(1, dtype=dtype)) == str(k), dtype


def test_script_of_a_torch_optimizer_says_what_to_pass():
    opt = torch.optim.RMSprop([torch.zeros(2, requires_grad=True)])
    with pytest.raises(TypeError, match=r"expects a funcopt optimizer .* got torch\.optim\.rmsprop\.RMSprop"):
        funcopt.script(opt)
