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

import errno
import gzip
import json
import os
import re
import time
import zlib
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator

from .. import files as guarded
from ..contract import Context, Tool
from ..data.datasets import MADE_BY, dataset_files, file_facts, read_record
from ..errors import ToolError
from ..locks import Busy, FileLock, NotALockFile, not_a_lock, write_atomic

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

    def chat_template(self):
        from ..data.chat import BYTE_TEMPLATE, ChatTemplate
        return ChatTemplate(BYTE_TEMPLATE)

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        """Token ids of the pieces' text, and 1 for each token of a piece to learn."""
        ids: list[int] = []
        learn: list[int] = []
        for text, on in pieces:
            part = self.encode(text)
            ids += part
            learn += [int(on)] * len(part)
        return ids, learn


class HFTokenizer:
    """A local Hugging Face tokenizer.json through the `tokenizers` library (no transformers,
    no hub); end of document is the tokenizer's EOS (or EOD) token."""
    EOS_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")

    def __init__(self, file: Path):
        from tokenizers import Tokenizer

        self.file = file
        text = guarded.read_text(file, "/tokenizer", "tokenizer.json", limit=guarded.TOKENIZER_LIMIT)
        try:
            self.tok = Tokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 -- the tokenizers library raises its own error types
            raise ToolError("bad_request", f"{file} is not a tokenizer.json the tokenizers library reads: {e}",
                            where="/tokenizer", fix="give the tokenizer.json saved with the model") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._eos(file.parent)

    def _eos(self, folder: Path) -> int:
        cfg = folder / "tokenizer_config.json"
        names = list(self.EOS_NAMES)
        if guarded.kind_of(cfg) != "missing":
            eos = guarded.read_json_object(cfg, "/tokenizer", "tokenizer_config.json").get("eos_token")
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if eos is not None and not isinstance(eos, str):
                raise ToolError("bad_request", f"{cfg}'s eos_token is a JSON {type(eos).__name__}, not the token's "
                                "text", where="/tokenizer", fix='give eos_token as text (e.g. "</s>") or as '
                                '{"content": "</s>"}, as transformers writes it')
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

    def chat_template(self):
        from ..data.chat import ChatTemplate, template_of
        try:
            return ChatTemplate(*template_of(self.file.parent))
        except ValueError as e:
            raise ToolError("bad_request", str(e), where="/tokenizer",
                            fix="use the tokenizer folder of the chat model (its tokenizer_config.json has a "
                                "chat_template), or format text") from None

    def encode_pieces(self, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[int]]:
        """Token ids of the whole text (as the model will see it: no seams at piece borders), and 1
        for each token that starts inside a piece to learn."""
        text = "".join(t for t, _ in pieces)
        learn_at = bytearray(len(text))
        pos = 0
        for t, on in pieces:
            if on:
                learn_at[pos:pos + len(t)] = b"\x01" * len(t)
            pos += len(t)
        enc = self.tok.encode(text, add_special_tokens=False)
        return enc.ids, [learn_at[start] if start < len(text) else 0 for start, _ in enc.offsets]

    def describe(self) -> dict[str, Any]:
        return {"type": "huggingface", "path": str(self.file.parent), "vocab_size": self.vocab_size,
                "eod_id": self.eod_id}


