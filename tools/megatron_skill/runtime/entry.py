"""Megatron training through megatron.training.pretrain, from the megatron-core wheel alone.

What Megatron-LM's pretrain_gpt.py does, for the skill: parse and validate the usual
flags, build the GPT model config with Megatron's own builder (only the layer spec is
ours when Transformer Engine is missing), build GPT datasets (mock or indexed), and hand
everything to ``pretrain``.  Data is read on every rank of the first and last pipeline
stage, so tensor-parallel ranks need no broadcast: they read the same samples.
"""
from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path

_START = time.time()

import torch  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402

from ..core.options import RuntimeOptions  # noqa: E402
from . import fused_head, patches, specs  # noqa: E402
from .masked_dataset import MaskedGPTDataset  # noqa: E402


def _tokenizer(args):
    try:
        from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
        return build_tokenizer(args)
    except Exception:
        from megatron.training import get_tokenizer
        return get_tokenizer()


def _on_data_rank(vp_stage=None) -> bool:
    from megatron.training.utils import is_first_or_last_pipeline_stage
    return is_first_or_last_pipeline_stage(vp_stage)


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    from megatron.training import get_args, print_rank_0
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed, sequence_length=args.seq_length, blend=blend, blend_per_split=blend_per_split,
        split=args.split, num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path, mmap_bin_files=args.mmap_bin_files, tokenizer=_tokenizer(args),
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss, create_attention_mask=args.create_attention_mask_in_dataloader,
    )
    kind = MockGPTDataset if args.mock_data else MaskedGPTDataset  # GPTDataset, with prepare-data's chat masks
    print_rank_0(f"> building {kind.__name__} train/valid/test datasets")
    return BlendedMegatronDatasetBuilder(kind, train_val_test_num_samples,
                                         partial(_on_data_rank, vp_stage=vp_stage), config).build()


datasets_provider.is_distributed = True  # every rank of a data stage reads; no TP broadcast


def _get_batch(data_iterator, vp_stage=None):
    if not _on_data_rank(vp_stage):
        return None, None, None, None, None
    batch = next(data_iterator)
    batch = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:
        from megatron.core.utils import get_batch_on_this_cp_rank
        batch.setdefault("cu_seqlens", None)
        batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                          cp_group=parallel_state.get_context_parallel_group())
    return (batch["tokens"], batch["labels"], batch["loss_mask"], batch.get("attention_mask"),
            batch["position_ids"])


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Sum of token losses and the token count; Megatron averages over the global batch."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


class FirstBatch:
    """The micro-batches of a run's first iteration from pretrained weights, kept in
    RUN_DIR/first_batch-dp0.pt by the first data-parallel, tensor-parallel and pipeline rank, as
    the CPU loop keeps them: the first loss can then be checked against the source model's."""

    def __init__(self):
        self.batches: list | None = None

    def see(self, tokens, labels, loss_mask) -> None:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        from megatron.training import get_args

        if self.batches is None:
            args = get_args()
            mine = (parallel_state.get_data_parallel_rank() == 0 and parallel_state.get_tensor_model_parallel_rank() == 0
                    and parallel_state.is_pipeline_first_stage() and tokens is not None)
            wanted = getattr(args, "pretrained_checkpoint", None) and args.save and getattr(args, "finetune", False)
            self.batches = [] if mine and wanted and args.iteration == 0 else False
            self.path = Path(args.save).parent / "first_batch-dp0.pt" if self.batches == [] else None
        if self.batches is False:
            return
        self.batches.append({"tokens": tokens.cpu(), "labels": labels.cpu(), "loss_mask": loss_mask.cpu()})
        if len(self.batches) == get_num_microbatches():
            torch.save(self.batches, self.path)
            self.batches = False


class SavedActivations:
    """With MEGATRON_SKILL_SAVED_ACTIVATIONS=FILE: what the first micro-batch's forward keeps for
    its backward on this rank (autograd's saved-tensor hooks; distinct storages, parameters left
    out), by shape and dtype, written to FILE as JSON: the memory model's terms checked against
    the real layers, one tensor kind at a time. A measurement run: with pipeline parallelism the
    hooks hold outputs that the schedule frees, and the run stops after the count."""

    def __init__(self):
        self.path = os.environ.get("MEGATRON_SKILL_SAVED_ACTIVATIONS")

    def around(self, model, tokens):
        import contextlib

        if not self.path:
            return contextlib.nullcontext()
        path, self.path = self.path, None  # the first micro-batch only
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, tuple[int, str]] = {}

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in params and ptr not in kept:
                kept[ptr] = (t.untyped_storage().nbytes(), f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
            return t

        @contextlib.contextmanager
        def hooks():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
            by_kind: dict[str, list[float]] = {}
            for nbytes, kind in kept.values():
                count, total = by_kind.get(kind, [0, 0])
                by_kind[kind] = [count + 1, total + nbytes]
            n_tokens = tokens.numel() if tokens is not None else None
            Path(path).write_text(json.dumps({"tokens": n_tokens, "bytes": sum(b for b, _ in kept.values()),
                                              "by_shape": dict(sorted(by_kind.items(), key=lambda kv: -kv[1][1]))},
                                             indent=1))
        return hooks()


def make_forward_step(fused: bool):
    """Megatron's forward_step_func; with the fused head, the logits never exist whole (its
    gradients assume loss_func's masked sum)."""
    extra = {"output_processor": fused_head.output_processor} if fused else {}
    first = FirstBatch()
    saved = SavedActivations()

    def forward_step(data_iterator, model, return_schedule_plan: bool = False):
        from megatron.core.utils import get_attr_wrapped_model
        from megatron.training import get_timers

        timers = get_timers()
        timers("batch-generator", log_level=2).start()
        vp_stage = get_attr_wrapped_model(model, "vp_stage")
        tokens, labels, loss_mask, attention_mask, position_ids = _get_batch(data_iterator, vp_stage)
        timers("batch-generator").stop()
        first.see(tokens, labels, loss_mask)
        with saved.around(model, tokens):
            output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask, **extra)
        return output, partial(loss_func, loss_mask)

    return forward_step


