"""The services stack (``make stack``: Airflow with the Celery executor on PostgreSQL and Redis, an MLflow
server on PostgreSQL serving artifacts) driven through its REST API as a user or a script would.

One stack serves the module (starting one takes about a minute on 2 cores); the last test stops it
with ``make stack-down``'s code and checks that nothing of it runs or listens any more.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from datetime import datetime, timedelta, timezone

import psutil
import pytest

from pipeline.dev.s3_server import S3Server
from pipeline.dev.stack.local import S3_BUCKET
from tests.e2e.test_airflow_kill import (
    KILL_DAG_SOURCE,
    job_marker,
    still_alive,
    trigger_and_wait_for_ranks,
)
from tests.selfcontained import predict_in_fresh_interpreter
from tests.services import free_port, wait_for
from tests.stack import (MLFLOW_PASSWORD, POOL_DAG_SOURCE, api_token, backfill_done, dag_ids, live_client, make_stack,
                         remove_stack, unpause, wait_run, xcom)

pytestmark = pytest.mark.e2e

TINY = {"epochs": 2, "batch_size": 64, "hidden_sizes": [16], "nproc_per_node": 1,
        "overrides": {"data.shard_size_limit_bytes": 16384, "train.log_every_steps": 10}}
TODAY = datetime.now(timezone.utc).date()
DAYS = [str(TODAY - timedelta(days=n)) for n in (3, 2, 1)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, pipeline_home):
    from pipeline import deployment
    from pipeline.data import demo
    from pipeline.recipes import tabular_mlp

    tmp = tmp_path_factory.mktemp("stack")
    dags = tmp / "dags"
    dags.mkdir()
    for name in ("tabular_daily_prep.py", "tabular_mlp.py"):
        (dags / name).symlink_to(deployment.PROJECT_ROOT / "dags" / name)
    (dags / "gpu_pool_probe.py").write_text(POOL_DAG_SOURCE)
    (dags / "torchrun_kill.py").write_text(KILL_DAG_SOURCE)
    demo.write_parquet(tmp / "inputs" / "demo.parquet", 3_000, seed=3)
    # Its own data folder: daily versions that other tests of the session publish (tests/dags: fixed dates, newer
    # than these days when the tests run before 2026-11-29) would otherwise enter its asset-triggered windows.
    data_dir = tmp / "data"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIPELINE_DATA_DIR", str(data_dir))
        demo.write_partitions(tabular_mlp.daily_input_path(), DAYS, 400, seed=21)
    stack = make_stack(tmp / "home", dags, {
        # The versions in a folder of its own; MLflow's artifacts on the stack's S3 server (make stack S3=1).
        "PIPELINE_DATA_DIR": str(data_dir),
        # The daily DAG starts after tomorrow: its scheduler makes no run while the module runs, even across a
        # midnight (TODAY is the date at import), so a backfill's runs are the DAG's only ones. (Airflow 3.3's
        # scheduler dies on a unique-key violation when its catch-up creates a run for a day a backfill holds.)
        "PIPELINE_DAILY_START_DATE": str(TODAY + timedelta(days=2)),
        "PIPELINE_RETRY_DELAY_S": "1",
        "PIPELINE_TRAIN_POOL_SLOTS": "1",  # one slot a training: the pool of 1 admits one at a time
        "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_SEC": "1",
    })
    stack.s3, stack.s3_port = True, free_port()
    try:
        stack.up()
        stack.client = live_client(stack, stack.client)
        client = stack.client()
        wait_for(lambda: dag_ids(client) >= {"tabular_mlp", "tabular_daily_prep", "gpu_pool_probe", "torchrun_kill"},
                 "the dag-processor to parse the stack's DAGs", timeout_s=180, poll_s=1)
        stack.demo_parquet = tmp / "inputs" / "demo.parquet"
        stack.probe_path = pipeline_home / "gpu_pool_probe.jsonl"  # deployment.home() of the tasks
        yield stack
    finally:
        remove_stack(stack)


def test_api_needs_a_token_and_every_process_listens_on_loopback_only(stack):
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{stack.airflow_url}/api/v2/dags", timeout=30)
    assert refused.value.code == 401
    # A token signed with this stack's secret is accepted; one signed with the old fixed secret is not.
    def get_dags(secret):
        req = urllib.request.Request(f"{stack.airflow_url}/api/v2/dags", headers={"Authorization": "Bearer " + api_token(secret)})
        try:
            with urllib.request.urlopen(req, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert get_dags(stack.secrets()["AIRFLOW_JWT_SECRET"]) == 200
    assert get_dags("embedded-default-not-for-production-" + "0" * 40) in (401, 403)

    state = stack.state()
    pids = {pid for root in state["pids"].values() for pid in [root, *[c.pid for c in psutil.Process(root).children(recursive=True)]]}
    listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.pid in pids]
    assert {port for _, port, _ in listening} >= {stack.airflow_port, stack.mlflow_port}
    assert all(ip == "127.0.0.1" for ip, _, _ in listening), listening


def test_rest_trigger_with_conf_runs_to_success_and_registers_on_the_mlflow_server(stack, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    client = stack.client()
    unpause(client, "tabular_mlp")
    model = "stack_rest_model"
    conf = {"input_path": str(stack.demo_parquet), **TINY, "model_name": model,
            "overrides": {**TINY["overrides"], "registry.experiment": model}}
    run = client.request("POST", "/api/v2/dags/tabular_mlp/dagRuns", {"logical_date": None, "conf": conf})
    assert run["conf"]["model_name"] == model
    assert wait_run(client, "tabular_mlp", run["dag_run_id"]) == "success"

    tis = {ti["task_id"]: ti for ti in client.request(
        "GET", f"/api/v2/dags/tabular_mlp/dagRuns/{run['dag_run_id']}/taskInstances")["task_instances"]}
    assert (tis["train"]["queue"], tis["train"]["pool"]) == ("gpu", "gpu")
    assert (tis["prepare_data"]["queue"], tis["prepare_data"]["pool"]) == ("default", "default_pool")
    summary = xcom(client, "tabular_mlp", run["dag_run_id"], "promote")
    assert summary["model"]["name"] == model and summary["promoted"]

    # The version is on the server, and its artifacts come back through the server.
    mlflow_client = MlflowClient(tracking_uri=stack.mlflow_url, registry_uri=stack.mlflow_url)
    version = mlflow_client.get_model_version(model, summary["model"]["version"])
    assert version.run_id == xcom(client, "tabular_mlp", run["dag_run_id"], "train")["mlflow_run_id"]
    assert mlflow_client.get_registered_model(model).aliases.get("champion") == version.version
    run_info = mlflow_client.get_run(version.run_id).info
    assert run_info.artifact_uri.startswith("mlflow-artifacts:")  # proxied by the server, not a local path
    mlflow.set_tracking_uri(stack.mlflow_url)
    try:
        local = mlflow.artifacts.download_artifacts(artifact_uri=f"runs:/{version.run_id}/evaluation/report.html",
                                                    tracking_uri=stack.mlflow_url)
    finally:
        mlflow.set_tracking_uri(None)
    assert "<html" in open(local).read().lower()

    # The server keeps them on the bucket, and nothing in a folder of its own.
    import boto3

    access_key, secret_key = stack.s3_keys()
    bucket = boto3.client("s3", endpoint_url=stack.s3_url, region_name=S3Server.REGION,
                          aws_access_key_id=access_key, aws_secret_access_key=secret_key)
    keys = [o["Key"] for page in bucket.get_paginator("list_objects_v2").paginate(Bucket=S3_BUCKET, Prefix="mlflow/")
            for o in page.get("Contents", [])]
    assert any(k.endswith(f"{version.run_id}/artifacts/evaluation/report.html") for k in keys), keys
    assert any(k.endswith("/MLmodel") for k in keys), keys
    assert not (stack.home / "mlflow-artifacts").exists()

    # The registered model loads from there, through the server, where this project cannot be imported and no
    # store credentials are set.
    import pyarrow.parquet as pq

    rows = pq.read_table(stack.demo_parquet).slice(0, 8).to_pandas().drop(columns=["label"])
    predictions = predict_in_fresh_interpreter(f"models:/{model}@champion", rows, tmp_path,
                                               env={"MLFLOW_TRACKING_URI": stack.mlflow_url})
    assert len(predictions) == 8 and set(predictions) <= {"0", "1", "2"}, predictions

    # Task logs: MLflow's own lines at their level, never the connections' passwords.
    logs = list((stack.airflow_home / "logs").rglob(f"run_id={run['dag_run_id']}/**/*.log"))
    assert {p.parent.name for p in logs} >= {"task_id=train", "task_id=register_model"}
    for path in logs:
        for line in path.read_text().splitlines():
            assert MLFLOW_PASSWORD not in line and secret_key not in line, path
            record = json.loads(line)
            if record.get("logger") == "task.stderr":
                assert " INFO mlflow" not in record["event"] and "Downloading artifacts" not in record["event"], line


def test_backfill_of_three_days_prepares_three_versions_and_trains_on_the_newest(stack):
    client = stack.client()
    unpause(client, "tabular_mlp")
    unpause(client, "tabular_daily_prep")
    body = {"dag_id": "tabular_daily_prep", "from_date": f"{DAYS[0]}T00:00:00Z", "to_date": f"{DAYS[-1]}T00:00:00Z",
            "max_active_runs": 3, "reprocess_behavior": "none", "run_backwards": False, "dag_run_conf": {}}
    backfill = client.request("POST", "/api/v2/backfills", body)

    def prep_runs():
        runs = client.request("GET", "/api/v2/dags/tabular_daily_prep/dagRuns?limit=50")["dag_runs"]
        done = [r for r in runs if r["state"] in ("success", "failed")]
        return sorted(done, key=lambda r: r["logical_date"]) if len(done) >= 3 and len(done) == len(runs) else None

    runs = wait_for(prep_runs, "the backfill's 3 runs to finish", timeout_s=300, poll_s=1)
    assert [r["state"] for r in runs] == ["success"] * 3, runs
    assert all(r["run_type"] == "backfill" for r in runs)
    versions = [xcom(client, "tabular_daily_prep", r["dag_run_id"], "prepare_data") for r in runs]
    assert [v["interval"]["start"][:10] for v in versions] == DAYS
    assert len({v["version"] for v in versions}) == 3 and not any(v["skipped"] for v in versions)
    events = client.request("GET", "/api/v2/assets/events?limit=50&source_dag_id=tabular_daily_prep")["asset_events"]
    assert sorted(e["extra"]["version"] for e in events) == sorted(v["version"] for v in versions)

    # The runs these events trigger end with one that trained on the window ending at the newest day.
    def trained_on_newest():
        mlp = client.request("GET", "/api/v2/dags/tabular_mlp/dagRuns?limit=50&run_type=asset_triggered")["dag_runs"]
        assert not [r for r in mlp if r["state"] == "failed"], mlp
        for r in mlp:
            if r["state"] == "success":
                prepared = xcom(client, "tabular_mlp", r["dag_run_id"], "prepare_data")
                if prepared["versions"][-1] == versions[-1]["version"]:
                    return prepared
        return None

    prepared = wait_for(trained_on_newest, "an asset-triggered tabular_mlp run on the newest day", timeout_s=420, poll_s=2)
    assert prepared["interval"]["end"][:10] == str(TODAY)

    # The same backfill again (every day reprocessed): each day's input is unchanged, nothing is prepared. Airflow
    # refuses a backfill (409) while another of the DAG is active: the scheduler marks the first one completed on
    # one of its loops after its runs have ended.
    wait_for(lambda: backfill_done(client, backfill["id"]), "the first backfill to be completed", timeout_s=120,
             poll_s=1)
    again = client.request("POST", "/api/v2/backfills", {**body, "reprocess_behavior": "completed"})
    assert again["id"] != backfill["id"]

    wait_for(lambda: backfill_done(client, again["id"]), "the repeated backfill to finish", timeout_s=300, poll_s=1)
    for day_run in client.request("GET", "/api/v2/dags/tabular_daily_prep/dagRuns?limit=50")["dag_runs"]:
        assert day_run["state"] == "success", day_run
        result = xcom(client, "tabular_daily_prep", day_run["dag_run_id"], "prepare_data")
        assert result["skipped"] and result["version"] in {v["version"] for v in versions}


def test_gpu_pool_of_one_slot_runs_one_training_at_a_time_while_other_tasks_overlap(stack):
    client = stack.client()
    assert client.request("GET", "/api/v2/pools/gpu")["slots"] == 1
    unpause(client, "gpu_pool_probe")
    runs = [client.request("POST", "/api/v2/dags/gpu_pool_probe/dagRuns", {"logical_date": None})["dag_run_id"]
            for _ in range(2)]

    def marks(task: str, event: str) -> dict[str, dict]:
        lines = stack.probe_path.read_text().splitlines() if stack.probe_path.exists() else []
        return {m["run"]: m for m in map(json.loads, lines) if m["run"] in runs and (m["task"], m["event"]) == (task, event)}

    def train_state(run_id: str) -> str | None:
        return client.request("GET", f"/api/v2/dags/gpu_pool_probe/dagRuns/{run_id}/taskInstances/train")["state"]

    def release(run_id: str) -> None:
        (stack.probe_path.parent / f"gpu_pool_probe-release-{run_id}").touch()  # deployment.home() of the tasks

    # One training holds the slot until released; the other run's training, ready once its preparation is done,
    # waits for the slot in the scheduler (scheduled, not queued).
    started = wait_for(lambda: list(marks("train", "start")), "a training to start", timeout_s=240)
    assert len(started) == 1, started
    first, (second,) = started[0], set(runs) - set(started)
    wait_for(lambda: train_state(second) not in (None, "none"), "the second training to be ready", timeout_s=240)
    assert train_state(second) == "scheduled" and list(marks("train", "start")) == [first]
    release(first)
    wait_for(lambda: second in marks("train", "start"), "the second training to start", timeout_s=240)
    release(second)
    for run_id in runs:
        assert wait_run(client, "gpu_pool_probe", run_id, timeout_s=240) == "success"

    assert marks("train", "end")[first]["time"] <= marks("train", "start")[second]["time"]  # never two at once
    starts, ends = marks("prepare", "start"), marks("prepare", "end")
    assert all(starts[run]["time"] < ends[other]["time"] for run in runs for other in runs)  # side by side
    # Every task process, forked from a Celery worker that imported torch when it started, began with it.
    every = [m for task in ("prepare", "train", "evaluate") for m in marks(task, "start").values()]
    assert len(every) == 6 and all(m["warm"] for m in every), every


def test_a_task_marked_failed_through_the_api_leaves_no_training_process(stack):
    client = stack.client()
    unpause(client, "torchrun_kill")
    run_id, job = trigger_and_wait_for_ranks(client, job_marker())
    client.request("PATCH", f"/api/v2/dags/torchrun_kill/dagRuns/{run_id}/taskInstances/sleep_long", {"new_state": "failed"})
    wait_for(lambda: not still_alive(job), "every process of the job to end after 'mark failed'", timeout_s=60)
    assert client.request("GET", f"/api/v2/dags/torchrun_kill/dagRuns/{run_id}/taskInstances/sleep_long")["state"] == "failed"


@pytest.fixture()
def browser(stack, tmp_path):
    """Chromium logged in as the admin; the screenshots stay in the test's artifacts folder."""
    from tests.browser import signed_in

    with signed_in(stack.airflow_url, "admin", stack.admin_password(), tmp_path / "artifacts") as browser:
        yield browser