class SentencePieceModel:
    """A SentencePiece .model file, tokenized by Megatron's own wrapper (the one its
    SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer types build, with their
    defaults): the ids Megatron's training sees for --tokenizer-model FILE. End of document is the
    model's EOS."""

    def __init__(self, file: Path):
        try:
            from megatron.core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer
        except ImportError as e:
            raise ToolError("environment", f"a SentencePiece model needs the 'sentencepiece' package ({e})",
                            where="/tokenizer", fix="pip install sentencepiece (tools/setup.sh does)") from None
        guarded.regular_file(file, "/tokenizer", "SentencePiece model")  # not a pipe, device or folder
        try:
            self.tok = SentencePieceTokenizer(str(file))
        except Exception as e:  # noqa: BLE001 -- sentencepiece raises RuntimeError/OSError of its own wording
            raise ToolError("bad_request", f"{file} is not a SentencePiece model: {str(e)[:300]}", where="/tokenizer",
                            fix="give the tokenizer.model saved with the model") from None
        self.file = file
        self.vocab_size = self.tok.vocab_size
        self.eod_id = self.tok.eos_id
        if self.eod_id is None or self.eod_id < 0:
            raise ToolError("bad_request", f"{file} has no end-of-sentence piece", where="/tokenizer",
                            fix="use a model trained with an eos piece, or set append_eod false")

    def encode(self, text: str) -> list[int]:
        return self.tok.text_to_ids(text)

    def chat_template(self):
        raise ToolError("bad_request", "a SentencePiece model file carries no chat template", where="/tokenizer",
                        fix="give the model's Hugging Face tokenizer folder (tokenizer.json and tokenizer_config.json "
                            "with a chat_template) for chat data")

    def describe(self) -> dict[str, Any]:
        return {"type": "sentencepiece", "path": str(self.file), "vocab_size": self.vocab_size, "eod_id": self.eod_id}


def load_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    p = guarded.check_names(spec, "/tokenizer")
    folder = guarded.kind_of(p) == "folder"
    file = p / "tokenizer.json" if folder else p
    if folder and guarded.kind_of(file) == "missing" and guarded.kind_of(p / "tokenizer.model") != "missing":
        file = p / "tokenizer.model"          # a SentencePiece model alone (Llama 2, Mistral's first models)
    if file.name.endswith(".model") and guarded.kind_of(file) != "missing":
        return SentencePieceModel(file)
    if guarded.kind_of(file) == "missing" or not file.name.endswith(".json"):
        raise ToolError("not_found", f"no tokenizer.json or SentencePiece .model at {spec}", where="/tokenizer",
                        fix="give a local folder holding tokenizer.json or tokenizer.model, or a .model file "
                            "(nothing is downloaded), or 'byte'")
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise ToolError("environment", "the 'tokenizers' package is not installed", where="/tokenizer",
                        fix="pip install tokenizers (tools/setup.sh does), or use tokenizer 'byte'") from None
    return HFTokenizer(file)


# ---- workers ------------------------------------------------------------------------
_WORKER: dict[str, Any] = {}


def _init_worker(tokenizer: str, text_key: str, append_eod: bool, dtype: str, chat: bool = False) -> None:
    tok = load_tokenizer(tokenizer)
    _WORKER.update(tok=tok, key=text_key, eod=append_eod, dtype=dtype, chat=tok.chat_template() if chat else None)


def _encode_batch(batch: list[tuple[str, int, bytes]]) -> list[tuple[str, int, Any]]:
    """(file, line number, raw line) -> (file, line number, token ids as bytes | reason); in the
    chat format the ids and the loss mask (uint8) as a pair of bytes."""
    import numpy as np

    tok, key, dtype = _WORKER["tok"], _WORKER["key"], _WORKER["dtype"]
    out = []
    for name, lineno, raw in batch:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            out.append((name, lineno, f"not UTF-8: byte 0x{raw[e.start]:02x} at column {e.start + 1}"))
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            out.append((name, lineno, f"not JSON: {e.msg} at column {e.colno}"))
            continue
        if not isinstance(obj, dict):
            out.append((name, lineno, f"a JSON {type(obj).__name__}, not an object"))
            continue
        if _WORKER["chat"] is not None:
            out.append((name, lineno, _encode_chat(obj, tok, np, dtype)))
            continue
        text = obj.get(key)
        if not isinstance(text, str):
            out.append((name, lineno, f"no string field {key!r}" if text is None else
                        f"field {key!r} is a {type(text).__name__}, not a string"))
            continue
        if not text:
            out.append((name, lineno, f"field {key!r} is empty"))
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            out.append((name, lineno, f"field {key!r} holds a lone surrogate (\\u{ord(text[e.start]):04x} at "
                        f"character {e.start + 1}): not Unicode text"))
            continue
        ids = tok.encode(text)
        if _WORKER["eod"]:
            ids.append(tok.eod_id)
        out.append((name, lineno, np.asarray(ids, dtype=dtype).tobytes()))
    return out


