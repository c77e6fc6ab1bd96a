"""The recipe's inputs without a hub.

- ``write_wordnet_pos`` (``make demo``): a question per word of a WordNet example sentence, "which part of
  speech is WORD in SENTENCE?", answered noun, verb, adjective or adverb, beside SmolLM2-135M-Instruct
  (``pipeline.data.packaged``) to fine-tune.
- ``write_addition`` (the tests' ``tiny`` runs): two-digit additions as prompt/response rows ("12+34=" -> "46")
  and a tokenizer trained on them in-process (byte-level BPE, one token per digit), written beside the rows.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections import defaultdict
from pathlib import Path

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def addition_rows(seed: int = 0) -> list[dict[str, str]]:
    """Every sum of two numbers in 10..99 (8,100 rows), shuffled."""
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    return rows


def train_tokenizer(texts: list[str], out_dir: Path, *, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on ``texts`` (digits always single tokens, a BOS added in front),
    saved as a fast tokenizer that ``AutoTokenizer.from_pretrained(out_dir)`` loads offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    specials = list(SPECIAL_TOKENS.values())
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = SPECIAL_TOKENS["bos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.token_to_id(bos))])
    # model_input_names: without it generate() is handed token_type_ids, which Llama does not take.
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_input_names=["input_ids", "attention_mask"],
                                   **SPECIAL_TOKENS)
    out_dir = Path(out_dir)
    fast.save_pretrained(str(out_dir))
    return out_dir


def write_addition(path: Path, *, rows: int | None = None, seed: int = 0) -> Path:
    """The rows as JSON Lines at ``path`` and their tokenizer in ``path``'s folder, under ``tokenizer/``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = addition_rows(seed)[:rows]
    train_tokenizer([r["prompt"] + r["response"] for r in data], path.parent / "tokenizer")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in data))
    tmp.replace(path)
    return path


MODEL_FOLDER = "SmolLM2-135M-Instruct"  # beside the questions: a link to the converted checkpoint, kept in the home
POS_QUESTION = 'Part of speech of "{word}" in "{sentence}"? Answer noun, verb, adjective or adverb.'


def wordnet_pos_rows(per_class: int, seed: int = 0) -> list[dict[str, str]]:
    """``per_class`` questions for each part of speech, shuffled: a word of a WordNet sense in one of the sense's
    example sentences (whole words, any case), the sense's part of speech the answer. ``word`` is kept: the
    split holds out whole words (``data.key_column``), so no test word is seen in training."""
    from pipeline.data import packaged

    by_pos: dict[str, list[dict[str, str]]] = defaultdict(list)
    for sense in packaged.wordnet_senses():
        for word in sense.words:
            sentence = next((e for e in sense.examples if re.search(rf"\b{re.escape(word)}\b", e, re.IGNORECASE)), None)
            if sentence is not None:
                by_pos[sense.pos].append({"prompt": POS_QUESTION.format(word=word, sentence=sentence),
                                          "response": sense.pos, "word": word.lower()})
    rng = random.Random(seed)
    rows = []
    for pos in sorted(by_pos):
        rows += rng.sample(by_pos[pos], min(per_class, len(by_pos[pos])))
    rng.shuffle(rows)
    return rows


def write_wordnet_pos(path: Path, *, per_class: int = 450, seed: int = 0) -> Path:
    """The questions as JSON Lines at ``path`` and, beside them, ``SmolLM2-135M-Instruct``: a link to the
    checkpoint converted once into ``$PIPELINE_HOME/models/``."""
    from pipeline import deployment
    from pipeline.data import packaged

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = packaged.smollm2_135m_instruct(deployment.home() / "models" / MODEL_FOLDER)
    link = path.parent / MODEL_FOLDER
    if link.is_symlink() and not link.exists():  # left by a home that is gone
        link.unlink()
    if not link.exists():
        os.symlink(model, link, target_is_directory=True)
    rows = wordnet_pos_rows(per_class, seed)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)
    return path


def write_tiny_checkpoint(tokenizer_dir: Path, out_dir: Path, *, hidden_size: int = 32, num_layers: int = 1,
                          seed: int = 0) -> Path:
    """A tiny, untrained Llama-style checkpoint with ``tokenizer_dir``'s tokenizer in ``out_dir``: a local
    ``model.pretrained_path`` (or a script's ``--model``) where no hub can be reached."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True))
    out_dir = Path(out_dir)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
