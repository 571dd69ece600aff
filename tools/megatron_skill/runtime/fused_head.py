"""Output layer and cross-entropy in one pass over token chunks: no full logits tensor.

With a 128k vocabulary the logits of one micro-batch are large: 4 x 4096 tokens x 128,256
entries are 4.2 GB in bf16 and 8.4 GB once cast to fp32 for the loss, and Megatron's
unfused cross-entropy keeps several such tensors alive at once.  Here the logits exist
one chunk of tokens at a time: for each chunk the forward computes the logits, the fp32
log-sum-exp, the loss, and at once the gradients of the hidden states and of the output
weight (what the backward would need the logits for).  Peak extra memory is one chunk's
logits; the GEMM work is the same three products as the unfused path.  For a micro-batch of
fewer tokens than twice the hidden size (one 4,096-token sequence of a 3,072-wide model) the
fp32 weight gradient would outweigh the logit gradients themselves: there the forward keeps
the chunks' bf16 logit gradients instead, and the backward forms the weight gradient in one
GEMM, straight into main_grad under gradient-accumulation fusion, as Megatron's own output
layer does (core.memory.fused_head_defers_wgrad).

Because the gradients are formed in the forward, they assume the loss is what the skill's
``loss_func`` makes of it: the sum of masked token losses times one factor per micro-batch
(Megatron's division by the token count).  The backward recovers that factor from the
incoming gradient and the loss mask.  With tensor parallelism the vocabulary is split as
in Megatron's VocabParallelEmbedding: max, sum of exponentials and target logit are
all-reduced over the TP group, and the hidden-state gradient is summed by Megatron's own
region functions (all-reduce, or reduce-scatter with sequence parallelism).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..core.memory import FUSED_HEAD_CHUNK, fused_head_chunk, fused_head_defers_wgrad
from . import compiled
from .wgrad_accum import addmm_fp32_, addmm_into_


def _all_reduce(t: torch.Tensor, op, group) -> None:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)


class LinearCrossEntropy(torch.autograd.Function):
    """loss[n] = logsumexp(h[n] @ W.T) - (h[n] @ W.T)[target[n]], W split over the TP group."""

    @staticmethod
    def forward(ctx, hidden, weight, target, loss_mask, group, chunk_tokens, into_main_grad=False,
                defer_wgrad=False):
        n_tok, h = hidden.shape[0] * hidden.shape[1], hidden.shape[-1]
        x = hidden.reshape(n_tok, h)
        t = target.reshape(n_tok)
        mask = loss_mask.reshape(n_tok).to(torch.float32)
        v_local = weight.shape[0]
        rank = dist.get_rank(group) if tp_group_size(group) > 1 else 0
        v_start = rank * v_local
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        need_wgrad = ctx.needs_input_grad[1]

        loss = torch.empty(n_tok, dtype=torch.float32, device=x.device)
        grad_x = torch.empty_like(x) if need_grad else None
        # the weight gradient: accumulated here in fp32, or formed in the backward from the
        # logit gradients kept here in the logits' dtype
        grad_w = logit_grad = None
        if need_wgrad and defer_wgrad:
            logit_grad = torch.empty((n_tok, v_local), dtype=torch.result_type(x, weight), device=x.device)
        elif need_wgrad:
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=x.device)
        for s in range(0, n_tok, chunk_tokens):
            e = min(s + chunk_tokens, n_tok)
            logits = x[s:e] @ weight.t()                            # [c, V/tp], the GEMM's dtype
            local_t = t[s:e] - v_start
            here = (local_t >= 0) & (local_t < v_local)
            idx = local_t.clamp(0, v_local - 1)
            row_max, sum_exp, target_logit = chunk_stats(logits, idx, here)
            if tp_group_size(group) > 1:
                # combine the ranks' vocabulary slices: one max, then the sums rescaled to it
                global_max = row_max.clone()
                _all_reduce(global_max, dist.ReduceOp.MAX, group)
                both = torch.stack([sum_exp * torch.exp(row_max - global_max), target_logit])
                _all_reduce(both, dist.ReduceOp.SUM, group)
                row_max, sum_exp, target_logit = global_max, both[0], both[1]
            loss[s:e] = sum_exp.log() + row_max - target_logit
            if need_grad:
                # d loss_n / d logits = softmax - onehot(target), weighted by the mask now and by
                # the micro-batch factor in backward.
                g = chunk_grad(logits, row_max, sum_exp, idx, here, mask[s:e])
                torch.mm(g, weight, out=grad_x[s:e])
                if logit_grad is not None:
                    logit_grad[s:e].copy_(g)
                elif grad_w is not None:
                    addmm_fp32_(grad_w, g.t(), x[s:e])
        if need_grad:
            ctx.save_for_backward(grad_x, hidden if logit_grad is not None else None, mask)
            ctx.hidden_shape, ctx.weight, ctx.into_main_grad = hidden.shape, weight, into_main_grad
            # not saved tensors: the backward drops them once used, before it allocates the
            # weight-sized gradient or placeholder it hands autograd
            ctx.pending = PendingWeightGrad(grad_w, logit_grad) if need_wgrad else None
        return loss.view(hidden.shape[0], hidden.shape[1])

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, x, mask = ctx.saved_tensors
        # grad_loss = factor * mask (the skill's loss_func); recover the factor without a sync.
        factor = (grad_loss.reshape(-1).float() * mask).sum() / (mask * mask).sum().clamp(min=1e-12)
        gx = (grad_x * factor.to(grad_x.dtype)).view(ctx.hidden_shape)
        pending, ctx.pending = ctx.pending, None
        if pending is None and ctx.needs_input_grad[1]:
            raise RuntimeError("the fused head's backward runs once per forward (its weight gradient is "
                               "dropped once formed): retain_graph is not supported")
        gw = None
        if pending is not None:
            pending.x, pending.factor = x, factor
            gw = weight_grad(ctx.weight, ctx.into_main_grad, pending)
        return gx, gw, None, None, None, None, None, None


class PendingWeightGrad:
    """The output weight's gradient as the forward left it: the fp32 sum over the chunks, or the
    logit gradients with the hidden states (`x`), still to be multiplied by the micro-batch's
    `factor`.  Used once: its tensors are dropped as soon as the gradient is formed."""

    def __init__(self, grad_w: torch.Tensor | None, logit_grad: torch.Tensor | None):
        self.grad_w, self.logit_grad = grad_w, logit_grad
        self.x: torch.Tensor | None = None
        self.factor: torch.Tensor | None = None

    def add_to(self, acc: torch.Tensor) -> None:
        """acc += factor * gradient, in place (fp32 or bf16 acc)."""
        if self.logit_grad is not None:
            addmm_into_(acc, self.logit_grad.t(), self._scaled_x())
        else:
            acc.addcmul_(self.grad_w, self.factor)
        self._drop()

    def plain(self, dtype: torch.dtype) -> torch.Tensor:
        """factor * gradient in `dtype`."""
        if self.logit_grad is not None:
            out = (self.logit_grad.t() @ self._scaled_x()).to(dtype)
        else:
            out = self.grad_w.mul_(self.factor).to(dtype)   # in place: no second fp32 buffer
        self._drop()
        return out

    def _scaled_x(self) -> torch.Tensor:
        # the factor on the hidden states (a few MB) rather than on the logit gradients: one
        # rounding more than Megatron's layer, whose bf16 output gradient carries the factor
        # (none where the factor is a power of two, as with full masks and power-of-two token
        # counts; else within bf16's noise)
        return self.x.reshape(-1, self.x.shape[-1]) * self.factor.to(self.x.dtype)

    def _drop(self) -> None:
        self.grad_w = self.logit_grad = self.x = None


def weight_grad(weight: torch.Tensor, into_main_grad: bool, pending: PendingWeightGrad) -> torch.Tensor:
    """The output weight's gradient (`pending`).  Under Megatron's gradient-accumulation
    fusion (`into_main_grad`: the model's config says so) with its DDP (a main_grad, fp32 or bf16,
    and the grad_added_to_main_grad flag) it is added straight into main_grad, in one pass, and a
    placeholder goes back to autograd as Megatron's own linear layers do under that fusion (zeros
    where the weight is the embedding's too, whose lookup adds its own gradient to it: DDP's hook
    then adds that sum).  Only under the fusion: the flag stays set for the whole iteration, and
    Megatron's output layer, taking a smaller micro-batch of it, then adds into main_grad itself
    too; without it, that layer's gradient would go through DDP's hook, which the flag would skip.
    Megatron-FSDP's parameters keep their own main_grad protocol: they get the gradient back."""
    main_grad = getattr(weight, "main_grad", None)
    if (not into_main_grad or main_grad is None or not hasattr(weight, "grad_added_to_main_grad")
            or hasattr(weight, "__fsdp_param__")):
        return pending.plain(weight.dtype)
    pending.add_to(main_grad)
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=weight.dtype, device=main_grad.device)


