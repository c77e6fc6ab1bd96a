"""The docs: the MkDocs site builds with warnings as errors (its configuration and layout pages generated
from the code), the README stays short and its links resolve, and the names the pages mention (paths,
modules, config fields, environment variables, make targets, the demo's output keys, the Kubernetes Role)
are the code's."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import deployment

ROOT = deployment.PROJECT_ROOT
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README_MAX_LINES = 200

CODE_SPAN = re.compile(r"`([^`\n]+)`")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _texts() -> dict[str, str]:
    return {str(path.relative_to(ROOT)): path.read_text() for path in [README, *PAGES]}


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return CODE_SPAN.findall(FENCE.sub("", text))


def test_the_site_builds_strictly_into_a_temporary_folder(tmp_path):
    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    site = tmp_path / "site"
    for page in ("configuration", "layout", "recipes"):
        assert (site / page / "index.html").is_file()
    configuration = (site / "configuration" / "index.html").read_text()
    assert "generated:" not in configuration  # every marker was replaced
    assert "data.input_path" in configuration and "launch.kubernetes.image" in configuration
    layout = (site / "layout" / "index.html").read_text()
    for module in sorted((ROOT / "pipeline").rglob("*.py")):
        if module.name != "__init__.py" and "__pycache__" not in module.parts:
            assert module.relative_to(ROOT).as_posix() in layout


def test_readme_is_short_and_its_relative_links_exist():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    missing = []
    for target in LINK.findall(README.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        if not (ROOT / target.split("#")[0]).exists():
            missing.append(target)
    assert not missing, f"README.md links to files that do not exist: {missing}"


PATH_SPAN = re.compile(r"^(pipeline|dags|plugins|bench|examples|tests|docs|deploy|\.ci)/[\w./-]*$")
PLACEHOLDER = re.compile(r"[A-Z]{3,}|<|\*")


def test_paths_the_pages_name_exist():
    missing = {}
    for name, text in _texts().items():
        for span in _spans(text):
            if PATH_SPAN.match(span) and not PLACEHOLDER.search(span) and not (ROOT / span.rstrip("/")).exists():
                missing.setdefault(name, []).append(span)
    assert not missing, f"paths named in the docs that do not exist: {missing}"


def _module_source(module: str) -> Path | None:
    """The file of a module of this project, found by path (nothing is imported)."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def test_modules_and_names_the_pages_mention_exist():
    code = "\n".join(p.read_text() for p in (ROOT / "pipeline").rglob("*.py"))
    missing = {}
    for page, text in _texts().items():
        for span in _spans(text):
            if not re.fullmatch(r"pipeline(\.\w+)+", span) or f'"{span}"' in code:  # or a name the code uses (a tag)
                continue
            parts = span.split(".")
            for cut in range(len(parts), 0, -1):  # the longest prefix that is a module, then a name in it
                source = _module_source(".".join(parts[:cut]))
                if source is not None:
                    rest = parts[cut:]
                    if rest and not re.search(rf"\b{re.escape(rest[0])}\b", source.read_text()):
                        missing.setdefault(page, []).append(span)
                    break
            else:
                missing.setdefault(page, []).append(span)
    assert not missing, f"modules or names mentioned in the docs that the code lacks: {missing}"


CONFIG_SPAN = re.compile(r"^(data|model|train|launch|registry|evaluate)(\.[a-z_][a-z0-9_]*)+(\.\*)?(=.*)?$")
FILE_SUFFIX = re.compile(r"\.(py|json|jsonl|pt|pt2|npz|parquet|html|png|sh|ya?ml|md|txt|gz)$")


def _config_keys() -> set[str]:
    from pipeline.config import PipelineConfig
    from pipeline.recipes import get_recipe, recipe_names

    keys = set(PipelineConfig().flat())
    for name in recipe_names():
        keys |= set(get_recipe(name).config_class().flat())
    sections = {key.rsplit(".", i)[0] for key in keys for i in range(1, key.count(".") + 1)}
    return keys | sections


def test_config_fields_the_pages_mention_exist():
    keys = _config_keys()
    unknown = {}
    for page, text in _texts().items():
        for span in _spans(text):
            if not CONFIG_SPAN.match(span) or FILE_SUFFIX.search(span.split("=")[0]):
                continue
            key = span.split("=")[0].removesuffix(".*")
            if key not in keys:
                unknown.setdefault(page, []).append(span)
    assert not unknown, f"config fields named in the docs that no config has: {unknown}"


