#!/usr/bin/env python3
"""Megatron GPT pretraining entry for the megatron-core pip wheel (no Megatron-LM checkout).

Takes the same flags as Megatron-LM's pretrain_gpt.py; launch it with torchrun, as the
scripts that `launch.py render` writes do.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from megatron_skill.runtime.entry import main  # noqa: E402

if __name__ == "__main__":
    main()
