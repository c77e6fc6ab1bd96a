"""LoRA fine-tuning with LLM Foundry (Composer), under torchrun in the llm_foundry toolchain's environment.

Each rank runs LLM Foundry's own ``train`` (what ``scripts/train/train.py`` does) directly under torchrun,
not under Composer's launcher: torchrun already started the ranks, and Composer's launcher would start more and
move the rendezvous port away from the agent's store. Composer reads the node's rank from ``NODE_RANK``, which
torchrun does not set; it is the agent's ``GROUP_RANK``. The run's own values go in as ``variables``: the base model,
the train split's JSON Lines, ``save_folder`` (``$PIPELINE_CHECKPOINT_DIR``; with ``autoresume`` a retry continues
from the newest checkpoint) and the Hugging Face checkpointer's folder in the job folder. Composer's MLflow logger
logs into the DAG's run (``MLFLOW_RUN_ID``). A mistake in the config fails LLM Foundry's own validation, which
raises plain ``ValueError``s: the script reports it as ``ConfigMistake`` (toolchain.json's ``config_errors``).
Rank 0 then writes ``$PIPELINE_RESULT_FILE`` naming the adapter folder.

    torchrun --nproc-per-node=2 sft.py --model ./tiny-llama --data train.jsonl --config sft.yaml
"""

import argparse
import glob
import os
import time

os.environ.setdefault("NODE_RANK", os.environ.get("GROUP_RANK", "0"))  # before Composer reads it

import copy  # noqa: E402

from llmfoundry.command_utils import train  # noqa: E402
from llmfoundry.utils.config_utils import TRAIN_CONFIG_KEYS, TrainConfig, make_dataclass_and_log_config  # noqa: E402
from omegaconf import OmegaConf as om  # noqa: E402
from omegaconf.errors import OmegaConfBaseException  # noqa: E402

from pipeline.toolchains import write_result  # noqa: E402


class ConfigMistake(ValueError):
    """LLM Foundry refused the config (unknown or misspelt keys, wrong types): toolchain.json's config_errors."""


def load_config(path, overrides):
    """The YAML with the run's overrides, as LLM Foundry's ``train_from_yaml`` builds it, checked first by LLM
    Foundry's own validation (``make_dataclass_and_log_config``), which raises plain ``ValueError``s."""
    try:
        with open(path) as fh:
            cfg = om.merge(om.load(fh), om.from_cli(overrides))
        make_dataclass_and_log_config(copy.deepcopy(cfg), TrainConfig, TRAIN_CONFIG_KEYS, transforms="all")
    except (ValueError, TypeError, OmegaConfBaseException) as exc:
        raise ConfigMistake(f"{path}: {exc}") from exc
    return cfg


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="local model folder (with its tokenizer)")
    parser.add_argument("--data", required=True, help="JSON Lines with prompt and completion fields")
    parser.add_argument("--config", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft.yaml"))
    args = parser.parse_args()
    started = time.monotonic()
    job_dir = os.environ.get("PIPELINE_JOB_DIR", ".")
    checkpoints = os.environ.get("PIPELINE_CHECKPOINT_DIR", os.path.join(job_dir, "checkpoints"))
    hf_folder = os.path.join(job_dir, "hf")
    if os.environ.get("MLFLOW_RUN_ID") and not os.environ.get("MLFLOW_EXPERIMENT_ID"):
        from mlflow.tracking import MlflowClient  # the run's own experiment, not one named after Composer's default

        os.environ["MLFLOW_EXPERIMENT_ID"] = MlflowClient().get_run(os.environ["MLFLOW_RUN_ID"]).info.experiment_id

    resumed_from = os.path.realpath(os.path.join(checkpoints, "latest-rank0.pt"))
    resumed_from = resumed_from if os.path.exists(resumed_from) else None
    cfg = load_config(args.config, [f"variables.model={args.model}", f"variables.data={args.data}",
                                    f"variables.checkpoints={checkpoints}", f"variables.hf_folder={hf_folder}"])
    trainer = train(cfg)

    if int(os.environ.get("RANK", "0")) == 0:
        import llmfoundry

        saved = sorted(glob.glob(os.path.join(hf_folder, "huggingface", "ba*")), key=lambda p: int(p.rsplit("ba", 1)[1]))
        loss = trainer.state.loss
        result = {"model_dir": os.path.abspath(saved[-1]), "resumed_from": resumed_from,
                  "world_size": int(os.environ.get("WORLD_SIZE", "1")), "steps": int(trainer.state.timestamp.batch),
                  "toolchain": "llm_foundry", "llmfoundry_version": llmfoundry.__version__,
                  "metrics": {"train_loss": float(loss)} if loss is not None and getattr(loss, "numel", lambda: 1)() == 1
                  else {}, "wall_s": round(time.monotonic() - started, 3)}
        write_result(result)


if __name__ == "__main__":
    main()
