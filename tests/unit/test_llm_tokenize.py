"""The llm_sft recipe's tokenization (a row transform of the preparation): prompt masking, truncation or drop,
packing, chat templates, bad input, and the tokenizer's files in the dataset version's digest."""

import json
from pathlib import Path

import pyarrow as pa
import pytest

from pipeline.data.prepare.transform import RowError
from pipeline.errors import ConfigError, DataError
from pipeline.recipes.llm_sft.tokenize import IGNORE_INDEX, Tokenize, pack

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}"
                 "</s>{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from pipeline.recipes.llm_sft.demo import train_tokenizer

    texts = [f"{a}+{b}={a + b}" for a in range(10, 40) for b in range(10, 40)] + ["<|user|>hi<|assistant|>ok"]
    return train_tokenizer(texts, tmp_path_factory.mktemp("tok") / "tokenizer")


def _transform(tokenizer_dir, **kw) -> Tokenize:
    args = dict(tokenizer_dir=str(tokenizer_dir), prompt_column="prompt", response_column="response",
                messages_column="messages", max_seq_len=16, overlong="truncate", packing=False) | kw
    return Tokenize(**args)


def _rows(out: pa.Table) -> list[dict]:
    return out.to_pylist()


def test_the_prompt_tokens_are_masked_and_the_completion_ends_with_eos(tokenizer_dir):
    t = _transform(tokenizer_dir)
    t.check_columns(["prompt", "response"], "in.jsonl")
    out, counts = t(pa.table({"prompt": ["12+34="], "response": ["46"]}), "train")
    row = _rows(out)[0]
    tok = t.tokenizer
    n = row["num_tokens"]
    ids, labels = row["input_ids"][:n], row["labels"][:n]
    assert tok.decode(ids, skip_special_tokens=True) == "12+34=46"
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    completion = [i for i, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert tok.decode(completion, skip_special_tokens=True) == "46" and completion[-1] == tok.eos_token_id
    assert labels[:n - 3] == [IGNORE_INDEX] * (n - 3)  # <s>1 2 + 3 4 = masked; 4 6 </s> kept
    assert row["input_ids"][n:] == [tok.pad_token_id] * (16 - n) and row["labels"][n:] == [IGNORE_INDEX] * (16 - n)
    assert (row["prompt"], row["reference"]) == ("12+34=", "46")
    assert counts["rows_in"] == counts["rows_out"] == 1 and counts["completion_tokens"] == 3


def test_overlong_examples_are_truncated_or_dropped_and_counted(tokenizer_dir):
    rows = pa.table({"prompt": ["12+34=", "1111111111111=", "1111+22="], "response": ["46", "1", "1111111133"]})
    truncated, counts = _transform(tokenizer_dir, max_seq_len=12)(rows, "train")
    # 1: fits (10 tokens); 2: the prompt alone fills 12 tokens -> nothing to learn -> dropped; 3: cut at 12.
    assert truncated.num_rows == 2 and counts["truncated"] == 1 and counts["dropped_no_completion_left"] == 1
    assert _rows(truncated)[1]["num_tokens"] == 12
    dropped, counts = _transform(tokenizer_dir, max_seq_len=12, overlong="drop")(rows, "train")
    assert dropped.num_rows == 1 and counts["dropped_overlong"] == 2


def test_packing_fills_training_sequences_with_whole_examples_and_leaves_held_out_rows_alone(tokenizer_dir):
    t = _transform(tokenizer_dir, max_seq_len=32, packing=True)
    rows = pa.table({"prompt": [f"{a}+11=" for a in range(10, 17)], "response": [str(a + 11) for a in range(10, 17)]})
    packed, counts = t(rows, "train")
    assert counts["examples"] == 7 and counts["packed_rows"] == packed.num_rows == 3  # 10 tokens each, 3 per row
    first = _rows(packed)[0]
    assert first["num_tokens"] == 30 and first["prompt"] == ""
    assert sum(1 for i in first["input_ids"][:30] if i == t.tokenizer.bos_token_id) == 3
    assert sum(label != IGNORE_INDEX for label in first["labels"]) == 9  # 3 completions of 3 tokens
    held_out, _ = t(rows, "test")
    assert held_out.num_rows == 7
    assert pack([([1, 2], [-100, 2], "p", "r")] * 3, 4) == [([1, 2, 1, 2], [-100, 2, -100, 2], "", ""),
                                                          ([1, 2], [-100, 2], "", "")]


def test_chat_messages_use_the_tokenizers_template_and_the_loss_is_on_the_last_assistant_message(tokenizer_dir, tmp_path):
    import shutil

    chat_dir = tmp_path / "chat-tokenizer"
    shutil.copytree(tokenizer_dir, chat_dir)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": CHAT_TEMPLATE}))
    t = _transform(chat_dir, max_seq_len=64)
    t.check_columns(["messages"], "chat.jsonl")
    conversation = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "46"}]
    out, _ = t(pa.table({"messages": [conversation]}), "train")
    row = _rows(out)[0]
    n = row["num_tokens"]
    completion = [i for i, label in zip(row["input_ids"][:n], row["labels"][:n]) if label != IGNORE_INDEX]
    assert t.tokenizer.decode(completion) == "46</s>"
    assert row["prompt"] == "<|user|>12+34=<|assistant|>" and row["reference"] == "46"

    with pytest.raises(RowError, match="last message has role 'user'"):
        t(pa.table({"messages": [[{"role": "user", "content": "hi"}]]}), "train")
    plain = _transform(tokenizer_dir)
    with pytest.raises(DataError, match="no chat template"):
        plain.check_columns(["messages"], "chat.jsonl")


