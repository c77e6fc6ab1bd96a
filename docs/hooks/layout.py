"""MkDocs hook: the layout page, generated from the tree at build time.

``<!-- generated: layout -->`` on a page becomes one table per top-level folder (``pipeline/``, ``dags/``,
``plugins/``, ``examples/``, ``toolchains/``, ``bench/``, ``tests/``): every package, module and script in it, with the
first paragraph of its docstring (or of a script's leading comment), read with ``ast`` and never
imported. A package or module under the documented folders without a docstring is a warning, which
``mkdocs build --strict`` turns into a failure: the page cannot silently lose a module.

On the same page, every path in a table row of the form ``| `path` | ... |`` written by hand (the
top-level files) must exist, or the build warns.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.layout")

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- generated: layout -->"
# Folders whose every module must say what it is (a warning otherwise); tests/ is listed as it is.
DOCUMENTED = ("pipeline", "dags", "plugins", "examples", "toolchains", "bench")
FOLDERS = (*DOCUMENTED, "tests")
SKIP_DIRS = {"__pycache__"}
HAND_WRITTEN_ROW = re.compile(r"^\| `([^`]+)` \|", re.M)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if MARKER not in markdown:
        return markdown
    for path in HAND_WRITTEN_ROW.findall(markdown):
        if not (ROOT / path.rstrip("/")).exists():
            log.warning("%s names %s, which does not exist", page.file.src_uri, path)
    return markdown.replace(MARKER, render())


def render() -> str:
    return "\n".join(render_folder(folder) for folder in FOLDERS if (ROOT / folder).is_dir())


def render_folder(folder: str) -> str:
    rows = ["| path | what |", "| --- | --- |"]
    top = ROOT / folder
    paths = ([top] if (top / "__init__.py").exists() else []) + entries(top)
    for path in paths:
        rel = path.relative_to(ROOT).as_posix()
        summary = describe(path)
        if summary is None:
            summary = ""
            if folder in DOCUMENTED and (path.is_file() or (path / "__init__.py").exists()):
                log.warning("%s has no docstring: the layout page shows the first paragraph of each module's", rel)
        rows.append(f"| `{rel}{'/' if path.is_dir() else ''}` | {cell(summary)} |")
    return f"## `{folder}/`\n\n" + "\n".join(rows) + "\n"


def entries(folder: Path) -> list[Path]:
    """Sub-folders (then their contents) and files of ``folder``, in path order, packages before modules."""
    found = []
    for path in sorted(folder.iterdir(), key=lambda p: (p.is_dir(), p.name)):
        if path.name.startswith(".") or path.name in SKIP_DIRS:
            continue
        if path.is_dir():
            if any(path.rglob("*.py")) or any(path.glob("*.sh")):
                found.append(path)
                found += entries(path)
        elif path.suffix in (".py", ".sh") and path.name != "__init__.py":
            found.append(path)
    return found


def describe(path: Path) -> str | None:
    """The first paragraph of a module's (or a package's ``__init__``) docstring, or of a script's
    leading comment; None when there is none."""
    if path.is_dir():
        path = path / "__init__.py"
        if not path.exists():
            return ""  # a plain folder (tests/unit/): its files say what they are
    if path.suffix == ".sh":
        lines = []
        for line in path.read_text(errors="replace").splitlines()[1:]:
            if not line.startswith("#") or (lines and line.strip() == "#"):
                break
            lines.append(line.lstrip("#").strip())
        return first_paragraph("\n".join(lines)) or None
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(errors="replace")))
    except SyntaxError as exc:
        log.warning("%s does not parse (%s)", path.relative_to(ROOT), exc)
        return None
    return first_paragraph(doc) if doc else None


def first_paragraph(text: str) -> str:
    return " ".join(text.strip().split("\n\n")[0].split())


def cell(text: str) -> str:
    text = text.replace("``", "`").replace("|", "\\|")
    # Outside code spans, <...> would be raw HTML.
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)