def tp_group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


@compiled.kernel
def chunk_stats(logits: torch.Tensor, idx: torch.Tensor, here: torch.Tensor):
    """Per token of a chunk: the row max, the sum of exp(logit - max) and the target's logit
    (0 where the target is another rank's), in fp32.  One fused pass over the logits when
    compiled; eager, the fp32 copy of the chunk and its exponentials are materialised."""
    lf = logits.float()
    row_max = lf.amax(dim=1)
    sum_exp = torch.exp(lf - row_max.unsqueeze(1)).sum(dim=1)
    target_logit = lf.gather(1, idx.unsqueeze(1)).squeeze(1) * here.to(lf.dtype)
    return row_max, sum_exp, target_logit


@compiled.kernel
def chunk_grad(logits, row_max, sum_exp, idx, here, mask):
    """(softmax - onehot(target)) * mask, in the logits' dtype: the loss's gradient by the logits."""
    probs = torch.exp(logits.float() - row_max.unsqueeze(1)) / sum_exp.unsqueeze(1)
    cols = torch.arange(logits.shape[1], device=logits.device)
    onehot = (cols.unsqueeze(0) == idx.unsqueeze(1)) & here.unsqueeze(1)
    return ((probs - onehot.to(probs.dtype)) * mask.unsqueeze(1)).to(logits.dtype)


