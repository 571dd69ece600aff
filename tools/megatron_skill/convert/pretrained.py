"""Training from a pretrained checkpoint: what train and render check and pass to Megatron.

Megatron loads --pretrained-checkpoint when the run's own --load folder has no checkpoint yet,
with --finetune's semantics (weights only; iteration 0, fresh optimizer and RNG); once the run
has saved, it resumes from its own checkpoints. The vocabulary must pad to the size the
checkpoint holds: the skill's imports pad as Megatron does at TP 1 (a multiple of 128), and a
run at TP t passes --make-vocab-size-divisible-by (that size / t), which pads to the same rows.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import files as guarded
from ..core import catalog
from ..core.resolve import training_defaults, with_training_defaults
from ..errors import ToolError
from . import checkpoint, output

WHERE = "/training/pretrained"


def same_model(hf_folder: Path, model, where: str, what: str) -> None:
    """A bad_request when the Hugging Face model in hf_folder is not the request's model (its shape)."""
    from ..core.model import from_hf_config

    theirs = from_hf_config(hf_folder)
    mine = {k: v for k, v in model.to_fields().items() if k not in ("name", "source")}
    differ = sorted(k for k, v in theirs.to_fields().items() if k not in ("name", "source") and mine.get(k) != v)
    if differ:
        raise ToolError("bad_request", f"{what} holds {theirs.name}; the request's model differs in "
                        f"{', '.join(differ[:5])}", where=where,
                        fix=f"train it as the imported model: hf_config {hf_folder}")


def describe(path: str, model, tp: int, need_local: bool, job_imports: bool = False) -> dict[str, Any]:
    """What a run from the checkpoint at path needs: the vocabulary divisor, the tokenizer of an
    import, and whether the checkpoint could be checked here (a rendered script's path may exist
    only where the job runs). need_local: the run happens here, so the checkpoint must too.
    job_imports: the job imports into path before it trains, so an empty folder here is what that
    import fills, not an error; one holding files no import wrote is refused as the import would."""
    from ..core.flops import padded_vocab_size

    root = guarded.check_names(path, WHERE)
    rows = padded_vocab_size(model.vocab_size, 1)  # what the skill's imports hold
    info: dict[str, Any] = {"path": path, "checked": False, "tokenizer": None}
    if root.is_dir() and job_imports and not guarded.has_tracker(root):
        _importable(root, path)
    elif root.is_dir():
        checkpoint.check_tracker(root, WHERE)
        folder = checkpoint.iteration_dir(root)
        if checkpoint.kind(folder) != "torch_dist":
            raise ToolError("not_found", f"{path} holds no torch_dist checkpoint (Megatron's --pretrained-checkpoint "
                            "reads that format)", where=WHERE, fix="give an import-hf output or a GPU run's checkpoints")
        record = output.record_of(root) or {}
        if record.get("tool") == "import-hf":
            same_model(root / "hf", model, WHERE, "the checkpoint")
            if (root / "hf" / "tokenizer.json").is_file():
                info["tokenizer"] = str(root / "hf")
        try:
            rows = checkpoint.padded_vocab_of(folder) or rows
        except ImportError:
            pass  # planning without megatron-core: the import's own rule stands
        info["checked"] = True
    elif need_local:
        raise ToolError("not_found", f"no checkpoint folder {path}", where=WHERE,
                        fix="give the output folder of import-hf (or a run's checkpoints folder)")
    if rows < model.vocab_size or rows % tp:
        raise ToolError("bad_request", f"the checkpoint's {rows}-row embedding cannot be split over TP {tp}",
                        where=WHERE, fix="use a TP that divides it (a power of two up to 128 does for an import)")
    # Megatron's own padding at this TP gives other rows: make it give the checkpoint's
    info.update(padded_vocab=rows, vocab_divisor=rows // tp if padded_vocab_size(model.vocab_size, tp) != rows else None)
    return info


def _importable(root: Path, path: str) -> None:
    """A folder the job's import can write: empty, or one an import recorded (an import builds
    beside it and renames into place, so one cut short leaves nothing inside); import-hf refuses
    files it did not write (convert/output.existing), so render does too, before the job."""
    try:
        strangers = output.record_of(root) is None and any(root.iterdir())
    except OSError:
        return   # not readable here: the job's import says what it finds
    if strangers:
        raise ToolError("conflict", f"{path} holds files no import wrote: the job's import would refuse it",
                        where=WHERE, fix="choose a new or empty folder for the import (the files there are left "
                                         "as they are)")


# The learning rate of a run from pretrained weights, for render's scripts and the CPU loop alike.
def with_pretrained_defaults(model, training: dict) -> dict:
    """A run from pretrained weights: the rate, its floor and the warm-up of the from_pretrained row
    (training_defaults.json) where the request gives none; the rest as for any run."""
    row = catalog._load("training_defaults.json")["from_pretrained"]
    defaults = training_defaults(model, training["train_iters"])
    defaults.update(lr=row["lr"], min_lr=row["min_lr"],
                    lr_warmup_iters=min(row["warmup_iters"], training["train_iters"] // 10))
    if "lr" in training and "min_lr" not in training:
        defaults["min_lr"] = training["lr"] * row["min_lr"] / row["lr"]
    return {**defaults, **training}


def training_settings(model, training: dict) -> dict:
    """The request's training fields over the defaults for a run from scratch or from pretrained weights."""
    if training.get("pretrained"):
        return with_pretrained_defaults(model, training)
    return with_training_defaults(model, training)


def pretraining_rate_warning(model, training: dict) -> str | None:
    """A warning for a run from pretrained weights given a learning rate at or above the floor a
    from-scratch run of this size decays to: a rate that moves the weights as early pre-training
    did, and can undo what the checkpoint learned."""
    if not training.get("pretrained") or "lr" not in training:
        return None
    scratch = training_defaults(model, training["train_iters"])
    if training["lr"] < scratch["min_lr"]:
        return None
    row = catalog._load("training_defaults.json")["from_pretrained"]
    return (f"training.lr {training['lr']:g} is a pre-training rate for a model of this size (from scratch: peak "
            f"{scratch['lr']:g}, decayed to {scratch['min_lr']:g}); a run from pretrained weights usually takes "
            f"far less (full-parameter fine-tuning in NVIDIA's recipes: {row['lr']:g}); leave lr out for that "
            "default, or keep it if you mean to re-warm the model on a large new corpus")
