"""The training job's view in the Airflow UI: a page for a train task instance (the "Training job" tab of the
task instance, an Airflow 3 external view) showing every rank's position and figures, the ETA, the stragglers,
each node's utilisation, the cost so far and the MLflow run, refreshed every 2 s while the job runs.

Served by the Airflow API server itself (the plugin's FastAPI app under ``/pipeline``, ``plugins/pipeline_plugin.py``):

- ``GET /pipeline/jobs/{dag_id}/{run_id}/{task_id}/{map_index}/``: the page (no external asset; it fetches the
  figures below by a relative path, so it works behind a proxy's prefix too);
- ``GET /pipeline/jobs/{dag_id}/{run_id}/{task_id}/{map_index}/data``: the figures as JSON (``pipeline.job.live``).

Both need what the task instance's page needs: a signed-in user allowed to read the DAG's task instances (the
API server's own check, on the session cookie the UI holds or a bearer token). The figures come from the job
folder (``$PIPELINE_RUNS_DIR``), which the API server must see: the same volume as the workers'.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, FastAPI, HTTPException
from fastapi.responses import HTMLResponse

from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
from airflow.api_fastapi.core_api.security import requires_access_dag

from pipeline.job.live import live
from pipeline.job_files import JobFiles
from pipeline.stages.run import RunInfo

PAGE = Path(__file__).with_name("job_view.html")
ROUTE = "/jobs/{dag_id}/{run_id}/{task_id}/{map_index}/"

app = FastAPI(title="DDP pipeline: training jobs",
              dependencies=[Depends(requires_access_dag(method="GET", access_entity=DagAccessEntity.TASK_INSTANCE))])


def job_files(dag_id: str, run_id: str, task_id: str, map_index: str) -> JobFiles:
    """The job folder of a task instance (``RunInfo.job_dir``), or a 404 naming it when the task ran no job.
    ``map_index``: the mapped instance's index; the UI leaves ``{MAP_INDEX}`` as it is for an unmapped one."""
    index = int(map_index) if map_index.lstrip("-").isdigit() else -1
    folder = RunInfo(dag_id, run_id).job_dir(task_id, index)
    if not folder.is_dir():
        raise HTTPException(404, f"no training job of {dag_id} / {run_id} / {task_id} (map index {index}): "
                                 f"{folder} does not exist (not started yet, or not a training task)")
    return JobFiles(folder)


@app.get(ROUTE, response_class=HTMLResponse)
def page(dag_id: str, run_id: str, task_id: str, map_index: str) -> str:
    return PAGE.read_text()


@app.get(ROUTE + "data")
def data(dag_id: str, run_id: str, task_id: str, map_index: str) -> dict:
    return {"dag_id": dag_id, "run_id": run_id, "task_id": task_id} | live(job_files(dag_id, run_id, task_id, map_index))


# The plugin's parts (plugins/pipeline_plugin.py): the app, and the tab on every task instance's page.
FASTAPI_APP = {"app": app, "url_prefix": "/pipeline", "name": "Training jobs"}
EXTERNAL_VIEW = {"name": "Training job", "href": "pipeline" + ROUTE.format(
    dag_id="{DAG_ID}", run_id="{RUN_ID}", task_id="{TASK_ID}", map_index="{MAP_INDEX}"),
    "destination": "task_instance", "url_route": "training_job"}
