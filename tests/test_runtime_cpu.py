"""The training runtime on CPU: the layer spec, SDPA attention, real optimizer steps of a tiny
GPT with gloo, checkpoint save / reload, tensor-parallel parity, Megatron's dataset builder."""
from conftest import require_modules  # noqa: E402

require_modules('torch', 'numpy', 'megatron.core')

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT

LOOP = ROOT / "tools" / "megatron_skill" / "runtime" / "cpu_loop.py"
TINY = {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 256, "num_attention_heads": 4,
        "num_query_groups": 2, "kv_channels": 16, "vocab_size": 256}


def _config(tmp: Path, **over) -> Path:
    cfg = {"model": TINY, "tp": 1, "seq_length": 64, "padded_vocab_size": 256, "vocab_size": 256, "seed": 1234,
           "lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 2, "weight_decay": 0.1, "train_iters": 6,
           "global_batch_size": 4, "micro_batch_size": 2, "log_interval": 1, "save_interval": 3,
           "save": str(tmp / "ckpt"), "data_cache": str(tmp / "cache")}
    cfg.update(over)
    path = tmp / f"cfg-{len(list(tmp.glob('cfg-*')))}.json"
    path.write_text(json.dumps(cfg))
    return path


def _run_loop(cfg: Path, nproc: int = 1) -> dict[int, float]:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(LOOP), str(cfg)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from megatron_skill.adapter.log import parse
    return {r["iteration"]: r["loss"] for r in parse(proc.stdout.splitlines())["iterations"]}


def test_sdpa_attention_matches_reference_math():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_skill.runtime.attention import SDPAttention

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                            use_cpu_initialization=True)
    attn = SDPAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal).eval()  # no dropout
    torch.manual_seed(0)
    s, b = 10, 3
    q = torch.randn(s, b, 4, 16, dtype=torch.float64)
    k = torch.randn(s, b, 2, 16, dtype=torch.float64)
    v = torch.randn(s, b, 2, 16, dtype=torch.float64)
    out = attn(q, k, v, None)
    # Reference: explicit softmax(QK^T / sqrt(d) + causal mask) V with each KV group shared by 2 heads.
    kk, vv = k.repeat_interleave(2, dim=2), v.repeat_interleave(2, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) / math.sqrt(16)
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv).reshape(s, b, 64)
    assert out.shape == (s, b, 64)
    torch.testing.assert_close(out, ref)
    # Megatron's dataloader mask (True = not allowed) gives the same values by the explicit-mask path.
    dataloader_mask = torch.triu(torch.ones(b, 1, s, s, dtype=torch.bool), 1)
    torch.testing.assert_close(attn(q, k, v, dataloader_mask), ref)


def test_the_local_path_renders_no_dataloader_mask_so_attention_runs_causal():
    """With the mask built by the dataloader SDPA computes the full square under it; without it
    the causal kernel runs.  The rendered local path turns the mask off, in Megatron's own terms."""
    from megatron_skill.adapter import arguments as megatron_args
    from megatron_skill.adapter import parser as megatron_parser

    flags = megatron_args.local_impl_flags()
    assert "--no-create-attention-mask-in-dataloader" in flags
    assert "--no-create-attention-mask-in-dataloader" not in megatron_args.local_impl_flags(skill_entry=False)
    args = megatron_parser.parse(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                  "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                                  "--transformer-impl", "local", *flags])
    assert args.create_attention_mask_in_dataloader is False and args.skill_linear_cross_entropy


def test_layer_spec_swaps_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_skill.core.options import RuntimeOptions
    from megatron_skill.runtime.attention import SDPAttention
    from megatron_skill.runtime.specs import local_sdpa_spec

    opts = RuntimeOptions.from_request({"native_gqa": True, "sdpa_backend": "flash"}, te=False)
    ours, stock = local_sdpa_spec(opts, normalization="RMSNorm"), get_gpt_layer_local_spec(normalization="RMSNorm")
    core = ours.submodules.self_attention.submodules.core_attention
    assert core.module is SDPAttention and core.params == {"native_gqa": True, "backend": "flash"}
    assert ours.submodules.self_attention.submodules.linear_qkv == stock.submodules.self_attention.submodules.linear_qkv
    assert repr(ours.submodules.mlp) == repr(stock.submodules.mlp)  # partials compare by identity
    moe = local_sdpa_spec(opts, num_experts=4, normalization="RMSNorm")
    assert moe.submodules.self_attention.submodules.core_attention.module is SDPAttention


def test_norms_allow_sequence_parallel_and_mark_their_weights():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_skill.runtime.norm import SequenceParallelNorm
    from megatron_skill.runtime.specs import block_spec

    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm",
                            tensor_model_parallel_size=1, use_cpu_initialization=True)
    cfg.sequence_parallel = True  # what a TP > 1 run sets; Megatron's torch norm refuses it
    norm = SequenceParallelNorm(cfg, 64)
    assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
    from megatron_skill.core.options import RuntimeOptions

    block = block_spec(cfg, RuntimeOptions.from_request(None, te=False), pp_rank=0)
    assert block.layer_norm is SequenceParallelNorm
    assert all(s.submodules.input_layernorm is SequenceParallelNorm for s in block.layer_specs)


