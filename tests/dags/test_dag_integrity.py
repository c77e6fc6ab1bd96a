"""Every DAG file imports cleanly, and importing it pulls in no heavy library."""

import json
import subprocess
import sys

from pipeline import deployment

DAG_FILES = sorted((deployment.PROJECT_ROOT / "dags").glob("*.py"))
HEAVY = ["torch", "mlflow", "pyarrow", "streaming", "transformers", "pandas", "optuna"]


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


def test_every_recipe_has_its_sweep_dag_of_mapped_trials():
    from airflow.dag_processing.dagbag import DagBag

    from pipeline.recipes import recipe_names

    bag = DagBag(dag_folder=str(deployment.PROJECT_ROOT / "dags" / "sweeps.py"))
    assert bag.import_errors == {} and set(bag.dags) == {f"{recipe}_sweep" for recipe in recipe_names()}
    for recipe in recipe_names():
        dag = bag.dags[f"{recipe}_sweep"]
        assert [t.task_id for t in dag.topological_sort()] == [
            "plan_sweep", "prepare_data", "train", "best_trial", "register_model", "evaluate", "approve", "promote"]
        train = dag.get_task("train")
        assert type(train).__name__ == "MappedOperator" and train.partial_kwargs["max_active_tis_per_dagrun"] == 2
        assert dag.get_task("best_trial").trigger_rule == "all_done"  # runs when every trial ended, failed or not
        assert {"search_space", "n_trials", "pruner", "objective", "enqueue", "epochs"} <= set(dag.params)


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