def _batches(paths: list[str], counts: dict[str, int],
             problems: list[ToolError]) -> Iterator[list[tuple[str, int, bytes]]]:
    """Lines as bytes: each is decoded by a worker, so a line that is not UTF-8 is reported
    as a bad line instead of being silently altered. An input that cannot be read to its end (a
    truncated or corrupt .gz) ends the batches and is put in problems: this generator runs in the
    pool's feeder thread, which cannot carry the error itself."""
    batch: list[tuple[str, int, bytes]] = []
    for i, path in enumerate(paths):
        try:
            for lineno, line in _lines(path, f"/input/{i}"):
                if not line.strip():
                    counts["blank"] += 1
                    continue
                batch.append((path, lineno, line))
                if len(batch) == BATCH_LINES:
                    yield batch
                    batch = []
        except ToolError as e:
            problems.append(e)
            return
    if batch:
        yield batch


def _lines(path: str, where: str) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of one input file, a regular file read through gzip when it ends in
    .gz; a ToolError for a compressed stream that is cut short or damaged."""
    with guarded.open_stream(path, where, "input file") as raw:
        f = gzip.GzipFile(fileobj=raw, mode="rb") if path.endswith(".gz") else raw
        try:
            yield from enumerate(f, 1)
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise ToolError("bad_request", f"{path} is not a whole gzip file ({e or type(e).__name__})", where=where,
                            fix="give the complete .gz file (or the JSONL uncompressed)") from None


def _encode_chat(obj: dict, tok, np, dtype) -> Any:
    """One conversation through the chat template: (ids, mask) as bytes, or why not."""
    from ..data.chat import messages_of

    messages = messages_of(obj)
    if isinstance(messages, str):
        return messages
    try:
        pieces = _WORKER["chat"].pieces(messages)
        "".join(t for t, _ in pieces).encode("utf-8")
    except ValueError as e:  # UnicodeEncodeError is one: a lone surrogate in a message
        return f"not Unicode text: {e}" if isinstance(e, UnicodeEncodeError) else str(e)
    ids, mask = tok.encode_pieces(pieces)
    if not any(mask):
        return "the reply has no tokens of its own after the template"
    if _WORKER["eod"]:
        ids.append(tok.eod_id)
        mask.append(0)
    return np.asarray(ids, dtype=dtype).tobytes(), np.asarray(mask, dtype=np.uint8).tobytes()


# ---- the tool -----------------------------------------------------------------------
GLOB_CHARS = set("*?[]")


# A run's temporaries are PREFIX's own names with a token of the run (pid-hex) between a leading dot
# and .tmp; the record's is written atomically once more (locks.write_atomic adds .PID.tmp), as is
# the journal. Only these names are ever removed as leftovers, and only beside the prefix.
TOKEN = r"\d+-[0-9a-f]+"
OWN_NAME_ROOM = 48  # what the longest of these names adds to the prefix's name
DATASET_KINDS = ("bin", "idx", "json", "mask_bin", "mask_idx")


def _temp_name(files: dict[str, Path], kind: str) -> re.Pattern:
    return re.compile(re.escape(f".{files[kind].name}.") + TOKEN + re.escape(".tmp"))


def _leftover_names(files: dict[str, Path]) -> list[re.Pattern]:
    """The names of what a killed run of this prefix can leave behind besides its journal's temporaries."""
    return [*(_temp_name(files, k) for k in DATASET_KINDS),
            re.compile(re.escape(f"..{files['json'].name}.") + TOKEN + r"\.tmp\.\d+\.tmp"),
            re.compile(re.escape(f".{files['journal'].name}.") + r"\d+\.tmp")]


def _paths(prefix: Path) -> dict[str, Path]:
    """The dataset's files, and the two of the tool's own beside them: a lock (kept, never
    written) and the journal of a run in progress (removed when it ends)."""
    name = prefix.name
    return {**dataset_files(prefix), "lock": prefix.with_name(f".{name}.prepare-data.lock"),
            "journal": prefix.with_name(f".{name}.prepare-data.journal")}


