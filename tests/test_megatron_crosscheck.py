"""Our FLOPs and weight/optimizer memory against Megatron's own code, over many configurations.

FLOPs must be equal: MFU here means what Megatron's log means.  Weight and optimizer
memory must be equal where the two models describe the same thing; where ours differs on
purpose, the test states the difference and checks it is exactly that.
"""
import random

import pytest

from megatron_skill.adapter import arguments as megatron_args
from megatron_skill.adapter import parser as megatron_parser
from megatron_skill.core import catalog
from megatron_skill.core.flops import padded_vocab_size, training_flops
from megatron_skill.core.layout import Layout, check_layout
from megatron_skill.core.memory import stage_memory

megatron_training = pytest.importorskip("megatron.training.training")
from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory  # noqa: E402

GPU = catalog.get_gpu("h100-sxm")


def _configs(n_per_model: int = 6, seed: int = 0):
    rng = random.Random(seed)
    for name in catalog.model_names():
        m = catalog.get_model(name)
        made = 0
        for _ in range(400):
            if made == n_per_model:
                break
            tp, pp, cp = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2])
            dp = rng.choice([1, 2, 4, 8])
            ep = rng.choice([e for e in (1, 2, 4, 8) if m.is_moe and m.num_experts % e == 0] or [1])
            seq = rng.choice([1024, 2048, 4096])
            mbs = rng.choice([1, 2])
            lay = Layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, mbs=mbs, gbs=mbs * dp * 4, seq_length=seq,
                         sequence_parallel=tp > 1, distributed_optimizer=rng.random() < 0.7)
            if check_layout(lay, m, GPU, lay.world_size):
                continue
            made += 1
            yield m, lay


CONFIGS = list(_configs())


def _megatron_args(m, lay):
    argv = (megatron_args.model_args(m, lay.seq_length) + megatron_args.layout_args(lay, m)
            + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(m.vocab_size),
               "--train-iters", "10", "--lr", "1e-4"])
    args = megatron_parser.parse(argv, world_size=lay.world_size)
    args.padded_vocab_size = padded_vocab_size(m.vocab_size, lay.tp)
    return args


def test_enough_configurations_were_generated():
    assert len(CONFIGS) >= 50
    assert {m.name for m, _ in CONFIGS} == set(catalog.model_names())


@pytest.mark.parametrize("m,lay", CONFIGS, ids=[f"{m.name}-{lay.label()}" for m, lay in CONFIGS])
def test_flops_equal_megatron(m, lay):
    args = _megatron_args(m, lay)
    theirs = megatron_training.num_floating_point_operations(args, lay.gbs)
    ours = training_flops(m, lay.seq_length, lay.gbs, args.padded_vocab_size)
    assert ours == pytest.approx(theirs, rel=1e-12)


def _bias_and_extra_params(m):
    """Parameters we count and Megatron's estimator leaves out, per layer and in the embedding."""
    per_layer = 0
    if m.add_bias_linear or m.add_qkv_bias:
        q, kv = m.num_attention_heads * m.head_dim, 2 * m.query_groups * m.head_dim
        per_layer += q + kv
    if m.add_bias_linear:
        per_layer += m.hidden_size + (2 if m.gated else 1) * m.ffn_hidden_size + m.hidden_size
    if m.qk_layernorm:
        per_layer += 2 * m.head_dim
    pos = m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    return per_layer, pos


@pytest.mark.parametrize("m,lay", CONFIGS, ids=[f"{m.name}-{lay.label()}" for m, lay in CONFIGS])
def test_weight_and_optimizer_memory_against_megatron(m, lay):
    args = _megatron_args(m, lay)
    # On purpose: the distributed optimizer shards over DP x CP (Megatron's dp-cp group, see
    # DistributedOptimizer); Megatron's estimator divides by DP alone.  Give it our group size.
    args.data_parallel_size = lay.dp * lay.cp
    theirs = compute_weight_and_optimizer_memory(args)
    first = stage_memory(m, lay, 0, args.padded_vocab_size)
    ours = first.weights + first.gradients + first.optimizer
    pattern = m.moe_pattern()
    if m.mtp_num_layers or (m.is_moe and 0 in pattern):
        # On purpose: Megatron's estimator puts the average MoE layer (and the MTP block) on the
        # most loaded rank; we place each layer on its real rank (DeepSeek-V3's three dense
        # layers on the first, MTP on the last).  Only the order of magnitude must agree.
        assert 0.5 < ours / theirs < 1.5
        return
    dp_shard = lay.dp * lay.cp if lay.distributed_optimizer else 1
    bytes_per = 6 + 12 / dp_shard
    per_layer_extra, pos_extra = _bias_and_extra_params(m)
    layers = first.layers
    extra = per_layer_extra * layers / lay.tp + pos_extra
    # On purpose: we count linear biases, QK-norm weights and learned position embeddings,
    # which Megatron's estimator leaves out; the difference must be exactly those.
    assert ours == pytest.approx(theirs + extra * bytes_per, rel=1e-3)


def test_published_flops_of_llama3_8b():
    # 6 N T plus attention: a sanity anchor independent of Megatron's code.
    m = catalog.get_model("llama3-8b")
    f = training_flops(m, 8192, 1, 128256)
    six_nt = 6 * m.total_params() * 8192
    assert 1.0 < f / six_nt < 1.3


def test_the_parser_help_text_kept_per_class_is_megatrons_own():
    """adapter/parser.py keeps the help text Megatron reads from its config classes' source (once a
    class, not on every parse): the same text as Megatron's own reading, a fresh copy each time, and
    the parser built from it the same on a second parse."""
    from megatron.core.transformer import TransformerConfig
    from megatron.training.argument_utils import ArgumentGroupFactory

    megatron_parser._module()
    kept = ArgumentGroupFactory._get_field_docstrings
    assert getattr(kept, "_kept_per_class", False)
    factory = ArgumentGroupFactory(TransformerConfig)
    own = kept.__wrapped__(factory, TransformerConfig)
    assert factory.field_docstrings == own and len(own) > 50
    factory.field_docstrings.clear()
    assert ArgumentGroupFactory(TransformerConfig).field_docstrings == own
    first, second = megatron_parser.parse(["--num-layers", "2"]), megatron_parser.parse(["--num-layers", "2"])
    assert vars(first) == vars(second)


def test_importing_megatrons_parser_leaves_torch_as_it_was():
    """adapter/parser.py defers two of torch's import-time costs while it imports Megatron's parser
    (torch.compile's decoration, the source read for each custom op's place): both are torch's own
    again afterwards, for anything else the process runs."""
    import torch
    import torch._library.utils as library_utils

    compile_before, source_before = torch.compile, library_utils.get_source
    megatron_parser._module()
    assert torch.compile is compile_before and library_utils.get_source is source_before
