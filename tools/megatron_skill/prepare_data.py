"""The prepare-data tool: JSONL documents -> a Megatron indexed dataset (.bin / .idx).

Tokenization runs in worker processes over batches of lines, in input order; the writer
is megatron-core's own IndexedDatasetBuilder, so GPTDataset reads the result as it reads
any Megatron dataset.  Nothing is lost quietly: every non-blank line becomes a document or
a reported bad line (file, line number, reason).  The dataset appears atomically: it is
written under temporary names and renamed into place, PREFIX.idx last; PREFIX.json then
records the request, the counts and the tokenizer, which lets train pick matching flags
and lets the same request return at once the second time.
"""
from __future__ import annotations

import gzip
import json
import os
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator

from .contract import Context, Tool, register
from .errors import ToolError

BATCH_LINES = 512
MAX_REPORTED = 20


# ---- tokenizers ---------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255, end of document 256: no vocabulary file, no download.
    Megatron reads it as NullTokenizer with --vocab-size 257 (whose end-of-document id is
    vocab_size - 1 = 256)."""
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def describe(self) -> dict[str, Any]:
        return {"type": "byte", "vocab_size": self.vocab_size, "eod_id": self.eod_id}


class HFTokenizer:
    """A local Hugging Face tokenizer.json through the `tokenizers` library (no transformers,
    no hub); end of document is the tokenizer's EOS (or EOD) token."""
    EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        p = Path(path)
        self.file = p / "tokenizer.json" if p.is_dir() else p
        self.tok = Tokenizer.from_file(str(self.file))
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._eos(p if p.is_dir() else p.parent)

    def _eos(self, folder: Path) -> int:
        cfg = folder / "tokenizer_config.json"
        names = list(self.EOS_NAMES)
        if cfg.exists():
            eos = json.loads(cfg.read_text()).get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos:
                names.insert(0, eos)
        for name in names:
            tid = self.tok.token_to_id(name)
            if tid is not None:
                return tid
        raise ToolError("bad_request", f"{self.file} has no end-of-document token ({', '.join(self.EOS_NAMES[:3])}, ...)",
                        where="/tokenizer", fix="add an eos_token to tokenizer_config.json, or set append_eod false")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def describe(self) -> dict[str, Any]:
        return {"type": "huggingface", "path": str(self.file.parent), "vocab_size": self.vocab_size,
                "eod_id": self.eod_id}


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    p = Path(spec)
    if not (p / "tokenizer.json").exists() and not (p.is_file() and p.name.endswith(".json")):
        raise ToolError("not_found", f"no tokenizer.json at {spec}", where="/tokenizer",
                        fix="give a local folder holding tokenizer.json (nothing is downloaded), or 'byte'")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ToolError("environment", "the 'tokenizers' package is not installed", where="/tokenizer",
                        fix="pip install tokenizers (tools/setup.sh does), or use tokenizer 'byte'")
    return HFTokenizer(spec)


# ---- workers ------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str, text_key: str, append_eod: bool) -> None:
    _WORKER.update(tok=load_tokenizer(tokenizer), key=text_key, eod=append_eod)


def _encode_batch(batch: list[tuple[str, int, str]]) -> list[tuple[str, int, Any]]:
    """(file, line number, raw line) -> (file, line number, token ids as bytes | reason)."""
    import numpy as np

    tok, key = _WORKER["tok"], _WORKER["key"]
    dtype = np.uint16 if tok.vocab_size < 65500 else np.int32
    out = []
    for name, lineno, raw in batch:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            out.append((name, lineno, f"not JSON: {e.msg} at column {e.colno}"))
            continue
        if not isinstance(obj, dict):
            out.append((name, lineno, f"a JSON {type(obj).__name__}, not an object"))
            continue
        text = obj.get(key)
        if not isinstance(text, str):
            out.append((name, lineno, f"no string field {key!r}" if text is None else
                        f"field {key!r} is a {type(text).__name__}, not a string"))
            continue
        if not text:
            out.append((name, lineno, f"field {key!r} is empty"))
            continue
        ids = tok.encode(text)
        if _WORKER["eod"]:
            ids.append(tok.eod_id)
        out.append((name, lineno, np.asarray(ids, dtype=dtype).tobytes()))
    return out


