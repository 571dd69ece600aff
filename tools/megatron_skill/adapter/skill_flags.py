"""The entry script's own flags, beside Megatron's: the skill's fused paths.

They are added to Megatron's parser the way Megatron-LM's own entry scripts add theirs
(``extra_args_provider``), so a launch script is still checked flag by flag against one
parser: Megatron's plus these.  Pure argparse: importable without torch.
"""
from __future__ import annotations

import argparse

SDPA_BACKENDS = ["auto", "cudnn", "flash", "efficient", "math"]
FP8_SCALINGS = ["current", "delayed"]


def add_skill_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("megatron-core-training skill",
                                  "fused paths of the skill's entry script (tools/pretrain_gpt.py)")
    g.add_argument("--skill-linear-cross-entropy", action="store_true",
                   help="output layer and cross-entropy chunk by chunk, never materialising the "
                        "[tokens x vocab] logits (runtime/fused_head.py)")
    g.add_argument("--skill-fp8-linear", action="store_true",
                   help="attention and MLP linear layers in FP8 (per-tensor current scaling, torch._scaled_mm) "
                        "without Transformer Engine; TP 1 layers (runtime/fp8_linear.py)")
    g.add_argument("--skill-fp8-scaling", choices=FP8_SCALINGS, default="current",
                   help="how the skill's FP8 layers scale a GEMM input: by its own maximum (current) or by the "
                        "maximum of its previous pass, measured while casting (delayed; runtime/fp8_delayed.py)")
    g.add_argument("--skill-fused-adam", action="store_true",
                   help="step torch's AdamW with its fused kernel where Megatron falls back to it (no Transformer "
                        "Engine or apex): no 4-byte-per-parameter temporary at the step (runtime/fused_adam.py)")
    g.add_argument("--skill-sdpa-backend", choices=SDPA_BACKENDS, default="auto",
                   help="the torch SDPA kernel for core attention without Transformer Engine")
    g.add_argument("--skill-compiled-rope", action="store_true",
                   help="Megatron's unfused RoPE compiled with torch.compile: one fused kernel each way "
                        "instead of a chain of element-wise ones (runtime/fused_rope.py)")
    g.add_argument("--skill-native-gqa", action="store_true",
                   help="grouped-query attention read by the SDPA kernel itself (enable_gqa) instead of "
                        "expanding keys and values to every query head")
    return parser