def _run_forward_pre_hooks(module: torch.nn.Module, args: tuple) -> None:
    """The output layer's weight is used without calling the layer, so run its forward
    pre-hooks by hand: Megatron's DDP waits there for the weight's all-gather when it
    overlaps the parameter gather with the forward (--overlap-param-gather); skipping it
    leaves the bucket's gather unfinished and the next iteration fails."""
    with_kwargs = getattr(module, "_forward_pre_hooks_with_kwargs", {})
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if with_kwargs.get(hook_id):
            hook(module, args, {})
        else:
            hook(module, args)


def usable(config) -> bool:
    """Whether the fused head can replace Megatron's output layer + loss for this model."""
    return not (getattr(config, "mtp_num_layers", None) or getattr(config, "use_mup", False)
                or getattr(config, "fp16_lm_cross_entropy", False))


def output_processor(*, hidden_states, output_layer, output_weight, labels, loss_mask, config,
                     compute_language_model_loss, scale_logits, runtime_gather_output=None,
                     chunk_tokens: int = FUSED_HEAD_CHUNK, **_):
    """GPTModel.forward's ``output_processor`` hook (megatron-core >= 0.19): per-token losses
    [b, s] as Megatron's own path returns them, without materialising the logits."""
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    tokens = hidden_states.shape[0] * hidden_states.shape[1] * (
        getattr(config, "tensor_model_parallel_size", 1) if config.sequence_parallel else 1)
    weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    chunk = fused_head_chunk(tokens, weight.shape[1], weight.shape[0], chunk_tokens) if weight is not None else 0
    if labels is None or loss_mask is None or not chunk:
        # Inference, or a micro-batch so small that the fused path's fp32 weight gradient would
        # outweigh the logits it saves: Megatron's own output layer and loss.
        logits, _ = output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        if labels is None:
            return scale_logits(logits).transpose(0, 1).contiguous()
        return compute_language_model_loss(labels, scale_logits(logits))
    _run_forward_pre_hooks(output_layer, (hidden_states,))
    group = getattr(output_layer, "tp_group", None)
    tp = tp_group_size(group)
    x = hidden_states
    if config.sequence_parallel and tp > 1:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    elif tp > 1:
        x = copy_to_tensor_model_parallel_region(x, group=group)
    loss = LinearCrossEntropy.apply(x, weight, labels.transpose(0, 1).contiguous(),
                                    loss_mask.transpose(0, 1).contiguous(), group, chunk,
                                    bool(getattr(config, "gradient_accumulation_fusion", False)),
                                    # (fp16 keeps accumulating in fp32: its loss scale times the
                                    # hidden states would overflow fp16)
                                    fused_head_defers_wgrad(tokens, weight.shape[1]) and x.dtype != torch.float16)
    return loss.transpose(0, 1).contiguous()
