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

from ..errors import ToolError
from . import checkpoint, output

WHERE = "/training/pretrained"


def describe(path: str, model, tp: int, need_local: bool) -> dict[str, Any]:
    """What a run from the checkpoint at path needs: the vocabulary divisor, the tokenizer of an
    import, and whether the checkpoint could be checked here (a rendered script's path may exist
    only where the job runs). need_local: the run happens here, so the checkpoint must too."""
    from ..core.flops import padded_vocab_size

    root = Path(path)
    rows = padded_vocab_size(model.vocab_size, 1)  # what the skill's imports hold
    info: dict[str, Any] = {"path": path, "checked": False, "tokenizer": None}
    if root.is_dir():
        checkpoint.check_tracker(root, WHERE)
        folder = checkpoint.iteration_dir(root)
        if checkpoint.kind(folder) != "torch_dist":
            raise ToolError("not_found", f"{path} holds no torch_dist checkpoint (Megatron's --pretrained-checkpoint "
                            "reads that format)", where=WHERE, fix="give an import-hf output or a GPU run's checkpoints")
        record = output.record_of(root) or {}
        if record.get("tool") == "import-hf":
            from ..core.model import from_hf_config

            theirs = from_hf_config(root / "hf")
            mine = {k: v for k, v in model.to_fields().items() if k not in ("name", "source")}
            differ = sorted(k for k, v in theirs.to_fields().items() if k not in ("name", "source") and mine.get(k) != v)
            if differ:
                raise ToolError("bad_request", f"the checkpoint holds {theirs.name}; the request's model differs in "
                                f"{', '.join(differ[:5])}", where=WHERE,
                                fix=f"train it as the imported model: hf_config {root / 'hf'}")
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
