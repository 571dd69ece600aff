"""Checkpoints are pickles: what a folder a request names holds is read before anything loads it.

A torch_dist checkpoint's `.metadata` is loaded by torch.distributed.checkpoint with pickle.load,
and a legacy checkpoint's `mp_rank_*` files by torch.load(weights_only=False) (Megatron's loader
and the conversion's): a forged file there runs whatever code it names the moment it is read, a
dry run included. scan_checkpoint reads every pickle of a checkpoint folder without running it
(pickletools: the opcodes only) and refuses one that names any global outside what Megatron,
torch's distributed checkpoint and numpy write: the tools call it on a checkpoint a request names
before loading it.
"""
from __future__ import annotations

import io
import os
import pickletools
import zipfile
from pathlib import Path

from . import files
from .errors import ToolError

PICKLE_LIMIT = 256 * files.MiB   # the pickled part of one file (tensors are stored beside it in a .pt zip)

# Exact globals a checkpoint may name: torch's tensor and storage rebuilders and types, the
# distributed checkpoint's metadata classes, numpy's array rebuilders (Megatron keeps numpy's RNG
# state), the containers and Megatron's argument Namespace.
ALLOWED = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("argparse", "Namespace"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"), ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"),
    ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "str"), ("builtins", "bytes"),
    ("builtins", "object"), ("copyreg", "_reconstructor"), ("_codecs", "encode"), ("io", "BytesIO"),
    ("torch", "Size"), ("torch", "device"), ("torch", "dtype"), ("torch", "memory_format"), ("torch", "layout"),
    ("torch", "Tensor"), ("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout"),
    ("torch._tensor", "_rebuild_from_type_v2"), ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("numpy.random._pickle", "__randomstate_ctor"),
    ("numpy.random._pickle", "__bit_generator_ctor"), ("numpy.random._pickle", "__generator_ctor"),
    ("numpy.random.mtrand", "RandomState"), ("numpy.random._mt19937", "MT19937"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
}
# Modules each of whose names a checkpoint may name: torch's rebuild helpers, dtypes and storage
# types (torch.bfloat16, torch.FloatStorage), the distributed checkpoint's metadata, and the
# enumerations and config dataclasses of Megatron and Transformer Engine that an argument dump holds.
ALLOWED_NAMES = {
    "torch._utils": lambda name: name.startswith("_rebuild_"),
    "torch": lambda name: name.endswith("Storage") or name in _DTYPES,
    "torch.distributed.checkpoint.metadata": lambda name: True,
    "torch.distributed.checkpoint.filesystem": lambda name: name == "_StorageInfo",
    "torch.distributed.checkpoint.planner": lambda name: name in (
        "LoadItemType", "WriteItemType", "SavePlan", "LoadPlan", "WriteItem", "ReadItem", "TensorWriteData",
        "BytesIOWriteData"),
    "numpy.dtypes": lambda name: name.endswith("DType"),
}
_DTYPES = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int64", "int32", "int16",
           "int8", "uint8", "bool", "complex64", "complex128", "double", "float", "half", "long", "int", "short"}


def _allowed(module: str, name: str) -> bool:
    if (module, name) in ALLOWED:
        return True
    check = ALLOWED_NAMES.get(module)
    if check is not None:
        return check(name)
    # Megatron's and Transformer Engine's enumerations (AttnBackend, ModelType, Format, ...) in an
    # argument dump: an Enum called with its value, nothing more. The module is one of the
    # installed packages (importing it runs only their own code).
    if not module.startswith(("megatron.", "transformer_engine.")) or not name[:1].isupper():
        return False
    import enum
    import importlib

    try:
        value = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 -- not installed here, or no such name: not allowed
        return False
    return isinstance(value, type) and issubclass(value, enum.Enum)


def globals_named(data: bytes) -> list[tuple[str, str]]:
    """Every (module, name) the pickle data names, read from its opcodes without running it:
    GLOBAL and INST carry them, STACK_GLOBAL takes the two strings pushed before it (directly or
    from the memo)."""
    found: list[tuple[str, str]] = []
    memo: dict[int, object] = {}
    recent: list[object] = []   # the values the last opcodes pushed (strings only matter)
    for op, arg, _ in pickletools.genops(io.BytesIO(data)):
        name = op.name
        if name in ("GLOBAL", "INST"):
            module, _, attr = str(arg).partition(" ")
            found.append((module, attr))
            recent.append(None)
        elif name == "STACK_GLOBAL":
            module, attr = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
            if not isinstance(module, str) or not isinstance(attr, str):
                found.append(("?", "a global whose name is computed"))
            else:
                found.append((module, attr))
            recent.append(None)
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
                      "STRING"):
            recent.append(arg)
        elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
            memo[int(arg)] = recent[-1] if recent else None
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            recent.append(memo.get(int(arg)))
        elif name in ("FRAME", "PROTO", "STOP"):
            continue
        else:
            recent.append(None)
        if len(recent) > 64:
            del recent[:-8]
    return found


def _pickled_parts(path: Path) -> list[tuple[str, bytes]]:
    """The pickles a checkpoint file holds: a torch.save zip's data.pkl (and any other .pkl in it),
    or the file itself."""
    data = files.read_regular(path, PICKLE_LIMIT) if not zipfile.is_zipfile(path) else None
    if data is not None:
        return [(str(path), data)]
    with zipfile.ZipFile(path) as archive:
        out = []
        for info in archive.infolist():
            if info.filename.endswith(".pkl"):
                if info.file_size > PICKLE_LIMIT:
                    raise files.TooLarge(f"{path}:{info.filename} is larger than {PICKLE_LIMIT} bytes")
                out.append((f"{path}:{info.filename}", archive.read(info)))
        return out


def _pickle_files(folder: Path) -> list[Path]:
    """The files of a checkpoint folder (one iteration's, or a whole checkpoint's) that are read as
    pickles: .metadata, *.pt (common.pt, mp_rank_XX.pt, mp_rank_XX/model_optim_rng.pt)."""
    out: list[Path] = []
    for top, dirs, names in os.walk(folder):
        depth = Path(top).relative_to(folder).parts
        if len(depth) >= 3:
            dirs[:] = []
            continue
        for name in names:
            if name == ".metadata" or name.endswith((".pt", ".pth", ".pkl")):
                out.append(Path(top) / name)
    return sorted(out)


def scan_checkpoint(folder: str | Path, where: str) -> None:
    """Refuse a checkpoint folder one of whose pickles names a global no checkpoint holds (it would
    run code as it is read), or that cannot be read as a pickle at all."""
    folder = Path(folder)
    for path in _pickle_files(folder):
        try:
            parts = _pickled_parts(path)
            for shown, data in parts:
                bad = sorted({f"{m}.{n}" for m, n in globals_named(data) if not _allowed(m, n)})
                if bad:
                    raise ToolError("bad_request", f"{shown} is no checkpoint Megatron or torch wrote: its pickle "
                                    f"names {', '.join(bad[:5])}, which loading it would call (code that runs as the "
                                    "file is read); nothing was loaded", where=where,
                                    fix="give a checkpoint written by Megatron, torch or this skill (and find out "
                                    "who put this file there)")
        except ToolError:
            raise
        except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError, IndexError, TypeError) as e:
            raise ToolError("bad_request", f"{path} cannot be read as a checkpoint file: {e}", where=where,
                            fix="give a checkpoint written by Megatron, torch or this skill") from None
