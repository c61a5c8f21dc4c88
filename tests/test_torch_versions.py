"""What differs between the torch releases funcopt supports (2.13 - 2.15), checked on this torch.

Every test here runs on each supported release (CI runs the suite on the
oldest and the newest); each checks one assumption ``funcopt/_compat.py`` makes
about the torch it runs on, so a release that changes it fails here first:

* the requirement in pyproject.toml, ``_compat.SUPPORTED`` and this torch agree;
* torch's TorchScript deprecation notice has the category ``_compat`` expects
  (``DeprecationWarning`` in 2.13, ``FutureWarning`` from 2.14), and funcopt
  silences exactly that notice: ``funcopt.script`` emits no warning at all,
  while funcopt's own warnings, torch's other warnings and the same text from
  anyone else still surface;
* where torch refuses to script, ``funcopt.script`` raises one clear error,
  changes nothing, and the eager and ``torch.compile`` paths give torch's numbers;
* the fused kernels and the ``torch.optim`` state_dict keys funcopt relies on.
"""
from __future__ import annotations

import pathlib
import re
import warnings
from typing import Any, Dict, List

import pytest
import torch

import funcopt
from funcopt import _compat
from funcopt.script import TorchScriptUnavailableError, quiet_jit, script_object

ROOT = pathlib.Path(__file__).resolve().parents[1]

# algorithm -> hyperparameters that give every state slot (SGD needs momentum)
ALGOS: Dict[str, Dict[str, Any]] = {
    "SGD": dict(lr=0.1, momentum=0.9),
    "Adam": dict(lr=0.1),
    "AdamW": dict(lr=0.1, weight_decay=0.1),
    "Adagrad": dict(lr=0.1),
}


def _params(seed: int = 0) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g).requires_grad_(), torch.randn(5, generator=g).requires_grad_()]


def _grads(params: List[torch.Tensor], seed: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=g) for p in params]


def _torch_steps(name: str, n: int, **kw: Any) -> List[torch.Tensor]:
    params = _params()
    opt = getattr(torch.optim, name)(params, **ALGOS[name], **kw)
    for i in range(n):
        for p, g in zip(params, _grads(params, i)):
            p.grad = g
        opt.step()
    return params


def _jit_notices(records: List[warnings.WarningMessage]) -> List[warnings.WarningMessage]:
    return [w for w in records if re.match(_compat.JIT_DEPRECATION_MESSAGE, str(w.message))]


def _probe(x: torch.Tensor) -> torch.Tensor:
    return x * 2


# ------------------------------------------------------------------ the range
def test_requirement_matches_supported_range() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(r'"torch>=(\d+)\.(\d+),<(\d+)\.(\d+)"', text)
    assert m, "pyproject.toml: torch requirement not of the form torch>=A.B,<C.D"
    low, high = (int(m.group(1)), int(m.group(2))), (int(m.group(3)), int(m.group(4)))
    oldest, newest = _compat.SUPPORTED
    assert low == oldest, (low, oldest)
    assert high == (newest[0], newest[1] + 1), (high, newest)
    assert oldest <= _compat.TORCH_VERSION[:2] <= newest, (torch.__version__, _compat.SUPPORTED)
    readme = (ROOT / "README.md").read_text()
    assert f"torch {oldest[0]}.{oldest[1]}" in readme and f"{newest[0]}.{newest[1]}" in readme


def test_version_parse() -> None:
    assert _compat._parse("2.15.0+cu132") == (2, 15, 0)
    assert _compat._parse("2.14.1") == (2, 14, 1)
    assert _compat._parse("2.16.0a0+git1234") == (2, 16, 0)
    assert _compat._parse("2.13") == (2, 13, 0)
    with pytest.raises(ValueError, match="torch version"):
        _compat._parse("nightly")


# --------------------------------------------------- TorchScript's deprecation
def test_torch_notice_has_the_expected_category() -> None:
    if _compat.scripting_unavailable():
        pytest.skip(f"TorchScript does not work here: {_compat.scripting_unavailable()}")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        torch.jit.script(_probe)
    notices = _jit_notices(rec)
    assert notices, f"torch {torch.__version__} no longer warns on torch.jit.script: update funcopt/_compat.py"
    for w in notices:
        assert w.category is _compat.JIT_DEPRECATION_CATEGORY, (torch.__version__, w.category, str(w.message))
        assert pathlib.Path(w.filename).parent.name == "jit", w.filename  # warned by torch.jit itself


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_script_warns_nothing_and_matches_torch(name: str) -> None:
    """``funcopt.script`` + steps under ``simplefilter("error")``: any warning fails.

    Scripted steps give torch.optim's numbers bitwise: its fused kernel's where funcopt's
    CPU step is that kernel, its foreach formula's where funcopt steps a native rule that
    reproduces it (SGD: ``tests/optimizers/test_native.py``)."""
    if _compat.scripting_unavailable():
        pytest.skip(f"TorchScript does not work here: {_compat.scripting_unavailable()}")
    params = _params()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = funcopt.script(getattr(funcopt, name)(params, **ALGOS[name]))
            for i in range(3):
                opt.step(_grads(params, i))
    assert rec == [], [f"{w.category.__name__}: {w.message}" for w in rec]
    assert type(opt.core).__name__ == "RecursiveScriptClass"
    kw = {"foreach": True} if opt.uses_native else {"fused": True}
    expected = _torch_steps(name, 3, **kw)
    for a, b in zip(params, expected):
        assert torch.equal(a, b), (name, (a - b).abs().max())