def test_compat_uses_the_prebuilt_dataset_helpers():
    import megatron.core.datasets.utils as dataset_utils

    from megatron_skill.runtime import compat, patches

    assert compat.prebuilt_helpers_available()
    assert patches.by_name("dataset helpers").apply()
    dataset_utils.compile_helpers()  # a no-op now: would run make and exit otherwise


def test_norm_recompute_without_te_leaves_the_fp8_branch_alone():
    """Selective recompute of the norms (CheckpointWithoutOutput) took its FP8 branch for
    fp8=False and hit TE's missing FP8GlobalStateManager (NameError on the H200); compat
    switches the branch off without TE.  (Its forward needs CUDA's RNG state: GPU only.)"""
    from megatron.core.tensor_parallel import random

    from megatron_skill.runtime import patches

    assert not random.HAVE_TE and random.CheckpointWithoutOutput.__init__ is not None
    assert patches.by_name("selective recompute").apply()
    assert random.CheckpointWithoutOutput().fp8 is False
    assert random.CheckpointWithoutOutput(fp8="tensorwise").fp8 is False


def test_entry_loss_func_sums_masked_tokens():
    from megatron_skill.runtime.entry import loss_func

    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    loss, n, report = loss_func(mask, losses)
    assert loss.item() == 7.0 and n.item() == 3
    assert report["lm loss"].tolist() == [7.0, 3.0]