def _check(req: dict) -> Path:
    for i, p in enumerate(req["input"]):
        guarded.regular_file(p, f"/input/{i}", "input file")
    raw = req["output_prefix"]
    prefix = Path(raw)
    if raw.endswith(("/", "/.", "/..")) or prefix.name in ("", ".", "..") or guarded.kind_of(prefix) == "folder":
        raise ToolError("bad_request", f"output_prefix {raw!r} names a folder, not a file prefix",
                        where="/output_prefix", fix=f"add a file name: {raw.rstrip('/') or '.'}/corpus writes "
                        "corpus.bin, corpus.idx and corpus.json there")
    if GLOB_CHARS & set(prefix.name):
        raise ToolError("bad_request", f"output_prefix {raw!r} holds a glob character (* ? [ ])",
                        where="/output_prefix", fix="choose a prefix of letters, digits, '-', '_' and '.'")
    guarded.check_names(prefix, "/output_prefix", room=OWN_NAME_ROOM)
    guarded.output_folder(prefix.absolute().parent, "/output_prefix", "folder of the output_prefix")
    workers = req.get("workers")
    if workers is not None and workers > (os.cpu_count() or 1):
        raise ToolError("bad_request", f"workers {workers} is more than the {os.cpu_count()} CPUs here",
                        where="/workers", fix=f"give at most {os.cpu_count()}, or leave it out")
    try:
        return prefix.resolve()
    except (OSError, RuntimeError):  # a symbolic link loop (RuntimeError before Python 3.13)
        raise ToolError("bad_request", f"output_prefix {raw!r} is a symbolic link that loops", where="/output_prefix",
                        fix="give a prefix that is no symbolic link, or one that leads somewhere") from None


def _recover(files: dict[str, Path]) -> None:
    """Finish or undo what a killed run left, from its journal (under the lock, so that run is
    gone): a run that was committing is rolled forward; one that was writing has its
    temporaries removed. Only the exact names the journal recorded are touched."""
    if guarded.kind_of(files["journal"]) != "missing":
        journal = _read_journal(files)
        if journal is not None:
            if journal["phase"] == "committing":
                _commit(files, journal["temps"])
            for t in journal["temps"].values():
                t.unlink(missing_ok=True)
        files["journal"].unlink(missing_ok=True)  # done with, or names nothing we may touch
    _remove_leftovers(files)


def _read_journal(files: dict[str, Path]) -> dict[str, Any] | None:
    """The journal of a killed run, when every name it holds is one of this tool's temporaries
    for this prefix, in the prefix's folder; None for anything else (unreadable, or naming
    another file: a journal never makes the tool move or remove a file that is not its own)."""
    journal = guarded.read_record(files["journal"])
    if journal is None or journal.get("phase") not in ("writing", "committing"):
        return None
    named = journal.get("temps")
    if not isinstance(named, dict) or not named or not set(named) <= set(DATASET_KINDS):
        return None
    temps = {}
    for kind, value in named.items():
        path = Path(value) if isinstance(value, str) else None
        if path is None or path.parent != files[kind].parent or not _temp_name(files, kind).fullmatch(path.name):
            return None
        temps[kind] = path
    return {"phase": journal["phase"], "temps": temps}


def _remove_leftovers(files: dict[str, Path]) -> None:
    """Remove what killed runs of this prefix left under the tool's own temporary names (the
    caller holds the prefix's lock: no run of it is writing them now)."""
    patterns = _leftover_names(files)
    for entry in os.scandir(files["bin"].parent):
        if entry.name.startswith(".") and entry.name.endswith(".tmp") and any(
                p.fullmatch(entry.name) for p in patterns) and entry.is_file(follow_symlinks=False):
            Path(entry.path).unlink(missing_ok=True)