def _batches(paths: list[str], counts: dict[str, int]) -> Iterator[list[tuple[str, int, str]]]:
    batch: list[tuple[str, int, str]] = []
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    counts["blank"] += 1
                    continue
                batch.append((path, lineno, line))
                if len(batch) == BATCH_LINES:
                    yield batch
                    batch = []
    if batch:
        yield batch


# ---- the tool -----------------------------------------------------------------------
def _paths(prefix: Path) -> dict[str, Path]:
    return {"bin": prefix.with_name(prefix.name + ".bin"), "idx": prefix.with_name(prefix.name + ".idx"),
            "json": prefix.with_name(prefix.name + ".json")}


def _check(req: dict) -> None:
    for i, p in enumerate(req["input"]):
        if not Path(p).is_file():
            raise ToolError("not_found", f"input file {p} does not exist", where=f"/input/{i}",
                            fix="give existing JSONL files")
    parent = Path(req["output_prefix"]).parent
    if parent.exists() and not parent.is_dir():
        raise ToolError("bad_request", f"{parent} is a file, not a folder", where="/output_prefix",
                        fix="choose an output_prefix inside a folder")


def run(req: dict, ctx: Context) -> dict[str, Any]:
    _check(req)
    tokenizer = load_tokenizer(req["tokenizer"])  # fails here, before any work, on a bad tokenizer
    prefix = Path(req["output_prefix"]).resolve()
    files = _paths(prefix)
    rid = ctx.request_id  # type: ignore[attr-defined]
    record = json.loads(files["json"].read_text()) if files["json"].exists() else None
    complete = files["bin"].exists() and files["idx"].exists()
    if record and complete and record.get("request_id") == rid:
        ctx.progress(f"prepare-data: {prefix} was made by this same request; nothing to do")
        return {**record["result"], "already_done": True}
    if (complete or files["bin"].exists()) and not req["overwrite"]:
        raise ToolError("conflict", f"a dataset exists at {prefix} (made by another request)",
                        where="/output_prefix", fix="choose another output_prefix, or set overwrite true")
    workers = req.get("workers") or min(16, os.cpu_count() or 1)
    if ctx.dry_run:
        return {"dry_run": True, "output_prefix": str(prefix), "tokenizer": tokenizer.describe(),
                "actions": [f"read {', '.join(req['input'])}",
                            f"tokenize with {workers} worker process(es)",
                            f"write {files['bin']}, {files['idx']} (temporary names, renamed at the end)",
                            f"write {files['json']}"]}
    try:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
        import numpy as np
        import torch
    except ImportError as e:
        raise ToolError("environment", f"megatron-core is not importable: {e}", where="megatron.core",
                        fix="run tools/setup.sh (Python 3.12, torch, megatron-core)")
    dtype = np.uint16 if tokenizer.vocab_size < 65500 else np.int32
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tmp = {k: files[k].with_name(f"{files[k].name}.tmp{os.getpid()}") for k in ("bin", "idx")}
    for stale in prefix.parent.glob(prefix.name + ".*.tmp*"):
        stale.unlink(missing_ok=True)  # left by a killed run: never a dataset
    counts = {"blank": 0}
    docs_in = docs_out = tokens = 0
    bad: list[dict[str, Any]] = []
    started = last = time.time()
    try:
        builder = IndexedDatasetBuilder(str(tmp["bin"]), dtype=dtype)
        pool = get_context("spawn").Pool(workers, _init_worker,
                                         (req["tokenizer"], req["text_key"], req["append_eod"]))
        with pool:
            for results in pool.imap(_encode_batch, _batches(req["input"], counts)):
                for name, lineno, item in results:
                    docs_in += 1
                    if isinstance(item, str):
                        bad.append({"file": name, "line": lineno, "reason": item})
                        if req["bad_lines"] == "refuse":
                            raise ToolError("bad_request", f"{name} line {lineno}: {item}", where="/input",
                                            fix="fix the line, or set bad_lines 'skip' to report and skip such lines",
                                            details={"file": name, "line": lineno})
                        continue
                    ids = np.frombuffer(item, dtype=dtype)
                    builder.add_document(torch.from_numpy(ids.astype(np.int64)), [len(ids)])
                    docs_out += 1
                    tokens += len(ids)
                if time.time() - last > 2:
                    last = time.time()
                    ctx.progress(f"prepare-data: {docs_in:,} documents, {tokens:,} tokens "
                                 f"({docs_in / (last - started):,.0f} docs/s)")
        builder.finalize(str(tmp["idx"]))
        if files["idx"].exists():
            files["idx"].unlink()  # the index goes first: a .bin without .idx is not a dataset
        os.replace(tmp["bin"], files["bin"])
        os.replace(tmp["idx"], files["idx"])
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
    assert docs_in == docs_out + len(bad)
    desc = tokenizer.describe()
    training: dict[str, Any] = {"data_path": [str(prefix)]}
    if desc["type"] == "huggingface":
        training["tokenizer_model"] = desc["path"]
    result = {"output_prefix": str(prefix), "files": [str(files["bin"]), str(files["idx"]), str(files["json"])],
              "documents_in": docs_in, "documents_out": docs_out, "bad_line_count": len(bad),
              "bad_lines": bad[:MAX_REPORTED], "blank_lines": counts["blank"], "tokens": tokens,
              "tokenizer": desc, "dtype": np.dtype(dtype).name, "seconds": round(time.time() - started, 2),
              "training": training}
    files["json"].write_text(json.dumps({"request_id": rid, "request": req, "result": result}, indent=1))
    ctx.progress(f"prepare-data: {docs_out:,} documents, {tokens:,} tokens -> {prefix}.bin/.idx"
                 + (f"; {len(bad)} bad line(s) skipped" if bad else ""))
    return result


