"""The "Training job" view of the Airflow UI (``pipeline.airflow.job_view``), served by a real ``airflow api-server``
with the project's plugin and opened in headless Chromium while a real 3-rank job runs, one of its ranks made
slow (``tests/slow_rank.py``): every rank's row, its step moving, the slow rank named, the node's utilisation;
and the job as it ended once it has. Screenshots stay in $PIPELINE_TEST_ARTIFACTS/job-view/."""

from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import pytest

from pipeline import deployment, stages
from pipeline.recipes import tabular_mlp
from pipeline.stages.run import RunInfo
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed

ARTIFACTS = Path(os.environ.get("PIPELINE_TEST_ARTIFACTS", deployment.PROJECT_ROOT / "var" / "test-artifacts")) / "job-view"
DAG, RUN = "job_view_check", "manual__2026-12-06T10:00:00+00:00"
ROWS = "return [...document.querySelectorAll('#ranks tbody tr')].map(tr => [tr.className, ...[...tr.cells].map(td => td.textContent)])"


def _text(driver, element_id: str) -> str:
    return driver.execute_script(f"return document.getElementById('{element_id}').textContent")


def test_the_job_view_shows_a_running_job_live_and_names_its_straggler(airflow_db, demo_parquet, tmp_path):
    from tests.browser import Browser
    from tests.services import AirflowApiServer

    cfg = tabular_mlp.config("tiny").with_overrides({
        "data.input_path": str(demo_parquet), "train.epochs": 4, "train.batch_size": 8, "train.log_every_steps": 5})
    dataset = stages.prepare_data(cfg, stages.RunInfo(DAG, "data"))
    job_dir = RunInfo(DAG, RUN).job_dir("train")
    job_dir.mkdir(parents=True)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    api = AirflowApiServer(tmp_path)
    api.start()
    browser = None
    job = threading.Thread(target=run_torchrun, daemon=True, args=(
        ["-m", "tests.slow_rank", "--recipe", "tabular_mlp", "--config", str(tmp_path / "config.json"),
         "--dataset", dataset.uri, "--out", str(job_dir)],), kwargs={
        "job_dir": job_dir, "nproc_per_node": 3, "env": {"SLOW_RANK": "1", "SLOW_RANK_MS": "40"}})
    try:
        # The plugin gives every task instance's page the tab, and the API server serves the view.
        plugins = api.request("GET", "/api/v2/plugins")["plugins"]
        views = [view for plugin in plugins for view in plugin["external_views"]]
        assert {"name": "Training job", "destination": "task_instance",
                "href": "pipeline/jobs/{DAG_ID}/{RUN_ID}/{TASK_ID}/{MAP_INDEX}/"}.items() <= views[0].items()
        page = f"{api.url}/pipeline/jobs/{DAG}/{quote(RUN, safe='')}/train/-1/"
        # The API server's own check guards it (this server lets everyone in as an admin, but a credential that is
        # presented is still verified): a forged token is refused.
        forged = urllib.request.Request(page + "data", headers={"Authorization": "Bearer forged"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(forged, timeout=30)
        assert refused.value.code in (401, 403)

        job.start()
        browser = Browser(ARTIFACTS)
        driver = browser.driver
        driver.get(f"{api.url}/api/v2/monitor/health")  # the origin, to hold the session cookie the UI would
        driver.add_cookie({"name": "_token", "value": api._token(), "path": "/"})
        driver.get(page)
        rows = browser.wait(lambda: (found := driver.execute_script(ROWS)) and len(found) == 3
                            and all(row[4] not in ("", "0") for row in found) and found, "a row per running rank", 120)
        assert _text(driver, "state") == "running"
        first_step = int(rows[0][4].split(" / ")[0])
        browser.wait(lambda: int(driver.execute_script(ROWS)[0][4].split(" / ")[0]) > first_step,
                     "rank 0's step moving on the page", 60)
        named = browser.wait(lambda: _text(driver, "stragglers").startswith("rank 1 (") and _text(driver, "stragglers"),
                             "the slow rank named", 120)
        rows = driver.execute_script(ROWS)
        assert [row[0] for row in rows] == ["", "straggler", ""], rows
        assert float(rows[1][12]) > 1.3 > max(float(rows[0][12]), float(rows[2][12]))  # the straggler scores
        nodes = driver.execute_script("return [...document.querySelectorAll('#nodes tbody tr')].length")
        assert nodes == 1
        assert _text(driver, "eta") not in ("", "unknown")
        print(f"screenshot: {browser.shot('running')}; stragglers {named}")

        job.join(timeout=300)
        assert not job.is_alive()
        # The supervisor records the attempt's cost once its ranks are gone, just after rank 0's result.
        browser.wait(lambda: _text(driver, "state") == "finished" and _text(driver, "cost").endswith("1 attempt(s))"),
                     "the job as it ended, with its cost", 60)
        browser.shot("finished")
        assert _text(driver, "error") == ""
    finally:
        if browser is not None:
            browser.close()
        api.stop()


def test_a_task_that_ran_no_job_is_a_404_naming_it(airflow_db, tmp_path):
    from tests.services import AirflowApiServer

    api = AirflowApiServer(tmp_path)
    api.start()
    try:
        with pytest.raises(urllib.error.HTTPError) as missing:
            api.request("GET", "/pipeline/jobs/no_such_dag/some_run/train/-1/data")
        assert missing.value.code == 404
        assert "no training job of no_such_dag / some_run / train" in missing.value.read().decode()
    finally:
        api.stop()
