"""Indexed datasets as the skill's tools meet them: which files make one, what prepare-data records
beside it (PREFIX.json), and the checks render and train make of a request's data_path before a
job starts (every prefix has its .bin and .idx, every blend weight is a number above 0, the
tokenizer flags match the tokenizer a dataset was made with)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .. import files as guarded
from ..errors import ToolError

MADE_BY = "megatron-core-training prepare-data"  # the record's mark: a PREFIX.json of ours
# The chat format's loss mask beside the tokens: PREFIX_lossmask.bin / .idx (runtime/masked_dataset.py reads it).
MASK_SUFFIX = "_lossmask"


def dataset_files(prefix: Path) -> dict[str, Path]:
    """The dataset's files: the tokens (.bin, .idx), prepare-data's record (.json), and the chat
    format's loss mask."""
    name = prefix.name
    return {"bin": prefix.with_name(name + ".bin"), "idx": prefix.with_name(name + ".idx"),
            "json": prefix.with_name(name + ".json"),
            "mask_bin": prefix.with_name(name + MASK_SUFFIX + ".bin"),
            "mask_idx": prefix.with_name(name + MASK_SUFFIX + ".idx")}


def file_facts(files: dict[str, Path]) -> dict[str, Any]:
    """What the record says of the data it describes: sizes, and the index's hash (small,
    and it holds every document's length)."""
    import hashlib

    return {"bin_bytes": files["bin"].stat().st_size, "idx_bytes": files["idx"].stat().st_size,
            "idx_sha256": hashlib.sha256(files["idx"].read_bytes()).hexdigest()}


def read_record(files: dict[str, Path]) -> tuple[dict[str, Any] | None, str]:
    """(PREFIX.json's record, 'ok') when it was written by prepare-data and describes the .bin and
    .idx beside it; else (None or the record, why not: 'missing', 'foreign', 'stale')."""
    if guarded.kind_of(files["json"]) == "missing":
        return None, "missing"
    record = guarded.read_record(files["json"])
    if record is None or record.get("made_by") != MADE_BY:
        return None, "foreign"
    try:
        facts = file_facts(files)
    except OSError:
        return record, "stale"
    return record, "ok" if record.get("files") == facts else "stale"


def check_datasets(training: dict[str, Any]) -> None:
    """Every data_path prefix (weights aside) has its .bin and .idx: a missing dataset is
    reported here, not by a rank inside torchrun minutes later."""
    for i, entry in enumerate(training.get("data_path") or []):
        if is_weight(entry):
            check_weight(entry, where=f"/training/data_path/{i}")
            continue
        guarded.check_names(entry + ".bin", f"/training/data_path/{i}")   # a name too long is the request's error
        missing = [ext for ext in (".bin", ".idx") if guarded.kind_of(entry + ext) != "file"]
        if missing:
            raise ToolError("not_found", f"dataset {entry}: no {' or '.join(entry + m for m in missing)}",
                            where=f"/training/data_path/{i}",
                            fix="give the prefix of an indexed dataset (PREFIX.bin and PREFIX.idx); "
                                "launch.py prepare-data makes one from JSONL")


def check_weight(entry: str, where: str) -> None:
    """A blend weight is a finite number above 0 (Megatron normalises the weights to sum to 1: a
    negative or NaN one would make a nonsense blend, or divide by zero)."""
    weight = float(entry)
    if not (math.isfinite(weight) and weight > 0):
        raise ToolError("bad_request", f"data_path weight {entry!r} is not a number above 0", where=where,
                        fix="give each dataset a weight above 0 before its prefix ('0.3 PREFIX_A 0.7 PREFIX_B'), "
                            "or no weights (a dataset named like a number: write it as ./NAME)")


def is_weight(entry: str) -> bool:
    """A blend weight in Megatron's data path ('0.3 PREFIX_A 0.7 PREFIX_B'), not a prefix."""
    try:
        float(entry)
        return True
    except ValueError:
        return False


def dataset_record(prefix: str, where: str = "/training/data_path") -> dict[str, Any] | None:
    """What prepare-data recorded about a dataset (PREFIX.json), or None for datasets made
    elsewhere (and for a prefix with no file name of its own, such as "/" or "."). A record
    that no longer matches its .bin / .idx is an error: its tokenizer may not be theirs."""
    if not Path(prefix).name:
        return None
    files = dataset_files(Path(prefix))
    record, status = read_record(files)
    if status == "stale" and files["bin"].exists() and files["idx"].exists():
        raise ToolError("bad_request", f"{files['json']} no longer describes {prefix}.bin / .idx "
                        "(they changed after prepare-data wrote it)", where=where,
                        fix="run prepare-data again for this dataset (with overwrite true)")
    return record["result"] if status == "ok" else None  # type: ignore[index]


def match_tokenizer(training: dict[str, Any], model_vocab: int) -> dict[str, Any]:
    """Training settings with the tokenizer flags that match datasets made by prepare-data:
    a Hugging Face dataset gets its tokenizer folder, a SentencePiece one its .model with
    SentencePieceTokenizer (unless the request names another SentencePiece type), a byte dataset NullTokenizer with
    vocabulary 257 (end of document 256).  Datasets made elsewhere are left as they are."""
    out = dict(training)
    for i, entry in enumerate(training.get("data_path") or []):
        rec = dataset_record(entry, where=f"/training/data_path/{i}")
        if rec is None:
            continue
        tok = rec["tokenizer"]
        if tok["vocab_size"] > model_vocab:
            raise ToolError("bad_request", f"dataset {entry} was tokenized with a {tok['vocab_size']}-token "
                            f"vocabulary, larger than the model's {model_vocab}", where=f"/training/data_path/{i}",
                            fix="use a model with a vocabulary at least that large, or re-tokenize")
        if tok["type"] in ("huggingface", "sentencepiece"):
            if out.get("tokenizer_model") not in (None, tok["path"]):
                raise ToolError("bad_request", f"dataset {entry} was tokenized with {tok['path']}, not "
                                f"{out['tokenizer_model']}", where="/training/tokenizer_model",
                                fix="train with the tokenizer the dataset was made with")
            out["tokenizer_model"] = tok["path"]
            if tok["type"] == "sentencepiece":   # Megatron's three SentencePiece types tokenize alike in 0.19
                out.setdefault("tokenizer_type", "SentencePieceTokenizer")
        elif tok["type"] == "byte" and "vocab_size" not in training and not out.get("tokenizer_model"):
            out["vocab_size"] = tok["vocab_size"]
    return out