def dataset_record(prefix: str) -> dict[str, Any] | None:
    """What prepare-data recorded about a dataset (PREFIX.json), or None for other datasets
    (and for a prefix with no file name of its own, such as "/" or ".")."""
    if not Path(prefix).name:
        return None
    p = _paths(Path(prefix))["json"]
    try:
        return json.loads(p.read_text())["result"]
    except (OSError, ValueError, KeyError):
        return None


def match_tokenizer(training: dict[str, Any], model_vocab: int) -> dict[str, Any]:
    """Training settings with the tokenizer flags that match datasets made by prepare-data:
    a Hugging Face dataset gets its tokenizer folder, a byte dataset NullTokenizer with
    vocabulary 257 (end of document 256).  Datasets made elsewhere are left as they are."""
    out = dict(training)
    for i, entry in enumerate(training.get("data_path") or []):
        rec = dataset_record(entry)
        if rec is None:
            continue
        tok = rec["tokenizer"]
        if tok["vocab_size"] > model_vocab:
            raise ToolError("bad_request", f"dataset {entry} was tokenized with a {tok['vocab_size']}-token "
                            f"vocabulary, larger than the model's {model_vocab}", where=f"/training/data_path/{i}",
                            fix="use a model with a vocabulary at least that large, or re-tokenize")
        if tok["type"] == "huggingface":
            if out.get("tokenizer_model") not in (None, tok["path"]):
                raise ToolError("bad_request", f"dataset {entry} was tokenized with {tok['path']}, not "
                                f"{out['tokenizer_model']}", where="/training/tokenizer_model",
                                fix="train with the tokenizer the dataset was made with")
            out["tokenizer_model"] = tok["path"]
        elif tok["type"] == "byte" and "vocab_size" not in training and not out.get("tokenizer_model"):
            out["vocab_size"] = tok["vocab_size"]
    return out


TOOL = register(Tool(name="prepare-data", summary="Tokenize JSONL into a Megatron indexed dataset (.bin/.idx) "
                     "with megatron-core's builder; bad lines reported; atomic; byte or local HF tokenizer.",
                     run=run, acts=True))