def test_quiet_jit_hides_only_torchs_notice() -> None:
    """Inside ``quiet_jit``: torch's notice is gone; everything else surfaces."""
    other = DeprecationWarning if _compat.JIT_DEPRECATION_CATEGORY is FutureWarning else FutureWarning
    text = "`torch.jit.script` is deprecated. Please switch to `torch.compile` or `torch.export`."
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with quiet_jit():
            # torch's notice, as torch.jit warns it on this torch: silenced
            warnings.warn_explicit(text, _compat.JIT_DEPRECATION_CATEGORY, "_script.py", 1, module="torch.jit._script")
            # the same text in the other category, from another module, or ours: all surface
            warnings.warn_explicit(text, other, "_script.py", 2, module="torch.jit._script")
            warnings.warn_explicit(text, _compat.JIT_DEPRECATION_CATEGORY, "mine.py", 3, module="mypkg.mine")
            warnings.warn("funcopt: our own deprecation", DeprecationWarning)
            warnings.warn("funcopt: our own future change", FutureWarning)
            warnings.warn("funcopt: our own warning", UserWarning)
    explicit = sorted(w.lineno for w in rec if w.filename in ("_script.py", "mine.py"))
    assert explicit == [2, 3], [(w.filename, w.lineno, w.category.__name__) for w in rec]
    ours = {(w.category, str(w.message)) for w in rec if str(w.message).startswith("funcopt:")}
    assert ours == {(DeprecationWarning, "funcopt: our own deprecation"),
                    (FutureWarning, "funcopt: our own future change"),
                    (UserWarning, "funcopt: our own warning")}, ours


def test_quiet_jit_filter_ends_with_the_block() -> None:
    if _compat.scripting_unavailable():
        pytest.skip(f"TorchScript does not work here: {_compat.scripting_unavailable()}")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with quiet_jit():
            torch.jit.script(_probe)
        inside = len(rec)
        torch.jit.script(_probe)
    assert inside == 0, [str(w.message) for w in rec]
    assert _jit_notices(rec), "the filter outlived quiet_jit()"


def test_warning_during_scripting_surfaces() -> None:
    """A warning raised by code being scripted (here: torch's own, not the notice) is not hidden."""
    if _compat.scripting_unavailable():
        pytest.skip(f"TorchScript does not work here: {_compat.scripting_unavailable()}")

    class _Warns(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            warnings.warn("funcopt-test: built while scripting", UserWarning)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="built while scripting"):
            script_object(_Warns())


# ------------------------------------------- a torch that refuses to script
@pytest.fixture
def refusing_torch(monkeypatch: pytest.MonkeyPatch) -> Any:
    """torch.jit.script raises, as in a release that removed TorchScript."""

    def removed(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("TorchScript has been removed from this release")

    _compat._probe_scripting.cache_clear()
    monkeypatch.setattr(torch.jit, "script", removed)
    yield
    monkeypatch.undo()
    _compat._probe_scripting.cache_clear()


def test_refused_scripting_one_clear_error_nothing_changes(refusing_torch: Any) -> None:
    assert "removed" in (_compat.scripting_unavailable() or "")
    params = _params()
    opt = funcopt.Adam(params, **ALGOS["Adam"])
    opt.step(_grads(params, 0))
    before = opt.state_dict()
    with pytest.raises(TorchScriptUnavailableError) as info:
        funcopt.script(opt)
    msg = str(info.value)
    assert "funcopt.script(Adam)" in msg and torch.__version__ in msg and "torch.compile" in msg, msg
    assert "removed" in msg, msg
    assert "\n" not in msg
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(TorchScriptUnavailableError):
        script_object(_probe)
    # nothing changed: still eager, same state, and it keeps stepping like torch.optim
    assert type(opt.core).__name__ != "RecursiveScriptClass"
    after = opt.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for i in before["state"]:
        for k in before["state"][i]:
            assert torch.equal(before["state"][i][k], after["state"][i][k])
    for i in range(1, 3):
        opt.step(_grads(params, i))
    expected = _torch_steps("Adam", 3, fused=True)  # funcopt's default on CPU
    for a, b in zip(params, expected):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.timeout(600)
def test_refused_scripting_compile_still_works(refusing_torch: Any) -> None:
    """``torch.compile`` does not depend on TorchScript: same numbers as torch.optim."""
    torch._dynamo.reset()
    try:
        params = _params()
        opt = funcopt.SGD(params, **ALGOS["SGD"])
        step = torch.compile(opt.step, backend="aot_eager", fullgraph=True)
        for i in range(3):
            step(_grads(params, i))
    finally:
        torch._dynamo.reset()
    expected = _torch_steps("SGD", 3)
    for a, b in zip(params, expected):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a - b).abs().max()


# -------------------------------------------------- kernels and state format
@pytest.mark.parametrize("op", ["_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_"])
def test_fused_kernel_present(op: str) -> None:
    assert callable(getattr(torch, op, None)), f"torch {torch.__version__} has no torch.{op}"


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_state_dict_keys_match_torch(name: str) -> None:
    ours_p, theirs_p = _params(), _params()
    ours = getattr(funcopt, name)(ours_p, **ALGOS[name])
    theirs = getattr(torch.optim, name)(theirs_p, **ALGOS[name])
    ours.step(_grads(ours_p, 0))
    for p, g in zip(theirs_p, _grads(theirs_p, 0)):
        p.grad = g
    theirs.step()
    a, b = ours.state_dict(), theirs.state_dict()
    assert [sorted(g) for g in a["param_groups"]] == [sorted(g) for g in b["param_groups"]]
    assert sorted(a["state"]) == sorted(b["state"])
    for i in b["state"]:
        assert sorted(a["state"][i]) == sorted(b["state"][i])
        for k in b["state"][i]:
            va, vb = a["state"][i][k], b["state"][i][k]
            assert (va.dtype, va.shape) == (vb.dtype, vb.shape), (name, k)