def _commit(files: dict[str, Path], temps: dict[str, Path]) -> None:
    """Put the files in place as one: the old record goes first (no record may describe
    other data), then .bin, .idx, and the new record last. Each step can be repeated, so a
    run killed half-way is finished by the next one (_recover). A loss mask the old record lists
    goes too when the new dataset has none (a chat dataset replaced by text)."""
    old, _ = read_record(files)
    listed = set((old or {}).get("result", {}).get("files", []))
    if temps["json"].exists():
        files["json"].unlink(missing_ok=True)
    for kind in ("mask_bin", "mask_idx"):
        if kind not in temps and str(files[kind]) in listed:
            files[kind].unlink(missing_ok=True)
    for kind in ("bin", "idx", "mask_bin", "mask_idx", "json"):
        if kind in temps and temps[kind].exists():
            os.replace(temps[kind], files[kind])


def _write_journal(files: dict[str, Path], temps: dict[str, Path], phase: str) -> None:
    write_atomic(files["journal"], json.dumps({"phase": phase, "temps": {k: str(v) for k, v in temps.items()}}))


def run(req: dict, ctx: Context) -> dict[str, Any]:
    prefix = _check(req)
    tokenizer = load_tokenizer(req["tokenizer"])  # fails here, before any work, on a bad tokenizer
    if req["format"] == "chat":
        tokenizer.chat_template()  # and on a tokenizer without a chat template (a worker must not fail)
    files = _paths(prefix)
    rid = ctx.request_id
    workers = req.get("workers") or min(16, os.cpu_count() or 1)
    if ctx.dry_run:
        _decide(req, files, rid, ctx, dry_run=True)
        return {"dry_run": True, "output_prefix": str(prefix), "tokenizer": tokenizer.describe(),
                "actions": [f"read {', '.join(req['input'])}",
                            f"tokenize with {workers} worker process(es)",
                            f"write {', '.join(str(files[k]) for k in _written(req))} under temporary names, "
                            "then rename them into place together (the record last)"]}
    try:
        import numpy as np
        import torch
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except ImportError as e:
        raise ToolError("environment", f"megatron-core is not importable: {e}", where="megatron.core",
                        fix="run tools/setup.sh (Python 3.12, torch, megatron-core)") from None
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise guarded.os_error(e, prefix.parent, "/output_prefix", "output folder") from None
    try:
        lock = FileLock(files["lock"]).acquire()
    except Busy:
        raise ToolError("conflict", f"another prepare-data run is writing {prefix}", where="/output_prefix",
                        fix="wait for it to finish, or choose another output_prefix") from None
    except OSError as e:
        if isinstance(e, NotALockFile) or e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise not_a_lock(files["lock"], "/output_prefix") from None
        # no lock can be made there: a folder this user may not write, a read-only file system, a full disk
        raise ToolError("bad_request", f"cannot write in {prefix.parent}: {e.strerror or e}", where="/output_prefix",
                        fix="give an output_prefix in a folder this user may write, on a disk with room") from None
    try:
        _recover(files)
        done = _decide(req, files, rid, ctx, dry_run=False)
        if done is not None:
            return done
        return _build(req, ctx, tokenizer, files, workers, rid, DType.optimal_dtype(tokenizer.vocab_size),
                      IndexedDatasetBuilder, np, torch)
    finally:
        lock.release()


