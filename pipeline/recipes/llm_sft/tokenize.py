"""The recipe's row transform (``data.transform``): prompt/response or chat rows -> fixed-length token rows.

Each example becomes ``input_ids`` and ``labels`` (the prompt's tokens masked to -100, so the loss is on
the completion only), padded to ``data.max_seq_len``, with ``num_tokens`` (tokens before the padding) and
the ``prompt`` and ``reference`` texts that evaluation generates from and compares with. Longer
examples are truncated or dropped (``data.overlong``); with ``data.packing`` the training split's
examples are packed, whole and in order, into full sequences. Runs in every preparation worker.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.data.prepare.transform import RowError
from pipeline.errors import ConfigError, DataError
from pipeline.evaluate.language_model import IGNORE_INDEX

TOKENIZER = "tokenizer"  # the name of the tokenizer among the transform's files (transform/tokenizer in a version)


def beside_input(folder: str, input_path: str) -> Path:
    """A local folder a field names: an absolute path as is, a relative one taken from ``data.input_path``'s folder
    (where a data set keeps its tokenizer or model, as the demo does)."""
    from pipeline.data import local_path

    path = Path(folder)
    return path if path.is_absolute() else local_path(input_path).parent / path


def resolve_tokenizer_path(tokenizer_path: str, input_path: str) -> Path:
    """``data.tokenizer_path`` as a local folder (relative to ``data.input_path``'s folder); a hub name is refused."""
    if not tokenizer_path:
        raise ConfigError("data.tokenizer_path is empty: expected the local folder of a Hugging Face tokenizer")
    path = beside_input(tokenizer_path, input_path)
    if not path.is_dir():
        raise ConfigError(f"data.tokenizer_path={tokenizer_path!r}: {path} is not a local folder; expected a saved "
                          f"tokenizer (tokenizer.json, tokenizer_config.json). Nothing is fetched from a hub.")
    return path


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class Tokenize:
    """Picklable: the tokenizer is loaded on first use in each process."""

    def __init__(self, *, tokenizer_dir: str, prompt_column: str, response_column: str, messages_column: str,
                 max_seq_len: int, overlong: str, packing: bool):
        self.tokenizer_dir = tokenizer_dir
        self.prompt_column, self.response_column, self.messages_column = prompt_column, response_column, messages_column
        self.max_seq_len, self.overlong, self.packing = max_seq_len, overlong, packing
        self.use_messages = False
        self._tokenizer = None
        length = f"ndarray:int32:{max_seq_len}"
        self.encodings = {"input_ids": length, "labels": length, "num_tokens": "int32", "prompt": "str",
                          "reference": "str"}

    @property
    def files(self) -> dict[str, str]:
        return {TOKENIZER: self.tokenizer_dir}

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(Path(self.tokenizer_dir))
        return self._tokenizer

    def __getstate__(self):
        return {**self.__dict__, "_tokenizer": None}

    def check_columns(self, names: list[str], origin: str) -> None:
        if self.messages_column in names:
            self.use_messages = True
            if self.tokenizer.chat_template is None:
                raise DataError(f"{origin}: column {self.messages_column!r} holds chat messages, but the tokenizer in "
                                f"{self.tokenizer_dir} has no chat template to format them; give one "
                                f"(tokenizer_config.json chat_template) or use {self.prompt_column!r}/"
                                f"{self.response_column!r} columns")
            return
        missing = [c for c in (self.prompt_column, self.response_column) if c not in names]
        if missing:
            raise DataError(f"{origin}: missing column(s) {missing}; expected {self.prompt_column!r} and "
                            f"{self.response_column!r} (data.prompt_column, data.response_column), or chat messages in "
                            f"{self.messages_column!r} (data.messages_column); the columns are {names}")

    def __call__(self, table, split: str):
        import pyarrow as pa

        counts: Counter = Counter(rows_in=table.num_rows)
        if self.use_messages or self.tokenizer.chat_template is not None:
            examples = [self.example(i, row) for i, row in enumerate(self._rows(table))]
        else:
            examples = self._plain_examples(table)
        kept = []
        for prompt_ids, completion_ids, prompt, reference in examples:
            ids, labels = prompt_ids + completion_ids, [IGNORE_INDEX] * len(prompt_ids) + completion_ids
            if len(ids) > self.max_seq_len:
                if self.overlong == "drop":
                    counts["dropped_overlong"] += 1
                    continue
                ids, labels = ids[:self.max_seq_len], labels[:self.max_seq_len]
                if all(label == IGNORE_INDEX for label in labels):
                    counts["dropped_no_completion_left"] += 1
                    continue
                counts["truncated"] += 1
            kept.append((ids, labels, prompt, reference))
        counts["examples"] += len(kept)
        if self.packing and split == "train":
            kept = pack(kept, self.max_seq_len)
            counts["packed_rows"] += len(kept)
        counts["rows_out"] += len(kept)
        counts["completion_tokens"] += sum(sum(label != IGNORE_INDEX for label in k[1]) for k in kept)
        return self._table(kept, pa), counts

    def _rows(self, table):
        if self.use_messages:
            return ({"messages": m} for m in table.column(self.messages_column).to_pylist())
        prompts = table.column(self.prompt_column).to_pylist()
        return ({"prompt": p, "response": r} for p, r in zip(prompts, table.column(self.response_column).to_pylist()))

    def _plain_examples(self, table) -> list[tuple[list[int], list[int], str, str]]:
        """Prompt/response rows without a chat template, each column tokenized as one batch."""
        prompts = table.column(self.prompt_column).to_pylist()
        responses = table.column(self.response_column).to_pylist()
        for i, (prompt, response) in enumerate(zip(prompts, responses)):
            _check_texts(i, ((self.prompt_column, prompt), (self.response_column, response)))
        if not prompts:
            return []
        tok = self.tokenizer
        prompt_ids = tok(prompts)["input_ids"]  # with the tokenizer's own special tokens (a BOS)
        completion_ids = tok(responses, add_special_tokens=False)["input_ids"]
        return [(p, c + [tok.eos_token_id], prompt, response)
                for p, c, prompt, response in zip(prompt_ids, completion_ids, prompts, responses)]

    def example(self, i: int, row: dict[str, Any]) -> tuple[list[int], list[int], str, str]:
        """One row through the tokenizer's chat template: (prompt token ids, completion token ids, prompt text
        as fed to the model, reference text)."""
        tok = self.tokenizer
        if self.use_messages:
            messages = _check_messages(i, self.messages_column, row["messages"])
            context, reference = messages[:-1], messages[-1]["content"]
        else:
            _check_texts(i, ((self.prompt_column, row["prompt"]), (self.response_column, row["response"])))
            context, reference = [{"role": "user", "content": row["prompt"]}], row["response"]
        prompt = tok.apply_chat_template(context, tokenize=False, add_generation_prompt=True)
        full = tok.apply_chat_template(context + [{"role": "assistant", "content": reference}], tokenize=False)
        if not full.startswith(prompt):
            raise RowError(i, self.messages_column if self.use_messages else self.prompt_column,
                           "the chat template renders the conversation without its generation prompt as a prefix; "
                           "cannot tell the prompt's tokens from the completion's")
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        completion_ids = tok(full[len(prompt):], add_special_tokens=False)["input_ids"]
        return prompt_ids, completion_ids, prompt, reference

    def _table(self, kept, pa):
        n, length = len(kept), self.max_seq_len
        pad = self.tokenizer.pad_token_id
        ids = np.full((n, length), pad, np.int32)
        labels = np.full((n, length), IGNORE_INDEX, np.int32)
        num_tokens = np.zeros(n, np.int32)
        for r, (row_ids, row_labels, _, _) in enumerate(kept):
            ids[r, :len(row_ids)] = row_ids
            labels[r, :len(row_labels)] = row_labels
            num_tokens[r] = len(row_ids)
        as_list = lambda a: pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), length)  # noqa: E731
        return pa.table({"input_ids": as_list(ids), "labels": as_list(labels), "num_tokens": pa.array(num_tokens),
                         "prompt": pa.array([k[2] for k in kept], pa.string()),
                         "reference": pa.array([k[3] for k in kept], pa.string())})


