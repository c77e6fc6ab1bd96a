"""The package's shape: no import cycles between its modules, and stages that use only the launcher interface."""

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


def test_modules_import_each_other_without_cycles():
    assert _cycles(PACKAGE, top_level_only=True) == []


def test_data_modules_import_each_other_without_cycles_inside_functions_too():
    # An import inside a function only hides a cycle until that function runs; in pipeline/data the
    # shared types sit in types.py so that no such import is needed. (pipeline.launch's package
    # __init__ still imports its operator lazily, which imports the package: not yet checked here.)
    assert _cycles(PACKAGE / "data", top_level_only=False) == []


def test_stages_reach_the_launcher_only_through_its_interface():
    used = {m for m in _imports(PACKAGE / "stages.py", top_level_only=False) if m.startswith("pipeline.launch")}
    assert used <= {"pipeline.launch.spec", "pipeline.launch.spec.JobSpec", "pipeline.launch.supervisor",
                    "pipeline.launch.supervisor.Job"}
    for module in ("operator.py", "supervisor.py", "deferred.py", "trigger.py"):
        # The policy is written once above the places: it never names one (places are looked up by launch.kind).
        places = {m for m in _imports(PACKAGE / "launch" / module, top_level_only=False)
                  if m.startswith(("pipeline.launch.local", "pipeline.launch.kube"))}
        assert places == set(), (module, places)
