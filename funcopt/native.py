"""funcopt's native one-pass optimizer steps: build, load, status.

The elementwise update rules without an ATen fused kernel (RMSprop, Adamax,
Adadelta, NAdam, RAdam, ASGD, Rprop, Lion) each have a C++ twin of their
foreach formula, beside it (``funcopt/optimizers/<name>.cpp``): one loop that
reads and writes every element once, vectorized by the compiler (each flag
combination is its own branch-free loop), one ``at::parallel_for`` per step
over every tensor's elements (``funcopt::for_each_chunk``).  SGD has one too
(float32/float64 CPU; its fused ATen kernel elsewhere).  They register one operator,
``torch.ops.funcopt.step_(rule, params, grads, state, hyper, grad_scale,
found_inf)``, with ``TORCH_LIBRARY``: callable from eager code, from
TorchScript (the scripted step stays GIL-free) and, with the fake
implementation registered here, from ``torch.compile`` as one op.

**How it is built and shipped.** Compiled on first use with torch's own
``torch.utils.cpp_extension`` (the machine's C++ compiler, ``-O3
-march=native``) into a per-user cache, then loaded from there by every later
process in well under a second.  Why not compiled into the wheel: a wheel
would have to be built per torch release (the C++ ABI of torch changes between
2.13, 2.14 and 2.15) and per CPU baseline (a portable build gives up the
machine's widest vectors, which is what takes these loops to the memory
bandwidth limit), and pip's isolated build would pull a multi-GB CUDA torch to
compile against.  The cache key covers the sources, the flags, torch's version
and the CPU's feature flags, so a torch upgrade or another machine sharing the
home directory rebuilds instead of loading a wrong library.

* ``FUNCOPT_NATIVE=0``: never build or load; every rule runs its foreach
  formula (torch's exact numbers).  ``FUNCOPT_NATIVE=1``: a failed build is an
  error instead of a fallback.
* :func:`disable` (a context manager): the same as ``FUNCOPT_NATIVE=0`` for
  optimizers built (or rebuilt) inside it -- the fallback path in-process,
  for tests and comparisons.
* ``FUNCOPT_CACHE_DIR``: where the library is built (default
  ``$XDG_CACHE_HOME/funcopt`` or ``~/.cache/funcopt``).
* Where no compiler works, the first optimizer that would use a native rule
  warns once (:class:`NativeUnavailableWarning`, with the compiler's error)
  and funcopt runs the foreach formulas.

The library is one file (:func:`library_path`); a process that never imports
funcopt (a saved TorchScript module that calls the native op, a C++ program)
loads it with ``torch.ops.load_library(path)``.  ``opt.core`` -- what users
embed in their own ScriptModules -- calls ATen ops only, so saved train steps
need no library at all.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import shutil
import tempfile
import threading
import time
import warnings
from typing import Iterator, List, Optional

import torch

__all__ = ["NativeUnavailableWarning", "available", "build", "disable", "library_path", "load", "status", "RULES"]

SOURCE_DIR = pathlib.Path(__file__).resolve().parent / "optimizers"
CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]


def _openmp() -> List[str]:
    """The OpenMP runtime torch itself loads (a file under torch's own library folders), or [].

    torch's CPU ``at::parallel_for`` is OpenMP's header-inline parallel region: a build
    without ``-fopenmp`` runs every rule on the calling thread whatever
    ``torch.get_num_threads()`` says.  The library links exactly the libgomp that torch
    ships (``torch/lib/libgomp.so.1``, or a renamed copy such as ``libgomp-<hash>.so.1``):
    the loader finds that soname already loaded, so the process keeps one OpenMP runtime
    (a second one, e.g. the system's ``libgomp.so.1`` beside torch's renamed copy, gives
    wrong thread numbers).  Where torch ships none (not an OpenMP build, or one linked
    against the system's runtime), the rules run on one thread.
    """
    if "OpenMP" not in torch.__config__.parallel_info():
        return []
    root = pathlib.Path(torch.__file__).resolve().parent
    found = sorted(p for d in (root / "lib", root.parent / "torch.libs") if d.is_dir()
                   for p in d.glob("libgomp*.so*"))
    return [str(found[0])] if found else []


_OPENMP = _openmp()
# compiled with -fopenmp and linked against torch's own runtime file, where there is one
LDFLAGS: List[str] = _OPENMP
if _OPENMP:
    CFLAGS = CFLAGS + ["-fopenmp"]
NATIVE_DTYPES = (torch.float32, torch.float64)
# rule name -> the algorithm file whose C++ twin implements it (tests and docs read this)
RULES = ("rmsprop", "adamax", "adadelta", "nadam", "radam", "asgd", "rprop", "lion", "sgd")


class NativeUnavailableWarning(UserWarning):
    """funcopt's native kernels could not be built or loaded; the foreach formulas run instead."""


_lock = threading.Lock()
_state: dict = {"loaded": None, "error": None, "warned": False, "seconds": None, "built": False, "disabled": 0}


def _sources() -> List[pathlib.Path]:
    files = [SOURCE_DIR / "_native.cpp"] + [SOURCE_DIR / f"{r}.cpp" for r in RULES]
    return [f for f in files if f.exists()]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _key() -> str:
    h = hashlib.sha256()
    for f in _sources() + [SOURCE_DIR / "_native.h"]:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(" ".join(LDFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch._C._GLIBCXX_USE_CXX11_ABI).encode())
    h.update(_cpu_flags().encode())
    return h.hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    """Where libraries are built: ``$FUNCOPT_CACHE_DIR/native``, else
    ``$XDG_CACHE_HOME/funcopt/native`` or ``~/.cache/funcopt/native``."""
    root = os.environ.get("FUNCOPT_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "funcopt")
    return pathlib.Path(root) / "native"


def library_path() -> pathlib.Path:
    """The library this process loaded; before a load, where this torch + these
    sources + this CPU's library is (or will be)."""
    if _state["loaded"] is not None:
        return _state["loaded"]
    return cache_dir() / _key() / "funcopt_native.so"


def _mode() -> str:
    if _state["disabled"]:
        return "off"
    v = os.environ.get("FUNCOPT_NATIVE", "").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    if v in ("1", "on", "true", "yes", "require"):
        return "require"
    return "auto"


@contextlib.contextmanager
def disable() -> Iterator[None]:
    """Within the ``with`` block, as ``FUNCOPT_NATIVE=0``: optimizers built (or
    rebuilt: new parameter groups, ``load_state_dict``) there run the foreach
    formulas -- with ``impl="auto"``, cache-blocked (``Core._blocked``), the
    path of a machine without a compiler.  An optimizer keeps its choice after
    the block until it is rebuilt.  Process-wide (not per thread); nests.
    ``impl="native"`` raises inside it."""
    with _lock:
        _state["disabled"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["disabled"] -= 1


def build(verbose: bool = False) -> pathlib.Path:
    """Compile the library into :func:`library_path` (if it is not there) and return the path.

    Concurrent builders (processes, threads) are safe: each compiles in its
    own directory and the finished file is renamed into place atomically.
    Raises whatever the compiler raised.
    """
    target = cache_dir() / _key() / "funcopt_native.so"
    if target.exists():
        return target
    from torch.utils import cpp_extension

    target.parent.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix="build-", dir=target.parent)
    try:
        t0 = time.perf_counter()
        cpp_extension.load(
            name="funcopt_native",
            sources=[str(s) for s in _sources()],
            extra_cflags=CFLAGS + [f"-I{SOURCE_DIR}"],
            extra_ldflags=LDFLAGS,
            build_directory=work,
            is_python_module=False,
            verbose=verbose,
        )
        built = pathlib.Path(work) / "funcopt_native.so"
        os.replace(built, target)
        _state["seconds"] = time.perf_counter() - t0
        _state["built"] = True
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _register_fake() -> None:
    # torch.compile sees the op as one in-place call: nothing to compute at trace time
    try:
        @torch.library.register_fake("funcopt::step_")
        def _(rule, params, grads, state, hyper, grad_scale=None, found_inf=None):  # noqa: ANN001
            return None
    except RuntimeError as e:  # registered already (a second load in this process)
        if "already" not in str(e):
            raise


def load() -> Optional[pathlib.Path]:
    """Build if needed and load the library into this process, once.

    Returns its path, or None where it cannot be had (``FUNCOPT_NATIVE=0``,
    or no working compiler: one :class:`NativeUnavailableWarning` per process
    then; ``FUNCOPT_NATIVE=1`` turns that into a ``RuntimeError``).
    """
    mode = _mode()
    if mode == "off":
        return None
    with _lock:
        if _state["loaded"] is not None:
            return _state["loaded"]
        if _state["error"] is None:
            try:
                t0 = time.perf_counter()
                path = build()
                if not hasattr(torch.ops.funcopt, "step_") or not _op_exists():
                    torch.ops.load_library(str(path))
                _register_fake()
                if _state["seconds"] is None:
                    _state["seconds"] = time.perf_counter() - t0
                _state["loaded"] = path
                return path
            except Exception as e:  # no compiler, a broken toolchain, a read-only cache
                _state["error"] = f"{type(e).__name__}: {str(e).strip()[-2000:]}"
        if mode == "require":
            raise RuntimeError(f"funcopt: FUNCOPT_NATIVE=1 but the native kernels are unavailable: {_state['error']}")
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(
                "funcopt: native optimizer kernels unavailable, using the foreach formulas "
                f"(slower on CPU; set FUNCOPT_NATIVE=0 to choose that quietly). Build error: {_state['error']}",
                NativeUnavailableWarning,
                stacklevel=3,
            )
        return None


def _op_exists() -> bool:
    try:
        torch._C._jit_get_operation("funcopt::step_")
        return True
    except RuntimeError:
        return False


def available() -> bool:
    """True where the native op is (or can be) loaded; builds on first call."""
    return load() is not None


def status() -> dict:
    """What funcopt knows about its native library (for ``funcopt native`` and bug reports)."""
    return {
        "mode": _mode(),
        "path": str(library_path()),
        "loaded": _state["loaded"] is not None,
        "built_now": _state["built"],
        "seconds": _state["seconds"],
        "error": _state["error"],
        "rules": list(RULES),
    }