def test_ui_trigger_form_run_task_log_and_mlflow_link(stack, browser):
    from selenium.webdriver.common.by import By

    client = stack.client()
    unpause(client, "tabular_mlp")
    driver = browser.driver
    driver.get(f"{stack.airflow_url}/dags/tabular_mlp")
    browser.wait(lambda: browser.by_text("button", "Trigger"), "the Trigger button")[0].click()
    browser.wait(lambda: driver.find_elements(By.NAME, "element_epochs"), "the trigger form's Params")
    browser.shot("trigger-form")

    # Invalid values first: the form refuses them.
    epochs = browser.set_field("element_epochs", "0")
    assert epochs.get_attribute("value") == "1"  # below the Param's minimum: put back to it
    browser.set_field("element_input_path", "")
    browser.wait(lambda: [e for e in driver.find_elements(By.XPATH, "//*[text()='This field is required']")],
                 "the form to say input_path is required")
    assert not browser.by_text("button", "Trigger")[-1].is_enabled()
    browser.shot("form-refuses-empty-input-path")

    model = "stack_ui_model"
    for name, value in (("element_input_path", str(stack.demo_parquet)), ("element_nproc_per_node", "1"),
                        ("element_epochs", "2"), ("element_batch_size", "64"), ("element_model_name", model)):
        browser.set_field(name, value)
    trigger = browser.by_text("button", "Trigger")[-1]
    assert trigger.is_enabled()
    browser.shot("form-filled")
    trigger.click()
    url = browser.wait(lambda: driver.current_url if "/runs/" in driver.current_url else None, "the new run's page")
    run_id = url.split("/runs/", 1)[1].split("/")[0]
    run = client.request("GET", f"/api/v2/dags/tabular_mlp/dagRuns/{run_id}")
    assert (run["conf"]["epochs"], run["conf"]["model_name"], run["conf"]["nproc_per_node"]) == (2, model, 1)
    assert wait_run(client, "tabular_mlp", run_id) == "success"
    driver.refresh()
    browser.wait(lambda: browser.by_text("span", "Success") or "Success" in driver.find_element(By.TAG_NAME, "body").text,
                 "the run page to show success")
    browser.shot("run-success")

    driver.get(f"{stack.airflow_url}/dags/tabular_mlp/runs/{run_id}/tasks/train")
    browser.wait(lambda: "[default0]:" in driver.find_element(By.TAG_NAME, "body").text, "rank-prefixed lines in the train log")
    browser.shot("train-log")

    # The plugin's "Training job" tab on the task instance's page: the job view in the UI's frame, signed in by the
    # UI's own session (the job ended: every rank, its cost, the MLflow run).
    browser.wait(lambda: browser.by_text("a", "Training job") or browser.by_text("button", "Training job"),
                 "the Training job tab")[0].click()
    frame = browser.wait(lambda: driver.find_elements(By.TAG_NAME, "iframe"), "the job view's frame")[0]
    assert "/pipeline/jobs/tabular_mlp/" in frame.get_attribute("src")  # an unmapped task: {MAP_INDEX} as it is
    driver.switch_to.frame(frame)
    browser.wait(lambda: driver.find_element(By.ID, "state").text == "finished"
                 and len(driver.find_elements(By.CSS_SELECTOR, "#ranks tbody tr")) == 1, "the ended job in the view")
    assert driver.find_element(By.ID, "cost").text.endswith("1 attempt(s))")
    assert driver.find_element(By.ID, "error").text == ""
    driver.switch_to.default_content()
    browser.shot("training-job-tab")

    driver.get(f"{stack.airflow_url}/dags/tabular_mlp/runs/{run_id}/tasks/train/details")
    link = browser.wait(lambda: browser.by_text("a", "MLflow"), "the MLflow extra link")[0]
    mlflow_run = xcom(client, "tabular_mlp", run_id, "train")["mlflow_run_id"]
    assert link.get_attribute("href").startswith(stack.mlflow_url) and mlflow_run in link.get_attribute("href")
    browser.shot("extra-link")
    link.click()
    browser.wait(lambda: len(driver.window_handles) > 1, "the MLflow tab")
    driver.switch_to.window(driver.window_handles[-1])
    browser.wait(lambda: mlflow_run in driver.find_element(By.TAG_NAME, "body").text, "MLflow's run page", timeout_s=90)
    browser.shot("mlflow-run-page")