def pack(examples: list[tuple], max_seq_len: int) -> list[tuple]:
    """Whole examples, in order, concatenated into sequences of at most ``max_seq_len`` tokens; a packed row
    has no single prompt or reference (empty texts)."""
    rows, ids, labels = [], [], []
    for example_ids, example_labels, _, _ in examples:
        if ids and len(ids) + len(example_ids) > max_seq_len:
            rows.append((ids, labels, "", ""))
            ids, labels = [], []
        ids, labels = ids + example_ids, labels + example_labels
    if ids:
        rows.append((ids, labels, "", ""))
    return rows


def _check_texts(i: int, values: tuple[tuple[str, Any], tuple[str, Any]]) -> None:
    """A prompt and a response must be text, the response not empty."""
    for column, value in values:
        if not isinstance(value, str):
            raise RowError(i, column, f"value {value!r}; expected text")
    column, response = values[1]
    if not response:
        raise RowError(i, column, "the response is empty; expected the completion to train on")


def _check_messages(i: int, column: str, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RowError(i, column, f"value {messages!r}; expected a non-empty list of {{role, content}} messages")
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowError(i, column, f"message {j} is {m!r}; expected {{'role': text, 'content': text}}")
    if messages[-1]["role"] != "assistant":
        raise RowError(i, column, f"the last message has role {messages[-1]['role']!r}; expected 'assistant' (the "
                                  f"completion the loss is on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def make(cfg) -> Tokenize:
    """The transform of an ``LlmDataConfig`` (``data.transform`` names this)."""
    return Tokenize(tokenizer_dir=str(resolve_tokenizer_path(cfg.tokenizer_path, cfg.input_path)),
                    prompt_column=cfg.prompt_column, response_column=cfg.response_column,
                    messages_column=cfg.messages_column, max_seq_len=cfg.max_seq_len, overlong=cfg.overlong,
                    packing=cfg.packing)