def _decide(req: dict, files: dict[str, Path], rid: str, ctx: Context, dry_run: bool) -> dict[str, Any] | None:
    """The recorded result when this same request made the dataset; an error when another
    request's dataset (or a file that is not ours) is in the way; None to go ahead."""
    record, status = read_record(files)
    complete = files["bin"].exists() and files["idx"].exists()
    if status == "ok" and complete and record.get("request_id") == rid:  # type: ignore[union-attr]
        if record.get("inputs", _inputs(req)) == _inputs(req):  # type: ignore[union-attr]
            ctx.progress(f"prepare-data: {files['bin'].with_suffix('')} was made by this same request; nothing to do")
            return {**record["result"], "already_done": True}  # type: ignore[index]
        ctx.progress(f"prepare-data: the input changed since {files['bin'].with_suffix('')} was made; making it again")
        return None  # this request's own dataset, from inputs that changed since: made again
    if status == "foreign":
        raise ToolError("conflict", f"{files['json']} exists and was not written by prepare-data",
                        where="/output_prefix", fix="choose another output_prefix (that file is left as it is)")
    # what this run writes and finds in place: ours only where prepare-data's record lists it (a
    # file with no record beside it, or a loss mask the record does not name, is someone else's)
    writes = ("bin", "idx") + (("mask_bin", "mask_idx") if req["format"] == "chat" else ())
    listed = {Path(f).name for f in (record or {}).get("result", {}).get("files", ())} if status != "missing" else set()
    theirs = [files[k] for k in writes if guarded.kind_of(files[k]) != "missing" and files[k].name not in listed]
    if theirs:
        raise ToolError("conflict", f"{', '.join(map(str, theirs))} exist(s) and prepare-data did not write "
                        f"{'it' if len(theirs) == 1 else 'them'} (no record of it beside the dataset)",
                        where="/output_prefix", fix="choose another output_prefix (those files are left as they are)")
    if (complete or files["bin"].exists() or files["idx"].exists()) and not req["overwrite"]:
        why = "its record no longer matches its files" if status == "stale" else "made by another request"
        raise ToolError("conflict", f"a dataset exists at {files['bin'].with_suffix('')} ({why})",
                        where="/output_prefix", fix="choose another output_prefix, or set overwrite true")
    return None


def _written(req: dict) -> tuple[str, ...]:
    """The kinds of file a run of this request writes: the tokens, the record, the chat format's mask."""
    return ("bin", "idx", "json") + (("mask_bin", "mask_idx") if req["format"] == "chat" else ())


def _inputs(req: dict) -> dict[str, list[int]]:
    """The input files' sizes and modification times: the recorded result stands while they hold."""
    return guarded.fingerprint([Path(p) for p in req["input"]])


def _build(req, ctx, tokenizer, files, workers, rid, dtype, IndexedDatasetBuilder, np, torch) -> dict[str, Any]:
    token = f"{os.getpid()}-{os.urandom(4).hex()}"
    chat = req["format"] == "chat"
    kinds = _written(req)
    temps = {k: files[k].with_name(f".{files[k].name}.{token}.tmp") for k in kinds}
    _write_journal(files, temps, "writing")  # first: whatever is made next can be found and removed
    inputs = _inputs(req)  # before reading them: a change while the run reads is seen by the next
    counts = {"blank": 0}
    problems: list[ToolError] = []
    started = last = time.time()
    try:
        writer = _DatasetWriter(IndexedDatasetBuilder(str(temps["bin"]), dtype=dtype),
                                IndexedDatasetBuilder(str(temps["mask_bin"]), dtype=np.uint8) if chat else None,
                                dtype, np, torch, refuse_bad=req["bad_lines"] == "refuse")
        pool = get_context("spawn").Pool(workers, _init_worker, (req["tokenizer"], req["text_key"],
                                                                  req["append_eod"], np.dtype(dtype).name, chat))
        with pool:
            for results in pool.imap(_encode_batch, _batches(req["input"], counts, problems)):
                for name, lineno, item in results:
                    writer.add(name, lineno, item)
                if time.time() - last > 2:
                    last = time.time()
                    ctx.progress(f"prepare-data: {writer.documents_in:,} documents, {writer.tokens:,} tokens "
                                 f"({writer.documents_in / (last - started):,.0f} docs/s)")
        if problems:
            raise problems[0]
        writer.finalize(temps)
        result = _result(req, tokenizer.describe(), files, writer, counts["blank"], np.dtype(dtype).name, started)
        facts = file_facts({"bin": temps["bin"], "idx": temps["idx"]})
        write_atomic(temps["json"], json.dumps({"made_by": MADE_BY, "request_id": rid, "request": req,
                                                "files": facts, "inputs": inputs, "result": result}, indent=1))
        _write_journal(files, temps, "committing")  # from here on the dataset is done: roll forward
        _commit(files, temps)
        files["journal"].unlink(missing_ok=True)
    except BaseException:
        if (guarded.read_record(files["journal"]) or {}).get("phase") != "committing":
            for t in temps.values():
                t.unlink(missing_ok=True)
            files["journal"].unlink(missing_ok=True)
        raise
    ctx.progress(f"prepare-data: {writer.documents_out:,} documents, {writer.tokens:,} tokens -> "
                 f"{result['output_prefix']}.bin/.idx" + (f"; {len(writer.bad)} bad line(s) skipped" if writer.bad else ""))
    return result