def runtime_options(args) -> RuntimeOptions:
    """The entry's own flags (adapter/skill_flags.py) as the runtime's one options value."""
    return RuntimeOptions(linear_cross_entropy=args.skill_linear_cross_entropy, compiled_rope=args.skill_compiled_rope,
                          native_gqa=args.skill_native_gqa, sdpa_backend=args.skill_sdpa_backend,
                          fused_wgrad_accumulation=args.gradient_accumulation_fusion,
                          fp8_linear=args.skill_fp8_linear, fused_adam=args.skill_fused_adam,
                          fp8_scaling=args.skill_fp8_scaling,
                          te=args.transformer_impl != "local")


def main() -> None:
    from megatron.training import pretrain, print_rank_0
    from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
    from megatron.training.arguments import parse_and_validate_args

    # the wheel's gaps, and the kernel profile when asked, before anything runs
    fixes = [p.name for p in map(patches.by_name, ("dataset helpers", "distributed optimizer",
                                                    "selective recompute", "kernel profile")) if p.apply()]
    from megatron_skill.adapter.skill_flags import add_skill_arguments

    args = parse_and_validate_args(extra_args_provider=add_skill_arguments,
                                   args_defaults={"tokenizer_type": "NullTokenizer"})
    model_cfg = gpt_config_from_args(args)
    opts = runtime_options(args)
    fused = opts.linear_cross_entropy and fused_head.usable(args)
    if fused:
        fixes.append("output layer + cross-entropy fused chunk by chunk (no full logits)")
    if opts.fp8_linear:
        from . import fp8_delayed, fp8_linear
        fp8_linear.WEIGHT_CACHE.enable()
        fp8_delayed.use(opts.fp8_scaling)
        fixes.append(f"FP8 linear layers (per-tensor {opts.fp8_scaling} scaling, torch._scaled_mm; weights cast once a step)")
    rope = patches.by_name("RoPE")
    if opts.compiled_rope and rope.apply():
        fixes.append(rope.name)
    if opts.native_gqa:
        fixes.append("SDPA reads grouped key/value heads itself (enable_gqa)")
    if opts.sdpa_backend != "auto":
        fixes.append(f"SDPA backend: {opts.sdpa_backend}")
    adam = patches.by_name("optimizer: torch's fused AdamW")
    if opts.fused_adam and adam.apply():
        fixes.append(adam.name)
    wgrad = patches.by_name("gradient-accumulation fusion")
    if args.gradient_accumulation_fusion and wgrad.apply():
        fixes.append(wgrad.name)
    if args.transformer_impl == "local":
        model_cfg.transformer_layer_spec = specs.layer_spec_for(opts)
        fixes.append("layer spec: Megatron-Core local layers with SDPA core attention")
    cfg = pretrain_cfg_container_from_args(args, model_cfg)
    for fix in fixes:
        print_rank_0(f"> megatron-core-training skill: {fix}")
    pretrain(cfg, datasets_provider, ModelType.encoder_or_decoder, make_forward_step(fused))
    if args.fake_process_group:
        _report_fake_rank_memory(args)


def _report_fake_rank_memory(args) -> None:
    """Megatron prints memory on data-parallel rank 0 only; a fake-process-group run is one
    rank, whichever it is, so it says its own peak, in Megatron's format (megatron_log reads it)."""
    mb = 2**20
    print(f"[Rank {args.rank}] (after {args.train_iters} iterations) memory (MB) | allocated: "
          f"{torch.cuda.memory_allocated() / mb:.2f} | max allocated: {torch.cuda.max_memory_allocated() / mb:.2f}"
          f" | reserved: {torch.cuda.memory_reserved() / mb:.2f} | max reserved: "
          f"{torch.cuda.max_memory_reserved() / mb:.2f}", flush=True)
