"""A small, real Megatron-Core training loop on CPU (gloo), for tiny models.

megatron.training.pretrain needs CUDA; this loop runs the same model code without it:
Megatron-Core's GPTModel with the skill's layer spec, tensor parallelism over gloo,
Megatron's dataset builder (mock or indexed data), and per-rank checkpoints with the
model and optimizer state.  It prints Megatron-format iteration lines, so the
same log reader serves both.  Run under torchrun:  torchrun --nproc-per-node N cpu_loop.py CONFIG.json
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from functools import partial
from pathlib import Path


def build_model(cfg: dict):
    import torch
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..core.options import RuntimeOptions
    from . import patches
    from .cpu_rope import keep_rope_on_cpu
    from .specs import block_spec

    patches.by_name("CPU stands in").apply()
    opts = RuntimeOptions.from_request({"fp8_linear": bool(cfg.get("fp8_linear")),
                                        "fp8_scaling": cfg.get("fp8_scaling", "current"),
                                        "native_gqa": bool(cfg.get("native_gqa")),
                                        "compiled_rope": bool(cfg.get("compiled_rope")),
                                        "sdpa_backend": cfg.get("sdpa_backend", "auto")}, te=False)
    if opts.compiled_rope:
        patches.by_name("RoPE").apply()
    if opts.fp8_linear:
        from . import fp8_delayed
        fp8_delayed.use(opts.fp8_scaling)

    m = cfg["model"]
    act = {"swiglu": torch.nn.functional.silu, "gelu": torch.nn.functional.gelu,
           "squared_relu": lambda x: torch.nn.functional.relu(x) ** 2}[m.get("activation", "swiglu")]
    config = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m.get("num_query_groups"),
        kv_channels=m.get("kv_channels"), normalization=m.get("normalization", "RMSNorm"),
        layernorm_epsilon=m.get("norm_epsilon", 1e-5), add_qkv_bias=bool(m.get("add_qkv_bias")),
        gated_linear_unit=m.get("activation", "swiglu") == "swiglu", activation_func=act,
        add_bias_linear=m.get("add_bias_linear", False), tensor_model_parallel_size=cfg["tp"],
        expert_model_parallel_size=cfg.get("ep", 1),
        # Sequence parallelism's reduce-scatter allocates on the CUDA device: TP on CPU runs without it.
        sequence_parallel=False, use_cpu_initialization=True,
        perform_initialization=cfg.get("initialize", True),  # a conversion overwrites every weight
        params_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.get("params_dtype"), torch.float32),
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=cfg.get("init_method_std", 0.02),
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        num_moe_experts=m.get("num_experts"), moe_router_topk=m.get("moe_router_topk", 2),
        moe_ffn_hidden_size=m.get("moe_ffn_hidden_size"),
        # The all-to-all dispatcher makes a CUDA stream when built; all-gather's runs on the CPU.
        moe_token_dispatcher_type="allgather",
        moe_router_pre_softmax=bool(m.get("moe_router_pre_softmax")),
        moe_router_score_function=m.get("moe_router_score_function", "softmax"),
        moe_router_enable_expert_bias=bool(m.get("moe_router_enable_expert_bias")),
        moe_router_topk_scaling_factor=m.get("moe_router_topk_scaling_factor"),
        moe_router_num_groups=m.get("moe_router_num_groups"), moe_router_group_topk=m.get("moe_router_group_topk"),
    )
    if m.get("moe_layer_freq") not in (None, 1):
        freq = m["moe_layer_freq"]
        config.moe_layer_freq = list(freq) if isinstance(freq, (list, tuple)) else freq
    config.qk_layernorm = bool(m.get("qk_layernorm", False))
    from megatron.core import parallel_state as ps

    config.pipeline_model_parallel_size = cfg.get("pp", 1)
    model = GPTModel(config=config, transformer_layer_spec=block_spec(config, opts), vocab_size=cfg["padded_vocab_size"],
                     max_sequence_length=cfg["seq_length"], position_embedding_type="rope",
                     rotary_base=m.get("rotary_base", 10000), rope_scaling=bool(m.get("rope_scaling_factor")),
                     rope_scaling_factor=m.get("rope_scaling_factor") or 8.0,
                     share_embeddings_and_output_weights=not m.get("untie_embeddings_and_output_weights", True),
                     pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    keep_rope_on_cpu(model)
    return model


def build_data(cfg: dict, dp_rank: int, dp_size: int):
    """Megatron's own dataset builder: MockGPTDataset, or GPTDataset over an indexed dataset."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from .masked_dataset import MaskedGPTDataset

    data_path = cfg.get("data_path")
    ds_cfg = GPTDatasetConfig(
        random_seed=cfg["seed"], sequence_length=cfg["seq_length"],
        blend=(data_path, None) if data_path else None, split="100,0,0" if data_path else None,
        tokenizer=NullTokenizer(vocab_size=cfg["vocab_size"]), reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        path_to_cache=cfg.get("data_cache"), mid_level_dataset_surplus=0.005,
    )
    n = cfg["train_iters"] * cfg["global_batch_size"]
    kind = MaskedGPTDataset if data_path else MockGPTDataset  # GPTDataset, with prepare-data's chat masks
    train, _, _ = BlendedMegatronDatasetBuilder(kind, [n, None, None], lambda: True, ds_cfg).build()
    mbs, per_dp = cfg["micro_batch_size"], cfg["global_batch_size"] // dp_size
    return train, mbs, per_dp


