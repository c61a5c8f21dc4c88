"""mkdocs hooks for funcopt's documentation site (see mkdocs.yml).

Two jobs, both keeping ``mkdocs build --strict`` meaningful:

* Missing docstrings are build warnings (so, with ``--strict``, failures).
  mkdocstrings renders an object without a docstring silently; this hook
  loads the package with griffe (statically, as mkdocstrings does) and warns
  for every object a ``::: ident`` directive in the docs renders -- the
  object itself and its public members (classes, functions, methods) --
  that has no docstring.
* Docstrings are written with reST roles (``:class:`X```) and literal-block
  markers (``Example::``); griffe's Google parser passes both through as
  text, so the rendered HTML drops the role prefix and the second colon, and
  turns ``.. warning::`` / ``.. note::`` paragraphs into admonitions.
* Links from a docs page to a file of the repository outside ``docs/``
  (``../examples/train_step_script.py``, which also work when the Markdown is
  read on a code host) are published with the site: the file is copied into
  the site and the link rewritten to it.  A link to a file that does not
  exist, or to a Markdown file outside ``docs/`` (README.md), is left alone,
  so mkdocs still reports it.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Dict, Iterator, List, Set

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.funcopt")

_LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.M)
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|math):(<code>)")
_LITERAL_MARK = re.compile(r"(<p>[^<]*\w)::(</p>)")
_RST_ADMONITION = re.compile(r"<p>\.\. (warning|note)::\s*(.*?)</p>", re.S)
_REPO_DIR = "_repo"  # where out-of-docs files land in the site

# docs page src_uri -> {link as written -> repo-relative target}
_outside: Dict[str, Dict[str, str]] = {}


def _repo_root(config: Any) -> str:
    return os.path.dirname(os.path.abspath(config["config_file_path"]))


def _outside_links(page_uri: str, text: str, docs_dir: str, root: str) -> Dict[str, str]:
    found: Dict[str, str] = {}
    page_dir = os.path.dirname(os.path.join(docs_dir, page_uri))
    for m in _LINK.finditer(text):
        link = m.group(2)
        if "://" in link or link.startswith(("/", "mailto:")):
            continue
        target = os.path.normpath(os.path.join(page_dir, link))
        inside_docs = os.path.commonpath([target, docs_dir]) == docs_dir
        inside_repo = os.path.commonpath([target, root]) == root
        # a Markdown file outside docs/ would become a page whose own links break: not published
        if not inside_docs and inside_repo and os.path.isfile(target) and not target.endswith(".md"):
            found[link] = os.path.relpath(target, root).replace(os.sep, "/")
    return found


def on_files(files: Files, config: Any) -> Files:
    root = _repo_root(config)
    docs_dir = os.path.abspath(config["docs_dir"])
    _outside.clear()
    added: Set[str] = set()
    for f in list(files.documentation_pages()):
        with open(f.abs_src_path, encoding="utf-8") as fh:
            links = _outside_links(f.src_uri, fh.read(), docs_dir, root)
        if not links:
            continue
        _outside[f.src_uri] = links
        for rel in links.values():
            if rel in added:
                continue
            added.add(rel)
            files.append(File.generated(config, f"{_REPO_DIR}/{rel}", abs_src_path=os.path.join(root, rel)))
    return files


_REGISTRY_MARK = "<!-- funcopt:registry-classes -->"


def _registry_directives() -> str:
    """One ``::: funcopt.optimizers.<module>.<Class>`` per registry entry, in
    registry order: the API page lists every algorithm without a docs edit
    per algorithm (the classes are exported by the registry at run time,
    which griffe's static view of ``funcopt`` does not see)."""
    import funcopt.registry as registry

    return "\n\n".join(f"::: {spec.cls.__module__}.{spec.cls.__name__}" for spec in registry.REGISTRY.values())


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    if _REGISTRY_MARK in markdown:
        markdown = markdown.replace(_REGISTRY_MARK, _registry_directives())
    links = _outside.get(page.file.src_uri)
    if not links:
        return markdown
    page_dir = os.path.dirname(page.file.src_uri)

    def sub(m: "re.Match[str]") -> str:
        rel = links.get(m.group(2))
        if rel is None:
            return m.group(0)
        new = os.path.relpath(f"{_REPO_DIR}/{rel}", page_dir or ".").replace(os.sep, "/")
        return m.group(1) + new + m.group(3)

    return _LINK.sub(sub, markdown)


def on_page_content(html: str, page: Any, config: Any, files: Files) -> str:
    html = _LITERAL_MARK.sub(r"\1:\2", _ROLE.sub(r"\1", html))
    return _RST_ADMONITION.sub(
        lambda m: f'<div class="admonition {m.group(1)}"><p class="admonition-title">{m.group(1).title()}</p>'
                  f"<p>{m.group(2)}</p></div>", html)


def _members(obj: Any) -> Iterator[Any]:
    """``obj`` and the public members mkdocstrings renders for it."""
    yield obj
    if not (obj.is_module or obj.is_class):
        return
    for name, member in obj.members.items():
        if name.startswith("_") or member.is_alias or member.is_attribute:
            continue
        if member.is_module:
            continue  # submodules are documented by their own directive
        yield from _members(member)


def on_pre_build(config: Any) -> None:
    import griffe

    root = _repo_root(config)
    docs_dir = os.path.abspath(config["docs_dir"])
    idents: List[str] = []
    for dirpath, _, names in os.walk(docs_dir):
        for n in sorted(names):
            if n.endswith(".md"):
                with open(os.path.join(dirpath, n), encoding="utf-8") as fh:
                    text = fh.read()
                if _REGISTRY_MARK in text:
                    text = text.replace(_REGISTRY_MARK, _registry_directives())
                idents += _DIRECTIVE.findall(text)
    packages: Dict[str, Any] = {}
    seen: Set[str] = set()
    for ident in idents:
        top = ident.split(".")[0]
        if top not in packages:
            packages[top] = griffe.load(top, search_paths=[root], resolve_aliases=True,
                                        resolve_external=False)
        obj = packages[top]
        for part in ident.split(".")[1:]:
            obj = obj.members[part]
        if obj.is_alias:
            obj = obj.final_target
        for o in _members(obj):
            if o.path in seen:
                continue
            seen.add(o.path)
            if o.docstring is None or not o.docstring.value.strip():
                where = f"{o.relative_filepath}:{o.lineno}" if o.lineno else str(o.relative_filepath)
                log.warning(f"{where}: {o.path} has no docstring (rendered by '::: {ident}')")