def test_environment_variables_the_pages_mention_are_read_somewhere():
    sources = [*ROOT.joinpath("pipeline").rglob("*.py"), *ROOT.joinpath("dags").rglob("*.py"),
               *ROOT.joinpath("plugins").rglob("*.py"), *ROOT.joinpath("tests").rglob("*.py"),
               *ROOT.joinpath("bench").rglob("*"), *ROOT.joinpath("examples").rglob("*.py"),
               ROOT / "Makefile", ROOT / "docker-compose.yml", ROOT / "Dockerfile", ROOT / ".ci" / "run"]
    code = "\n".join(p.read_text(errors="replace") for p in sources if p.is_file() and p != Path(__file__))
    unknown = {}
    for page, text in _texts().items():
        for name in sorted(set(re.findall(r"\bPIPELINE_[A-Z0-9_]*[A-Z0-9]\b", text))):
            if name not in code:
                unknown.setdefault(page, []).append(name)
    assert not unknown, f"environment variables named in the docs that no code reads: {unknown}"


def test_make_targets_the_pages_mention_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, re.M))
    unknown = {}
    for page, text in _texts().items():
        for target in re.findall(r"\bmake ([a-z][\w-]*)", text):
            if target not in targets:
                unknown.setdefault(page, []).append(target)
    assert not unknown, f"make targets named in the docs that the Makefile lacks: {unknown}; it has {sorted(targets)}"


def _demo_output_keys() -> set[str]:
    """The keys of the JSON object ``make demo`` prints last (``pipeline/dev/demo.py``)."""
    tree = ast.parse((ROOT / "pipeline" / "dev" / "demo.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "dag_run_id" for k in node.keys):
            keys = {k.value for k in node.keys if isinstance(k, ast.Constant)}
            for key, value in zip(node.keys, node.values):
                if key is None:  # **{...} if ... else {}
                    keys |= {k.value for d in ast.walk(value) if isinstance(d, ast.Dict)
                             for k in d.keys if isinstance(k, ast.Constant)}
            return keys
    raise AssertionError("pipeline/dev/demo.py no longer prints a JSON object with dag_run_id")


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_demo_output_keys_are_described(page):
    text = (ROOT / page).read_text()
    described = set(re.findall(r"^\s*\| `(\w+)` \|", text, re.M))
    assert _demo_output_keys() <= described, f"{page} misses {sorted(_demo_output_keys() - described)}"


def test_the_kubernetes_role_is_the_one_the_lifecycle_tests_allow():
    """The Role on the Kubernetes page grants exactly the verbs the lifecycle tests allow (``ROLE`` in
    tests/kube_launch.py, shared by tests/unit/test_kube_launcher.py and test_kube_deferred.py)."""
    tree = ast.parse((ROOT / "tests" / "kube_launch.py").read_text())
    allowed = next(ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "ROLE" for t in node.targets))
    page = (DOCS / "launching" / "kubernetes.md").read_text()
    granted = set()
    for resources, verbs in re.findall(r'resources: \[([^\]]*)\]\s*\n\s*verbs: \[([^\]]*)\]', page):
        for resource in re.findall(r'"([^"]+)"', resources):
            granted |= {(verb, resource) for verb in re.findall(r'"([^"]+)"', verbs)}
    assert granted == set(allowed)


def test_the_layout_page_fails_the_strict_build_for_a_module_without_a_docstring(tmp_path, caplog, monkeypatch):
    import importlib.util
    import logging

    spec = importlib.util.spec_from_file_location("docs_layout_hook", DOCS / "hooks" / "layout.py")
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    (tmp_path / "pipeline" / "sub").mkdir(parents=True)
    (tmp_path / "pipeline" / "__init__.py").write_text('"""The package."""\n')
    (tmp_path / "pipeline" / "sub" / "__init__.py").write_text('"""A sub-package.\n\nMore."""\n')
    (tmp_path / "pipeline" / "sub" / "told.py").write_text('"""Says what it is: a <thing> | another."""\n')
    (tmp_path / "pipeline" / "sub" / "silent.py").write_text("x = 1\n")
    monkeypatch.setattr(layout, "ROOT", tmp_path)
    with caplog.at_level(logging.WARNING, logger="mkdocs.hooks.layout"):
        table = layout.render()
    assert "| `pipeline/sub/` | A sub-package. |" in table
    assert "| `pipeline/sub/told.py` | Says what it is: a &lt;thing&gt; \\| another. |" in table
    assert [r.getMessage() for r in caplog.records] == [
        "pipeline/sub/silent.py has no docstring: the layout page shows the first paragraph of each module's"]
