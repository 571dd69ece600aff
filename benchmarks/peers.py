"""What a Hugging Face user would run instead of the skill, on the same GPU and shape: the peers
of issue 38's throughput goal, measured beside `bench` in the same lease.

    python benchmarks/peers.py REQUEST.json PEER [--mbs 2,4,8] [--out FILE]

REQUEST is one of benchmarks/requests/*-shape-bf16.json (its model, or its hf_config, its
sequence length, global batch and iteration counts). PEER:
  liger        transformers' model with Liger's kernels (RoPE, RMSNorm, SwiGLU, fused linear
               cross-entropy), SDPA attention, eager
  torchao-fp8  transformers' model, torchao's Float8 training (dynamic scaling) on every linear
               layer but the output layer, torch.compile
  plain        transformers' model, SDPA attention, eager (the baseline of both)
Each as the Hugging Face Trainer's `bf16=True` trains: fp32 weights, bf16 autocast, torch's
fused AdamW; mock tokens; no recompute; PyTorch's expandable segments, as the skill's runs have
them (an allocator setting from the environment is kept). Each micro-batch size runs in a
process of its own (an out-of-memory one is reported, not fatal); the answer is one JSON object
with tokens/s per micro-batch size and the best.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ("liger", "torchao-fp8", "plain")


def hf_config(request: dict):
    """The transformers config of the request's model: its hf_config file, or the Megatron-style
    shape of the benchmark requests written as a Llama config."""
    from transformers import AutoConfig, LlamaConfig

    if "hf_config" in request:
        return AutoConfig.from_pretrained(str((ROOT / request["hf_config"]).parent))
    m = request["model"]
    return LlamaConfig(hidden_size=m["hidden_size"], intermediate_size=m["ffn_hidden_size"],
                       num_hidden_layers=m["num_layers"], num_attention_heads=m["num_attention_heads"],
                       num_key_value_heads=m["num_query_groups"], head_dim=m["kv_channels"],
                       vocab_size=m["vocab_size"], max_position_embeddings=m["max_position_embeddings"],
                       rope_theta=m["rotary_base"], rms_norm_eps=1e-5,
                       tie_word_embeddings=not m["untie_embeddings_and_output_weights"])


def build(config, peer: str):
    import torch
    from transformers import AutoModelForCausalLM

    if peer == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama, apply_liger_kernel_to_qwen2

        {"llama": apply_liger_kernel_to_llama, "qwen2": apply_liger_kernel_to_qwen2}[config.model_type]()
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, attn_implementation="sdpa").cuda()
    if peer == "torchao-fp8":
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(model, module_filter_fn=lambda mod, fqn: fqn != "lm_head")
        model = torch.compile(model)
    return model


def one(request: dict, peer: str, mbs: int) -> dict:
    """Train at one micro-batch size; tokens/s over the timed optimizer steps."""
    import torch

    seq, gbs = request["seq_length"], request["global_batch_size"]
    warmup, timed = request.get("warmup_iters", 3), request.get("timed_iters", 8)
    config = hf_config(request)
    model = build(config, peer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, config.vocab_size, (gbs // mbs, mbs, seq), device="cuda")
    times, losses = [], []
    for step in range(warmup + timed):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for micro in tokens:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=micro, labels=micro).loss / len(tokens)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - started)
        losses.append(round(float(loss) * len(tokens), 4))
    step_s = statistics.median(times)
    return {"mbs": mbs, "tokens_per_s": round(gbs * seq / step_s), "step_ms": round(step_s * 1e3, 1),
            "max_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2), "losses": losses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("request")
    ap.add_argument("peer", choices=PEERS)
    ap.add_argument("--mbs", default="2,4,8", help="micro-batch sizes to try (default 2,4,8)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)   # a child: one size
    ap.add_argument("--out")
    args = ap.parse_args()
    request = json.loads(Path(args.request).read_text())
    if args.one:
        print(json.dumps(one(request, args.peer, int(args.mbs))))
        return
    # The allocator setting the skill's own runs get (render, bench): a peer that fragments
    # its memory would otherwise run out where the skill's run of the same size does not.
    env = {**os.environ}
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    runs = []
    for mbs in (int(x) for x in args.mbs.split(",")):
        if request["global_batch_size"] % mbs:
            continue
        proc = subprocess.run([sys.executable, __file__, args.request, args.peer, "--mbs", str(mbs), "--one"],
                              capture_output=True, text=True, env=env)
        last = proc.stdout.strip().splitlines()[-1:] or [""]
        if proc.returncode == 0 and last[0].startswith("{"):
            runs.append(json.loads(last[0]))
        else:
            oom = "OutOfMemoryError" in proc.stderr or "out of memory" in proc.stderr
            runs.append({"mbs": mbs, "error": "out of memory" if oom else proc.stderr.strip()[-800:]})
        print(json.dumps(runs[-1])[:300], file=sys.stderr)
    ok = [r for r in runs if "tokens_per_s" in r]
    answer = {"request": args.request, "peer": args.peer, "allocator": env["PYTORCH_CUDA_ALLOC_CONF"], "runs": runs,
              "best": max(ok, key=lambda r: r["tokens_per_s"]) if ok else None}
    text = json.dumps(answer, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