@pytest.mark.slow
def test_tiny_gpt_trains_and_resumes_from_checkpoint_exactly(tmp_path):
    straight = _run_loop(_config(tmp_path / "a" if (tmp_path / "a").mkdir() is None else tmp_path))
    assert len(straight) == 6 and straight[6] < straight[1]  # real optimizer steps lower the loss
    part = tmp_path / "b"
    part.mkdir()
    first = _run_loop(_config(part, train_iters=3, save_interval=3))
    resumed = _run_loop(_config(part, train_iters=6, save_interval=3))
    assert sorted(resumed) == [4, 5, 6] and first.keys() == {1, 2, 3}
    # The same next losses as the uninterrupted run: weights, optimizer state, RNG and data position restored.
    for it in (1, 2, 3):
        assert first[it] == straight[it]
    for it in (4, 5, 6):
        assert resumed[it] == pytest.approx(straight[it], rel=1e-6)
    a = torch.load(tmp_path / "a" / "ckpt" / "iter_0000006" / "mp_rank_00.pt", weights_only=False)["model"]
    b = torch.load(part / "ckpt" / "iter_0000006" / "mp_rank_00.pt", weights_only=False)["model"]
    for key, value in a.items():
        if torch.is_tensor(value) and value.is_floating_point():
            torch.testing.assert_close(value, b[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_matches_one(tmp_path):
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    one.mkdir(), two.mkdir()
    l1 = _run_loop(_config(one, train_iters=3, save_interval=None, global_batch_size=2, micro_batch_size=2))
    l2 = _run_loop(_config(two, train_iters=3, save_interval=None, global_batch_size=2, micro_batch_size=2, tp=2),
                   nproc=2)
    # Same initial weights (initialised whole, then split) and the same data: the same losses,
    # up to the order of floating-point reductions across the two ranks.
    for it in (1, 2, 3):
        assert l2[it] == pytest.approx(l1[it], rel=2e-4)


def test_gpt_dataset_over_an_indexed_dataset(tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    from megatron_skill.runtime import patches

    patches.by_name("dataset helpers").apply()
    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    for _ in range(50):
        doc = rng.integers(1, 255, size=rng.integers(20, 80)).astype(np.int32)
        builder.add_document(torch.from_numpy(doc), [len(doc)])  # one sequence per document
    builder.finalize(prefix + ".idx")
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=32, blend=([prefix], None), split="90,10,0",
                           tokenizer=NullTokenizer(vocab_size=256), reset_position_ids=False,
                           reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"),
                           mid_level_dataset_surplus=0.005)
    train, valid, _ = BlendedMegatronDatasetBuilder(GPTDataset, [20, 4, None], lambda: True, cfg).build()
    sample = train[0]
    assert sample["tokens"].shape == (32,) and sample["labels"].shape == (32,)
    assert len(train) >= 20 and valid is not None


@pytest.mark.slow
def test_train_tool_cpu_run_is_never_started_twice(tmp_path, cli):
    req = ["--model", "tiny-gpt", "--seq-length", "64", "--global-batch-size", "4",
           "--training", '{"train_iters": 4, "log_interval": 1, "save_interval": 2}', "--runs-root", str(tmp_path)]
    rc, dry, _ = cli("train", *req, "--dry-run")
    assert rc == 0 and dry["result"]["dry_run"] and not (tmp_path / dry["request_id"]).exists()
    assert any("cpu_loop.py" in a for a in dry["result"]["actions"])
    rc, first, err = cli("train", *req)
    assert rc == 0, (first, err[-2000:])
    res = first["result"]
    assert res["backend"] == "cpu" and res["summary"]["last_iteration"] == 4 and res["checkpoint_iteration"] == 4
    assert res["summary"]["final_loss"] < res["summary"]["first_loss"]
    assert "train: iter 4/4" in err  # live progress on stderr
    rc, again, err2 = cli("train", *req)
    assert rc == 0 and again["result"]["already_finished"] and again["request_id"] == first["request_id"]
    assert "nothing launched" in err2
    # A run left behind by a killed job is continued by the same request: from its checkpoint
    # when it saved one (the dry-run says so first) ...
    run_dir = tmp_path / first["request_id"]
    s = json.loads((run_dir / "state.json").read_text())
    (run_dir / "state.json").write_text(json.dumps({**s, "status": "killed"}))
    rc, dry, _ = cli("train", *req, "--dry-run")
    assert rc == 0 and dry["result"]["start"] == "resume" and dry["result"]["resume_from"] == 4
    rc, resumed, _ = cli("train", *req)
    assert rc == 0 and resumed["request_id"] == first["request_id"] and resumed["result"]["start"] == "resume"
    assert resumed["result"]["resumed_from"] == 4
    # ... and from the start when it failed before its first checkpoint.
    (run_dir / "state.json").write_text(json.dumps({**s, "status": "failed"}))
    for leftover in (run_dir / "checkpoints").iterdir():
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    rc, restarted, err = cli("train", *req)
    assert rc == 0 and restarted["result"]["start"] == "restart" and "starting over" in err
    assert restarted["result"]["summary"]["last_iteration"] == 4


def test_cpu_train_refuses_large_models(cli, tmp_path):
    rc, out, _ = cli("train", "--model", "llama3-8b", "--backend", "cpu", "--runs-root", str(tmp_path))
    assert rc == 5 and out["error"]["code"] == "environment" and "tiny-gpt" in out["error"]["fix"]


@pytest.mark.slow
@pytest.mark.parametrize("mbs,seq,vocab,deferred", [(2, 256, 256, False), (1, 96, 1024, True)])
def test_fused_linear_cross_entropy_trains_like_megatrons_output_layer(tmp_path, mbs, seq, vocab, deferred):
    """Through GPTModel's output_processor hook, with the vocabulary split over two TP ranks:
    the same losses over optimizer steps as Megatron's own output layer and loss on one rank,
    whether the head accumulates its weight gradient in the forward (512-token micro-batches) or
    keeps the logit gradients for the backward (96 tokens, under twice the hidden size of 64)."""
    from megatron_skill.core.memory import fused_head_chunk, fused_head_defers_wgrad

    tokens, h = mbs * seq, TINY["hidden_size"]
    assert fused_head_defers_wgrad(tokens, h) is deferred and fused_head_chunk(tokens, h, vocab // 2, 32)
    one, two = tmp_path / "plain", tmp_path / "fused"
    one.mkdir(), two.mkdir()
    kw = dict(train_iters=3, save_interval=None, global_batch_size=2, micro_batch_size=mbs, seq_length=seq,
              vocab_size=vocab, padded_vocab_size=vocab)
    plain = _run_loop(_config(one, **kw))
    # in chunks of 32 tokens (8 where the head keeps the logit gradients): the fused path keeps
    # less than the logits, so it runs (core.memory.fused_head_runs).
    fused = _run_loop(_config(two, tp=2, fused_head=True, fused_head_chunk=32, **kw), nproc=2)
    for it in (1, 2, 3):
        assert fused[it] == pytest.approx(plain[it], rel=2e-4)


@pytest.mark.slow
def test_pipeline_parallel_two_stages_match_one(tmp_path):
    """Megatron-Core's own stage split (pre_process / post_process, layer offsets,
    set_input_tensor), two gloo ranks passing activations and gradients: the same losses as
    one stage from the same initial weights, global-norm clipping included."""
    one, two = tmp_path / "pp1", tmp_path / "pp2"
    one.mkdir(), two.mkdir()
    init = str(one / "initial.pt")
    kw = dict(train_iters=3, save_interval=None, global_batch_size=4, micro_batch_size=2)
    l1 = _run_loop(_config(one, save_initial=init, **kw))
    l2 = _run_loop(_config(two, pp=2, load_initial=init, **kw), nproc=2)
    for it in (1, 2, 3):
        assert l2[it] == pytest.approx(l1[it], rel=2e-4)


@pytest.mark.slow
def test_fp8_linear_layers_train_like_bf16(tmp_path):
    """A tiny GPT with its attention and MLP linears in FP8 (emulated on CPU: the same quantised
    values torch._scaled_mm multiplies on a GPU) follows the full-precision losses closely."""
    a, b = tmp_path / "full", tmp_path / "fp8"
    a.mkdir(), b.mkdir()
    kw = dict(train_iters=5, save_interval=None, global_batch_size=2, micro_batch_size=2)
    full = _run_loop(_config(a, **kw))
    fp8 = _run_loop(_config(b, fp8_linear=True, **kw))
    assert any(fp8[it] != full[it] for it in full)  # the FP8 path was taken
    for it in full:
        assert fp8[it] == pytest.approx(full[it], rel=0.02)
    assert fp8[5] < fp8[1]
    # delayed scaling (the request's runtime.fp8_scaling reaches the loop's layers): the first
    # pass of each input scales as current scaling does, later ones by the previous maximum
    c = tmp_path / "fp8-delayed"
    c.mkdir()
    delayed = _run_loop(_config(c, fp8_linear=True, fp8_scaling="delayed", **kw))
    assert delayed[1] == fp8[1] and any(delayed[it] != fp8[it] for it in fp8)
    for it in full:
        assert delayed[it] == pytest.approx(full[it], rel=0.02)


def test_a_failed_run_reports_the_ranks_error_not_torchruns(tmp_path):
    from megatron_skill.tools.train import _log_tail

    log = tmp_path / "train.log"
    log.write_text("\n".join([
        "[rank0]: Traceback (most recent call last):", '[rank0]:   File "x.py", line 1, in <module>',
        "[rank0]: AssertionError: One or both of the .idx and .bin files cannot be found",
        "Exception ignored in: <function IndexedDataset.__del__>", "Traceback (most recent call last):",
        '  File "y.py", line 2, in __del__', "AttributeError: no attribute 'bin_reader'",
        "Traceback (most recent call last):", '  File "run.py", line 3, in main',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "Root Cause (first observed failure):"]))
    tail = _log_tail(log)
    assert tail[0] == "Traceback (most recent call last):" and tail[-1].startswith("AssertionError: One or both")


@pytest.mark.slow
def test_compiled_rope_and_native_gqa_train_like_the_plain_layers(tmp_path):
    """The element-wise fused paths inside a real GPTModel run (gloo, two TP ranks): the same
    losses over optimizer steps as Megatron's eager RoPE with expanded keys and values."""
    one, two = tmp_path / "plain", tmp_path / "fused"
    one.mkdir(), two.mkdir()
    kw = dict(train_iters=3, save_interval=None, global_batch_size=2, micro_batch_size=2, tp=2)  # 2 heads, 1 group a rank
    plain = _run_loop(_config(one, **kw), nproc=2)
    fused = _run_loop(_config(two, compiled_rope=True, native_gqa=True, **kw), nproc=2)
    for it in (1, 2, 3):
        assert fused[it] == pytest.approx(plain[it], rel=1e-4)
