"""Every DAG file imports cleanly, and importing it pulls in no heavy library."""

import json
import subprocess
import sys

from pipeline import deployment

DAG_FILES = sorted((deployment.PROJECT_ROOT / "dags").glob("*.py"))
HEAVY = ["torch", "mlflow", "pyarrow", "streaming", "transformers", "pandas"]


def test_every_recipe_has_its_dag_file():
    from pipeline.recipes import recipe_names

    names = {p.name for p in DAG_FILES}
    assert {"tabular_daily_prep.py", "torchrun_example.py"} <= names
    assert {f"{recipe}.py" for recipe in recipe_names()} <= names


def test_dag_bag_has_no_import_errors():
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags"))
    assert bag.import_errors == {}
    from pipeline.recipes import recipe_names

    for recipe in recipe_names():  # one factory, the same stages
        dag = bag.dags[recipe]
        assert [t.task_id for t in dag.topological_sort()] == [
            "prepare_data", "train", "register_model", "evaluate", "approve", "promote"]


def test_importing_dag_files_imports_no_heavy_library():
    # A fresh interpreter: this test process has long imported torch for other tests.
    code = (
        "import importlib.util, json, sys\n"
        f"for path in {[str(p) for p in DAG_FILES]!r}:\n"
        "    spec = importlib.util.spec_from_file_location('dagfile', path)\n"
        "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=deployment.PROJECT_ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_params_form_has_types_bounds_and_descriptions():
    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags" / "tabular_mlp.py")).dags["tabular_mlp"]
    schema = {name: param.schema for name, param in dag.params.items()}
    assert set(schema) >= {"variant", "input_path", "label_column", "model_name", "nproc_per_node", "epochs",
                           "batch_size", "learning_rate", "hidden_sizes", "seed"}
    assert schema["nproc_per_node"]["minimum"] == 1 and schema["nproc_per_node"]["type"] == "integer"
    assert all(param.description for param in dag.params.values())