class _DatasetWriter:
    """The workers' documents into Megatron's dataset builders (the tokens, and in the chat format
    the loss masks), in input order, counted; a bad line reported (or refused, with bad_lines 'refuse')."""

    def __init__(self, builder, masks, dtype, np, torch, refuse_bad: bool):
        self.builder, self.masks, self.dtype, self.np, self.torch = builder, masks, dtype, np, torch
        self.refuse_bad = refuse_bad
        self.documents_in = self.documents_out = self.tokens = self.learned = 0
        self.bad: list[dict[str, Any]] = []

    def add(self, name: str, lineno: int, item: Any) -> None:
        """One line's worker answer: its token ids as bytes (with the mask's in the chat format), or why not."""
        np, torch = self.np, self.torch
        self.documents_in += 1
        if isinstance(item, str):
            self.bad.append({"file": name, "line": lineno, "reason": item})
            if self.refuse_bad:
                raise ToolError("bad_request", f"{name} line {lineno}: {item}", where="/input",
                                fix="fix the line, or set bad_lines 'skip' to report and skip such lines",
                                details={"file": name, "line": lineno})
            return
        if self.masks is not None:
            item, mask_bytes = item
            mask = np.frombuffer(mask_bytes, dtype=np.uint8)
            self.masks.add_document(torch.from_numpy(mask.astype(np.int64)), [len(mask)])
            self.learned += int(mask.sum())
        ids = np.frombuffer(item, dtype=self.dtype)
        self.builder.add_document(torch.from_numpy(ids.astype(np.int64)), [len(ids)])
        self.documents_out += 1
        self.tokens += len(ids)

    def finalize(self, temps: dict[str, Path]) -> None:
        self.builder.finalize(str(temps["idx"]))
        if self.masks is not None:
            self.masks.finalize(str(temps["mask_idx"]))
        assert self.documents_in == self.documents_out + len(self.bad)


def _result(req: dict, tokenizer: dict[str, Any], files: dict[str, Path], writer: _DatasetWriter, blank_lines: int,
            dtype_name: str, started: float) -> dict[str, Any]:
    """prepare-data's answer (and the record's result): the files, the counts, the tokenizer, and
    the training fields that read the dataset."""
    chat = req["format"] == "chat"
    training: dict[str, Any] = {"data_path": [str(files["bin"].with_suffix(""))]}
    if tokenizer["type"] == "huggingface":
        training["tokenizer_model"] = tokenizer["path"]
    elif tokenizer["type"] == "sentencepiece":
        training.update(tokenizer_model=tokenizer["path"], tokenizer_type="SentencePieceTokenizer")
    return {"output_prefix": str(files["bin"].with_suffix("")), "format": req["format"],
            "files": [str(files[k]) for k in _written(req)],
            **({"learned_tokens": writer.learned} if chat else {}),
            "documents_in": writer.documents_in, "documents_out": writer.documents_out,
            "bad_line_count": len(writer.bad), "bad_lines": writer.bad[:MAX_REPORTED], "blank_lines": blank_lines,
            "tokens": writer.tokens, "tokenizer": tokenizer, "dtype": dtype_name,
            "seconds": round(time.time() - started, 2), "training": training}


TOOL = Tool(name="prepare-data", summary="Tokenize JSONL into a Megatron indexed dataset (.bin/.idx) "
                     "with megatron-core's builder; bad lines reported; atomic; byte, local HF or SentencePiece tokenizer.",
                     run=run)
