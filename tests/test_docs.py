"""The documentation is checked against the code.

* Every public name of ``funcopt`` and ``funcopt.distributed`` is rendered by
  the API reference (a ``::: ident`` directive in ``docs/api/*.md``, the name
  itself or the module that defines it).
* Every relative link in ``README.md`` and ``docs/*.md`` points at a file that
  exists, and every ``#anchor`` into a Markdown file at one of its headings.
* The snippets of ``docs/index.md``, ``docs/migration.md``, ``docs/limits.md``,
  ``docs/distributed.md`` and ``README.md`` run:
  a fenced ``python`` block preceded by

  - ``<!-- doctest: run -->`` must run without an exception;
  - ``<!-- doctest: run world_size=N -->`` must run without an exception in N
    processes with the environment torchrun sets (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
  - ``<!-- doctest: raises -->`` must raise, and the error must be the one the
    page shows in the ``text`` block right after the snippet (its first line,
    ``Type: message``; ``...`` stands for any text).

  Each snippet is a file run as ``__main__``; the single-process snippets of
  all pages run in order in one interpreter, the N-process ones in one set of
  N (one torch import each, not one per snippet), all in one temporary
  directory (a "before" snippet may write a checkpoint the "after" snippet
  loads).

The mkdocs build itself (``mkdocs build --strict``) is ``.ci/docs``.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

import funcopt
import funcopt.distributed

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.M)
_SNIPPET = re.compile(
    r"<!-- doctest: (run(?: world_size=(\d+))?|raises) -->\n```python\n(.*?)```\n"
    r"(?:\s*```text\n(.*?)```)?", re.S)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)


# ----------------------------------------------------------- API coverage
def _directives() -> List[str]:
    """Every ``::: ident`` of docs/api/*.md, the registry marker expanded as the
    docs build expands it (.ci/mkdocs_hooks.py: one directive per algorithm)."""
    out: List[str] = []
    for md in sorted((DOCS / "api").glob("*.md")):
        text = md.read_text()
        out += _DIRECTIVE.findall(text)
        if "<!-- funcopt:registry-classes -->" in text:
            out += [f"{s.cls.__module__}.{s.cls.__name__}" for s in funcopt.registry.REGISTRY.values()]
    return out


@pytest.mark.parametrize("module", [funcopt, funcopt.distributed], ids=lambda m: m.__name__)
def test_every_public_name_in_api_reference(module):
    idents = set(_directives())
    assert idents, "docs/api/*.md renders nothing"
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        home = getattr(obj, "__module__", None)
        covered = (
            f"{module.__name__}.{name}" in idents
            or (inspect.ismodule(obj) and obj.__name__ in idents)
            or (home in idents and hasattr(sys.modules[home], name))
            or f"{home}.{getattr(obj, '__qualname__', name)}" in idents
            # a constant (REGISTRY) rendered with the module that defines it
            or any(i in sys.modules and getattr(sys.modules[i], name, None) is obj for i in idents)
        )
        if not covered:
            missing.append(name)
    assert not missing, f"{module.__name__}: not in docs/api/*.md: {missing}"


def test_api_directives_resolve():
    import importlib

    for ident in _directives():
        parts = ident.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        else:
            pytest.fail(f"::: {ident} names nothing importable")


def test_sharded_checkpoint_functions_documented():
    idents = set(_directives())
    assert "funcopt.distributed.zero.checkpoint" in idents
    from funcopt.distributed.zero import checkpoint

    for fn in (checkpoint.save_sharded, checkpoint.load_sharded):
        assert (fn.__doc__ or "").strip(), fn


# ------------------------------------------------------------------ links
def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs checks anchors against)."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(md: Path) -> set:
    body = _FENCE.sub("", md.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*$", body, re.M)}


def _pages() -> List[Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    body = _FENCE.sub("", page.read_text())
    bad = []
    for link in _LINK.findall(body):
        if "://" in link or link.startswith("mailto:"):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading '#{anchor}' in {target.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: " + "; ".join(bad)


# --------------------------------------------------------------- snippets
def _snippets(page: str) -> List[Tuple[str, Optional[int], str, Optional[str], int]]:
    text = (DOCS / page).read_text()
    out = []
    for m in _SNIPPET.finditer(text):
        kind = "raises" if m.group(1) == "raises" else "run"
        world = int(m.group(2)) if m.group(2) else None
        line = text.count("\n", 0, m.start()) + 2
        out.append((kind, world, m.group(3), m.group(4), line))
    return out


_SNIPPET_PAGES = ("index.md", "migration.md", "limits.md", "distributed.md", "../README.md")   # relative to docs/

# Runs a page's snippets of one kind in order in one interpreter (one torch
# import instead of one per snippet); each snippet is a file run as __main__.
# A "run" snippet that fails ends the process at once (exit 1), so the test
# can stop the other ranks instead of letting them wait in a collective.
# Each snippet's globals are kept to the end and the process ends with
# os._exit: dropping them ran C++ destructors (a DDP model, its gloo group)
# after the snippet's destroy_process_group, and one such destructor hung
# rank 0 for good once in a loaded full run (faulthandler: no Python frame
# below the run_path line); users' scripts end there, at interpreter exit.
_DRIVER = """
import json, os, runpy, sys, traceback
import faulthandler, time
jobs, out, meet = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
results = []
kept = []
def save():
    with open(out, "w") as f:
        json.dump(results, f)
def barrier(i):
    # every rank starts snippet i together, so a rank that finished the previous
    # snippet early does not spend its rendezvous timeout waiting for a slow peer
    open(f"{meet}.{i}.{rank}", "w").close()
    deadline = time.monotonic() + 400
    while not all(os.path.exists(f"{meet}.{i}.{r}") for r in range(world)):
        if time.monotonic() > deadline:
            results.append({"ok": False, "error": "TimeoutError: peers never reached snippet %d" % i,
                            "traceback": "barrier before snippet %d timed out" % i})
            save()
            sys.exit(1)
        time.sleep(0.05)
for i, (path, kind, port) in enumerate(jobs):
    if port:
        os.environ["MASTER_PORT"] = port
    if world > 1:
        barrier(i)
    # a snippet stuck for minutes prints every thread's stack into this rank's log
    faulthandler.dump_traceback_later(240, exit=False)
    try:
        kept.append(runpy.run_path(path, run_name="__main__"))
        results.append({"ok": True})
    except BaseException as e:
        text = str(e).splitlines()[0] if str(e) else ""
        results.append({"ok": False, "error": type(e).__name__ + (": " + text if text else ""),
                        "traceback": traceback.format_exc()})
        if kind != "raises":
            save()
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(1)
    faulthandler.cancel_dump_traceback_later()
    print("snippet done:", path, flush=True)
save()
sys.stdout.flush(); sys.stderr.flush()
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> Dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::DeprecationWarning")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _expected_matches(expected: str, got: str) -> bool:
    pattern = ".*?".join(re.escape(piece) for piece in expected.split("..."))
    return re.match(pattern, got) is not None


def _run_ranks(world: int, jobs: list, cwd: Path, tag: str, timeout: float) -> Tuple[List[int], List[str], List[Optional[list]]]:
    procs, logs, outs = [], [], []
    for rank in range(world):
        env = dict(_env(), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1")
        logs.append(cwd / f"{tag}.rank{rank}.log")
        outs.append(cwd / f"{tag}.rank{rank}.json")
        with open(logs[-1], "w") as log:   # a file, not a pipe: nothing blocks on a full pipe
            procs.append(subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(jobs), str(outs[-1]),
                                           str(cwd / f"{tag}.meet")],
                                          cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one rank failed: the others would wait for it in a collective
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    results = [json.loads(o.read_text()) if o.exists() else None for o in outs]
    return [p.returncode for p in procs], [log.read_text() for log in logs], results


@pytest.mark.timeout(600)
def test_snippets(tmp_path: Path):
    """Every page's snippets, in page order: the single-process ones of all pages in one
    interpreter, the N-process ones in one set of N per page (torch's RPC keeps its first
    agent for RRefs, so two pages' RPC snippets cannot share a process)."""
    snippets = [(page,) + sn for page in _SNIPPET_PAGES for sn in _snippets(page)]
    # N-process snippets of a page without an RPC snippet join the first RPC page's
    # processes (or one shared set): a process set costs N interpreter start-ups
    rpc_pages = [p for p, _, w, code, _, _ in snippets if w and "rpc" in code.lower()]
    shared = str(_SNIPPET_PAGES.index(rpc_pages[0])) if rpc_pages else "0"
    groups: Dict[Tuple[int, str], list] = {}
    for i, (page, kind, world, code, expected, line) in enumerate(snippets):
        script = tmp_path / f"snippet_{i}.py"   # a file: TorchScript reads the source of what it compiles
        script.write_text(code)
        port = str(_free_port()) if world else ""
        key = (world, str(_SNIPPET_PAGES.index(page)) if page in rpc_pages else shared) if world else (1, "")
        groups.setdefault(key, []).append((i, [str(script), kind, port]))
    # two lanes on the 2-core machine, each running its groups one after another (each
    # group its own processes, rendezvous files and ports); the groups go to the lane
    # with less work so far (a process set's start-up ~10 s, a snippet ~1.5 s); the
    # checks below read the results in page order
    from concurrent.futures import ThreadPoolExecutor

    order = sorted(groups)
    lanes: List[list] = [[], []]
    work = [0.0, 0.0]
    for k in sorted(order, key=lambda k: -len(groups[k])):
        j = work.index(min(work))
        lanes[j].append(k)
        work[j] += 10 + 1.5 * len(groups[k])

    def lane(keys):
        return {k: _run_ranks(k[0], [job for _, job in groups[k]], tmp_path, f"world{k[0]}{k[1]}", 480)
                for k in keys}

    with ThreadPoolExecutor(max_workers=2) as ex:
        futures = [ex.submit(lane, keys) for keys in lanes]
        ran = {k: v for f in futures for k, v in f.result().items()}
    for (world, tag) in order:
        items = groups[(world, tag)]
        codes, logs, results = ran[(world, tag)]
        for rank in range(world):
            res = results[rank] or []
            for n, (i, _) in enumerate(items):
                page, kind, _, _, expected, line = snippets[i]
                where = f"{(DOCS / page).resolve().relative_to(ROOT)}:{line} (rank {rank} of {world})"
                assert n < len(res), f"{where}: did not finish (exit {codes[rank]}):\n{logs[rank][-4000:]}"
                r = res[n]
                if kind == "raises":
                    assert expected, f"{where}: a 'raises' snippet needs the error in a ```text block after it"
                    first = expected.strip().splitlines()[0]
                    assert not r["ok"], f"{where}: the snippet did not raise; the page shows\n  {first}"
                    assert _expected_matches(first, r["error"]), (
                        f"{where}: the page shows\n  {first}\nbut the snippet raised\n  {r['error']}")
                else:
                    assert r["ok"], f"{where}: {r.get('traceback', '')[-4000:]}"
            assert codes[rank] == 0, f"rank {rank} of {world}: exit {codes[rank]}\n{logs[rank][-4000:]}"


def test_snippets_found():
    """The markers are spelled right: each page has runnable snippets."""
    for page in _SNIPPET_PAGES:
        assert _snippets(page), f"docs/{page}: no <!-- doctest: ... --> snippets"
    text = (DOCS / "migration.md").read_text()
    assert text.count("<!-- doctest:") == len(_snippets("migration.md")), "a doctest marker not followed by ```python"


def test_docs_extra_matches_ci_pins():
    """``.ci/docs`` installs exactly the pinned ``docs`` extra of pyproject.toml."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        pytest.skip("tomllib (Python 3.11+) is needed to read pyproject.toml")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("optional-dependencies", {})
    if "docs" not in extras:
        pytest.skip("pyproject.toml has no 'docs' extra yet")
    ci = set(re.findall(r'"([A-Za-z0-9_.\-\[\]]+==[^"]+)"', (ROOT / ".ci" / "docs").read_text()))
    assert ci, ".ci/docs pins nothing"
    assert set(extras["docs"]) == ci, f"pyproject docs extra {sorted(extras['docs'])} != .ci/docs pins {sorted(ci)}"