def test_ui_approves_a_require_approval_run_on_the_required_actions_page(stack, browser):
    from selenium.webdriver.common.by import By

    client = stack.client()
    unpause(client, "tabular_mlp")
    model = "stack_approval_model"
    conf = {"input_path": str(stack.demo_parquet), **TINY, "epochs": 1, "model_name": model, "require_approval": True,
            "overrides": {**TINY["overrides"], "registry.experiment": model, "evaluate.min_improvement": -1.0}}
    run_id = client.request("POST", "/api/v2/dags/tabular_mlp/dagRuns", {"logical_date": None, "conf": conf})["dag_run_id"]
    driver = browser.driver

    def approve_state() -> str | None:
        return client.request("GET", f"/api/v2/dags/tabular_mlp/dagRuns/{run_id}/taskInstances/approve")["state"]

    # The page lists what is awaiting input when it loads: first the run's approval is asked, then the page loads.
    wait_for(lambda: approve_state() == "awaiting_input", "the run's approval to be asked", timeout_s=300, poll_s=1)
    driver.get(f"{stack.airflow_url}/required_actions")
    run_link = browser.wait(lambda: browser.by_text("a", run_id), "the run on the Required Actions page")[0]
    browser.shot("required-actions")
    assert run_link.is_displayed()
    from urllib.parse import unquote

    subject = [a for a in browser.by_text("a", "Promote the challenger to champion?")
               if run_id in unquote(a.get_attribute("href") or "")]
    assert len(subject) == 1, [a.get_attribute("href") for a in browser.by_text("a", "Promote the challenger to champion?")]
    subject[0].click()
    approve = browser.wait(lambda: browser.by_text("button", "Approve"), "the Approve button")[0]
    browser.shot("approval-form")
    approve.click()
    assert wait_run(client, "tabular_mlp", run_id) == "success"
    summary = xcom(client, "tabular_mlp", run_id, "promote")
    assert summary["promoted"], summary
    assert xcom(client, "tabular_mlp", run_id, "approve")["chosen_options"] == ["Approve"]
    driver.refresh()
    browser.wait(lambda: "Success" in driver.find_element(By.TAG_NAME, "body").text, "the approve task shown as success")
    browser.shot("approved")


def test_stack_down_leaves_no_process_and_no_port(stack):
    from pipeline.process_table import alive

    state = stack.state()
    pids = {pid for root in state["pids"].values() for pid in [root, *[c.pid for c in psutil.Process(root).children(recursive=True)]]}
    stack.down()
    assert not [pid for pid in pids if alive(pid)]
    bound = {c.laddr.port for c in psutil.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    assert not bound & {stack.airflow_port, stack.mlflow_port}
    assert stack.state() is None
