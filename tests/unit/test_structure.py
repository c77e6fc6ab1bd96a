"""The package's shape: no import cycles at any level, small modules, Airflow only in pipeline.airflow (and the
dev tooling), nothing a rank runs reaching it, and stages that use only the job interface."""

import ast
from pathlib import Path

from pipeline import settings

PACKAGE = settings.PROJECT_ROOT / "pipeline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(settings.PROJECT_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The pipeline modules ``path`` imports (at module level only, or anywhere)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("pipeline")}


def _cycles(package: Path, *, top_level_only: bool) -> list[list[str]]:
    """Import cycles among the modules under ``package``, each as the modules around it."""
    modules = {_module_name(p): p for p in package.rglob("*.py")}
    graph = {name: {m for m in _imports(path, top_level_only=top_level_only) if m in modules and m != name}
             for name, path in modules.items()}
    cycles, state = [], {}

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    return cycles


def _all_imports(path: Path) -> set[str]:
    """Every module ``path`` imports, pipeline's or not, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_modules_import_each_other_without_cycles_at_any_level():
    # An import inside a function only hides a cycle until that function runs: both count.
    assert _cycles(PACKAGE, top_level_only=True) == []
    assert _cycles(PACKAGE, top_level_only=False) == []


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > 400}
    assert long == {}


def test_only_the_airflow_package_and_dev_tooling_import_airflow():
    importing = {name for name, path in _modules().items()
                 if any(m == "airflow" or m.startswith("airflow.") for m in _all_imports(path))}
    assert {name for name in importing if not name.startswith(("pipeline.airflow", "pipeline.dev"))} == set()


def test_what_runs_in_a_rank_never_reaches_airflow():
    """From the ranks' entrypoints, every pipeline module they can import (inside functions too) stays out of
    pipeline.airflow and pipeline.dev and imports no airflow: the process boundary is the package boundary."""
    modules = _modules()
    seen, todo = set(), ["pipeline.train.__main__", "pipeline.job.function", "pipeline.job.local.guard"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo += [m for m in _imports(modules[name], top_level_only=False) if m in modules]
        todo += [name.rsplit(".", 1)[0]] if "." in name else []  # importing a module runs its package's __init__
    assert "pipeline.train.loop" in seen and "pipeline.job.spec" in seen  # the walk follows what ranks run
    assert {m for m in seen if m.startswith(("pipeline.airflow", "pipeline.dev"))} == set()
    assert {m for m in seen if any(i == "airflow" or i.startswith("airflow.") for i in _all_imports(modules[m]))} == set()


def test_stages_reach_the_job_only_through_its_interface():
    used = {m for m in _imports(PACKAGE / "stages" / "__init__.py", top_level_only=False) if m.startswith("pipeline.job")}
    assert used <= {"pipeline.job.spec", "pipeline.job.spec.JobSpec", "pipeline.job.supervisor",
                    "pipeline.job.supervisor.Job"}
    for module in ("job/supervisor.py", "airflow/operator.py", "airflow/deferred.py", "airflow/trigger.py"):
        # The policy is written once above the places: it never names one (places are looked up by launch.kind).
        places = {m for m in _imports(PACKAGE / module, top_level_only=False)
                  if m.startswith(("pipeline.job.local", "pipeline.job.kubernetes"))}
        assert places == set(), (module, places)