def test_bad_rows_and_columns_are_named(tokenizer_dir):
    t = _transform(tokenizer_dir)
    with pytest.raises(DataError, match=r"in.jsonl: missing column\(s\) \['response'\]"):
        t.check_columns(["prompt", "answer"], "in.jsonl")
    with pytest.raises(RowError) as err:
        t(pa.table({"prompt": ["1+1=", "2+2="], "response": ["2", None]}), "train")
    assert (err.value.row, err.value.column) == (1, "response") and "expected text" in err.value.problem
    with pytest.raises(RowError, match="the response is empty"):
        t(pa.table({"prompt": ["1+1="], "response": [""]}), "train")


def _prepare(tmp_path, tokenizer_dir, rows, **overrides):
    from pipeline.data.prepare.version import prepare
    from pipeline.recipes import get_recipe

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = get_recipe("llm_sft").config("tiny").with_overrides(
        {"data.input_path": str(data), "data.tokenizer_path": str(tokenizer_dir), **overrides})
    return prepare(cfg.data, name="llm", out_root=tmp_path / "out")


def test_the_preparation_stores_token_rows_counts_and_the_tokenizer_which_is_part_of_the_version(tokenizer_dir, tmp_path):
    import shutil

    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(10, 30) for b in range(10, 20)]
    manifest = _prepare(tmp_path, tokenizer_dir, rows)
    version_dir = tmp_path / "out" / "llm" / manifest["version"]
    assert manifest["schema"]["encodings"]["input_ids"] == "ndarray:int32:16"
    assert manifest["transform"]["rows_in"] == 200 and manifest["transform"]["rows_out"] == sum(manifest["splits"].values())
    assert (version_dir / "transform" / "tokenizer" / "tokenizer.json").is_file()
    assert _prepare(tmp_path, tokenizer_dir, rows)["skipped"]

    other = tmp_path / "other-tokenizer"
    shutil.copytree(tokenizer_dir, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": 99}))
    changed = _prepare(tmp_path, other, rows)
    assert changed["version"] != manifest["version"] and not changed["skipped"]


def test_a_bad_row_fails_the_preparation_naming_file_row_and_column(tokenizer_dir, tmp_path):
    rows = [{"prompt": "1+1=", "response": "2"}] * 5 + [{"prompt": "2+2=", "response": None}]
    with pytest.raises(DataError, match=r"in.jsonl: row 5, column 'response': value None; expected text"):
        _prepare(tmp_path, tokenizer_dir, rows)
    assert not list((tmp_path / "out" / "llm").glob("[0-9a-f]*"))  # nothing published


def test_a_tokenizer_that_is_not_a_local_folder_is_refused(tmp_path):
    from pipeline.recipes.llm_sft.tokenize import resolve_tokenizer_path

    with pytest.raises(ConfigError, match="meta-llama/Llama-3.2-1B.*not a local folder.*Nothing is fetched"):
        resolve_tokenizer_path("meta-llama/Llama-3.2-1B", str(tmp_path / "in.jsonl"))
    (tmp_path / "tokenizer").mkdir()
    assert resolve_tokenizer_path("tokenizer", str(tmp_path / "in.jsonl")) == tmp_path / "tokenizer"
