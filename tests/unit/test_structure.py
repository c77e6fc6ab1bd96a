"""The package's shape: a declared layer order that no import runs up (at module level or inside a function), no
import cycles, small modules, Airflow only in pipeline.airflow (and the dev tooling), nothing a rank runs reaching
it, stages that use only the job interface, and package docstrings that name only modules that exist."""

import ast
import re
from pathlib import Path

from pipeline import deployment

PACKAGE = deployment.PROJECT_ROOT / "pipeline"


def _module_name(path: Path) -> str:
    parts = path.relative_to(deployment.PROJECT_ROOT).with_suffix("").parts
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


# The layers, from the ground up: a module imports only from its own unit (a package of pipeline/, or a top-level
# module) and from units on lower layers. Nothing on a layer knows what stands above it.
LAYERS = [
    ["pipeline.errors"],
    ["pipeline.node_usage", "pipeline.storage", "pipeline.diskspace"],  # a node's utilisation; files on a folder or an
    # object store; writes that fail for want of space
    ["pipeline.deployment", "pipeline.process_table", "pipeline.fast_exit", "pipeline.network", "pipeline.stopwatch",
     "pipeline.config_fields", "pipeline.results", "pipeline.job_files",  # job folder contract
     "pipeline.private_apis"],  # other libraries' private calls
    ["pipeline.launch_config"],  # where a run trains: the config's launch section
    ["pipeline.config", "pipeline.toolchains"],
    ["pipeline.data", "pipeline.registry", "pipeline.evaluate", "pipeline.sweep"],
    ["pipeline.train"],  # what runs in a rank, below any recipe
    ["pipeline.recipes", "pipeline.job"],  # workloads; running a job anywhere (knows no recipe, no Airflow)
    ["pipeline.rank", "pipeline.stages"],  # a recipe's rank entrypoint; the stages the DAG tasks call
    ["pipeline.airflow"],
    ["pipeline.dev"],
]


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its package under pipeline/, or itself for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def test_every_unit_has_a_layer():
    layered = {unit for layer in LAYERS for unit in layer}
    assert {_unit(name) for name in _modules()} - {"pipeline"} == layered


def test_no_import_runs_up_the_layers():
    """At module level or inside a function: an import that only runs later still ties the modules together."""
    level = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    modules = _modules()
    upward = []
    for name, path in modules.items():
        here = _unit(name)
        for imported in _imports(path, top_level_only=False):
            target = imported if imported in modules else imported.rsplit(".", 1)[0]
            there = _unit(target)
            if target not in modules or there in (here, "pipeline") or here == "pipeline":
                continue
            if level[there] >= level[here]:
                upward.append(f"{name} -> {imported} ({here} on layer {level[here]}, {there} on {level[there]})")
    assert upward == []


def test_package_docstrings_name_only_modules_that_exist():
    """A package's docstring names its modules (``name`` in double backquotes); each must exist under it."""
    import re

    missing = []
    for init in PACKAGE.rglob("__init__.py"):
        package = _module_name(init)
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for named in re.findall(r"``([a-z_][a-z0-9_.]*)``", doc):
            dotted = named if named.startswith("pipeline.") else f"{package}.{named}"
            parts = dotted.split(".")
            if not any((deployment.PROJECT_ROOT.joinpath(*parts[:i]).with_suffix(".py").is_file()
                        or deployment.PROJECT_ROOT.joinpath(*parts[:i]).is_dir()) for i in range(len(parts), 1, -1)):
                missing.append(f"{package}: {named}")
    assert missing == []


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
    seen, todo = set(), ["pipeline.rank", "pipeline.train.function", "pipeline.job.local.process_group",
                         "pipeline.job.ray.entry", "pipeline.toolchains.rank"]
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        todo += [m for m in _imports(modules[name], top_level_only=False) if m in modules]
        todo += [name.rsplit(".", 1)[0]] if "." in name else []  # importing a module runs its package's __init__
    assert {"pipeline.train.loop", "pipeline.job_files", "pipeline.job.ray.worker"} <= seen  # it follows what ranks run
    assert {m for m in seen if m.startswith(("pipeline.airflow", "pipeline.dev"))} == set()
    assert {m for m in seen if any(i == "airflow" or i.startswith("airflow.") for i in _all_imports(modules[m]))} == set()


def test_stages_reach_the_job_only_through_its_interface():
    used = {m for path in (PACKAGE / "stages").rglob("*.py") for m in _imports(path, top_level_only=False)
            if m.startswith("pipeline.job")}
    assert used <= {"pipeline.job.spec", "pipeline.job.spec.JobSpec", "pipeline.job.supervisor",
                    "pipeline.job.supervisor.Job", "pipeline.job.supervisor.run_figures",
                    "pipeline.job.supervisor.run_tags", "pipeline.job_files", "pipeline.job_files.JobFiles"}
    for module in ("job/supervisor.py", "job/policy.py", "job/places.py", "airflow/operator.py", "airflow/deferred.py",
                   "airflow/trigger.py"):
        # The policy is written once above the places: it never names one (places are looked up by launch.kind).
        places = {m for m in _imports(PACKAGE / module, top_level_only=False)
                  if m.startswith(("pipeline.job.local", "pipeline.job.kubernetes", "pipeline.job.ray"))}
        assert places == set(), (module, places)


def test_the_restart_rules_are_written_once():
    """Whether a user error or a preemption ends or restarts an attempt is decided in pipeline.job.policy alone:
    no other module reads the ranks' reported errors or the preemption marker to decide."""
    readers = {name for name, path in _modules().items()
               if re.search(r"\b(reported_user_error|read_preemption)\(", path.read_text())}
    assert readers == {"pipeline.job.policy", "pipeline.job_files"}