def _batches(dataset, start_sample: int, per_dp: int, mbs: int, dp_rank: int, dp_size: int, gbs: int):
    import torch
    step = start_sample // gbs
    while True:
        base = step * gbs + dp_rank * per_dp
        for k in range(0, per_dp, mbs):
            items = [dataset[base + k + j] for j in range(mbs)]
            yield {key: torch.stack([torch.as_tensor(it[key]) for it in items])
                   for key in ("tokens", "labels", "loss_mask", "position_ids")}
        step += 1


def _rank_name() -> str:
    """Megatron's legacy names: mp_rank_TT, or mp_rank_TT_PPP with pipeline parallelism."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_rank()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        return f"mp_rank_{tp:02d}_{ps.get_pipeline_model_parallel_rank():03d}"
    return f"mp_rank_{tp:02d}"


def load_initial_weights(model, path: str) -> None:
    """Start from a whole model's initial weights (saved by a one-stage run with save_initial),
    taking this pipeline stage's layers: its local layer j is global layer j + offset."""
    import torch
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    whole = torch.load(path, weights_only=False)
    offset = get_transformer_layer_offset(model.config)
    local = {}
    for key in model.state_dict():
        src = key
        if key.startswith("decoder.layers."):
            j, rest = key[len("decoder.layers."):].split(".", 1)
            src = f"decoder.layers.{int(j) + offset}.{rest}"
        local[key] = whole[src]
    model.load_state_dict(local)


def load_pretrained(model, folder: str) -> None:
    """A torch_dist checkpoint's weights into this rank's piece of the model (resharded on load)."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
    model.load_state_dict(loaded["model"], strict=False)


def _pipeline_micro_batch(model, b, scale: float, head_args: dict):
    """One micro-batch through two or more stages, forward then backward, over gloo send/recv;
    head_args go to the last stage's output layer (the fused head). Returns the per-token losses
    on the last stage (None elsewhere)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    s, mb = b["tokens"].shape[1], b["tokens"].shape[0]
    shape = (s, mb, model.config.hidden_size)
    inp = None
    if not first:
        inp = torch.empty(shape)
        dist.recv(inp, src=prev)
        inp.requires_grad_()
        model.set_input_tensor(inp)
    if last:
        losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"], **head_args(b))
        mask = b["loss_mask"].float()
        (torch.sum(losses.float() * mask) * scale / mask.sum()).backward()
    else:
        out = model(b["tokens"], b["position_ids"], None)
        dist.send(out.detach().contiguous(), dst=nxt)
        grad = torch.empty(shape)
        dist.recv(grad, src=nxt)
        out.backward(grad)
        losses = None
    if not first:
        dist.send(inp.grad.contiguous(), dst=prev)
    return losses


