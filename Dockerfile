# One image for the whole system: Airflow (api-server, scheduler, dag-processor, triggerer, workers), the
# training pods of launch.kind=kubernetes, and MLflow. torch comes from the pinned requirements: the PyPI
# wheel for Linux x86_64 is CUDA-enabled and carries its CUDA libraries; the GPU driver comes from the
# node (NVIDIA container runtime or device plugin). No secret is built in: credentials reach containers
# as environment variables (Kubernetes Secrets through launch.kubernetes.env_from_secrets, compose's .env).
#
#   docker build -t ddp-pipelines:latest .
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIPELINE_HOME=/var/lib/pipeline

# libgomp: torch's CPU kernels; tini: a PID 1 that forwards signals, so a pod's SIGTERM reaches torchrun.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 tini ca-certificates \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/pipeline

# Dependencies first (the slow layer, cached while only the project changes); the project's own
# editable line needs its sources, so it is installed after them.
COPY requirements.txt ./
RUN python -m venv "$VIRTUAL_ENV" \
    && grep -v '^-e ' requirements.txt > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY pyproject.toml ./
COPY pipeline ./pipeline
COPY dags ./dags
COPY plugins ./plugins
COPY examples ./examples
RUN pip install --no-deps -e . && python -c "import pipeline.job.kubernetes.place, torch, airflow.sdk"

# A non-root user (Airflow's default UID); group 0 may write where the pipeline writes, so the image
# also runs under an arbitrary UID in group 0 (compose's AIRFLOW_UID, OpenShift).
RUN useradd --uid 50000 --gid 0 --home-dir /home/pipeline --create-home --shell /usr/sbin/nologin pipeline \
    && mkdir -p "$PIPELINE_HOME" /opt/airflow/logs /opt/airflow/auth \
    && chown -R 50000:0 "$PIPELINE_HOME" /opt/airflow /home/pipeline \
    && chmod -R g=u "$PIPELINE_HOME" /opt/airflow /home/pipeline
USER 50000
ENV HOME=/home/pipeline AIRFLOW_HOME=/opt/airflow

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["airflow", "version"]