def _clip_global(model, max_norm: float) -> None:
    """Clip by the norm over the whole model, summed across the pipeline stages."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    sq = torch.stack([g.pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
    dist.all_reduce(sq, group=ps.get_pipeline_model_parallel_group())
    coef = max_norm / (sq.sqrt() + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)


def save_checkpoint(model, optimizer, iteration: int, ckpt_root: Path, rank: int) -> None:
    """One file per tensor-parallel rank (Megatron's legacy 'torch' layout, mp_rank_XX),
    written by data-parallel rank 0: the other DP ranks hold the same replica.  (Megatron's
    torch_dist writer synchronizes on CUDA devices, which a CPU-only machine does not have.)"""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    path = ckpt_root / f"iter_{iteration:07d}"
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if ps.get_data_parallel_rank() == 0:
        tmp = path / f"{_rank_name()}.pt.tmp"
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iteration": iteration,
                    "rng": torch.get_rng_state()}, tmp)
        tmp.replace(path / f"{_rank_name()}.pt")
    dist.barrier()
    if rank == 0:  # the marker last: a checkpoint counts only once every rank has written it
        marker = ckpt_root / "latest_checkpointed_iteration.txt.tmp"
        marker.write_text(str(iteration))
        marker.replace(ckpt_root / "latest_checkpointed_iteration.txt")
    dist.barrier()


def load_checkpoint(model, optimizer, ckpt_root: Path, rank: int) -> int:
    import torch

    latest = ckpt_root / "latest_checkpointed_iteration.txt"
    if not latest.exists():
        return 0
    iteration = int(latest.read_text())
    state = torch.load(ckpt_root / f"iter_{iteration:07d}" / f"{_rank_name()}.pt", weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return iteration


def lr_at(cfg: dict, it: int) -> float:
    warm, total = cfg["lr_warmup_iters"], cfg["train_iters"]
    if it < warm:
        return cfg["lr"] * (it + 1) / warm
    frac = (it - warm) / max(1, total - warm)
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * min(frac, 1.0)))


def main(config_path: str) -> None:
    import torch
    import torch.distributed as dist

    cfg = json.loads(Path(config_path).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from megatron.core import parallel_state as ps

    from ..core.memory import FUSED_HEAD_CHUNK
    from . import fused_head

    head = partial(fused_head.output_processor, chunk_tokens=cfg.get("fused_head_chunk", FUSED_HEAD_CHUNK))

    def head_args(b: dict) -> dict:
        return {"loss_mask": b["loss_mask"], "output_processor": head} if cfg.get("fused_head") else {}
    pp = cfg.get("pp", 1)
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg["tp"], pipeline_model_parallel_size=pp)
    torch.manual_seed(cfg["seed"])
    model = build_model(cfg)
    if cfg.get("save_initial") and rank == 0:
        torch.save(model.state_dict(), cfg["save_initial"])
    if cfg.get("load_initial"):
        load_initial_weights(model, cfg["load_initial"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                                  weight_decay=cfg["weight_decay"], fused=bool(cfg.get("fused_adam")))
    ckpt_root = Path(cfg["save"])
    start = load_checkpoint(model, optimizer, ckpt_root, rank)
    if start and rank == 0:
        print(f"> loaded checkpoint from iteration {start}", flush=True)
    first_batch = None
    if not start and cfg.get("pretrained"):  # Megatron's --pretrained-checkpoint: weights only, iteration 0
        load_pretrained(model, cfg["pretrained"])
        if rank == 0:
            print(f"> loaded pretrained weights from {cfg['pretrained']}", flush=True)
        if ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_first_stage():
            first_batch = Path(cfg["save"]).parent / f"first_batch-dp{ps.get_data_parallel_rank()}.pt"
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    dataset, mbs, per_dp = build_data(cfg, dp_rank, dp_size)
    gbs = cfg["global_batch_size"]
    batches = _batches(dataset, start * gbs, per_dp, mbs, dp_rank, dp_size, gbs)
    dp_group = ps.get_data_parallel_group()
    consumed = start * gbs
    for it in range(start, cfg["train_iters"]):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, it)
        loss_sum = torch.zeros(())
        tokens = torch.zeros(())
        seen = []
        for _ in range(per_dp // mbs):
            b = next(batches)
            seen.append(b)
            mask = b["loss_mask"].float()
            if pp > 1:
                losses = _pipeline_micro_batch(model, b, 1.0 / (per_dp // mbs), head_args)
            else:
                losses = model(b["tokens"], b["position_ids"], None, labels=b["labels"], **head_args(b))
                (torch.sum(losses.float() * mask) / (mask.sum() * (per_dp // mbs))).backward()
            if losses is not None:
                loss_sum += torch.sum(losses.detach().float() * mask)
                tokens += mask.sum()
        if dp_size > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=dp_group)
                    p.grad /= dp_size
        if pp > 1:
            _clip_global(model, cfg.get("clip_grad", 1.0))
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.get("clip_grad", 1.0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stats = torch.stack([loss_sum, tokens])
        dist.all_reduce(stats, group=dp_group)
        if pp > 1:  # the loss lives on the last stage; rank 0 prints it
            dist.broadcast(stats, src=ps.get_pipeline_model_parallel_last_rank(),
                           group=ps.get_pipeline_model_parallel_group())
        consumed += gbs
        if first_batch is not None:  # the tokens of the first loss, to compare it with the source model's
            torch.save([{k: b[k] for k in ("tokens", "labels", "loss_mask")} for b in seen], first_batch)
            first_batch = None
        ms = (time.perf_counter() - t0) * 1e3
        if rank == 0 and ((it + 1) % cfg["log_interval"] == 0 or it + 1 == cfg["train_iters"] or it == start):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            print(f" [{stamp}] iteration {it + 1:8d}/{cfg['train_iters']:8d} | consumed samples: {consumed:12d} | "
                  f"elapsed time per iteration (ms): {ms:.1f} | learning rate: {lr_at(cfg, it):.6E} | "
                  f"global batch size: {gbs:5d} | lm loss: {(stats[0] / stats[1]).item():.6E} | "
                  f"number of skipped iterations:   0 | number of nan iterations:   0 |", flush=True)
        if cfg.get("save_interval") and (it + 1) % cfg["save_interval"] == 0:
            save_checkpoint(model, optimizer, it + 1, ckpt_root, rank)
            if rank == 0:
                print(f"successfully saved checkpoint from iteration {it + 1:7d} to {ckpt_root} (per-rank torch files)",
                      flush=True)
    if cfg.get("save") and cfg["train_iters"] % max(1, cfg.get("save_interval") or cfg["train_iters"]):
        save_checkpoint(model, optimizer, cfg["train_iters"], ckpt_root, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from megatron_skill.runtime.cpu_loop import main as _main  # as a module, so relative imports work

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _main(sys.argv[1])
