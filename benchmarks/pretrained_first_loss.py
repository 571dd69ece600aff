"""Train from imported Hugging Face weights and compare the first loss with the source model's.

A Llama-shaped model (8 layers, hidden 1024, 16 heads / 4 groups, MLP 2816, vocabulary 32,000:
a multiple of 128, so Megatron pads no rows) is built randomly here by transformers and saved
(nothing downloaded), converted by import-hf, and trained for one iteration by train from the
import (Megatron's --pretrained-checkpoint; mock data). The run keeps its first batch
(RUN_DIR/first_batch-dp0.pt); the Hugging Face model's loss on those tokens is computed in fp32
and in bf16 autocast and set beside Megatron's logged first loss.

    python benchmarks/pretrained_first_loss.py OUT_DIR [--backend gpu|cpu]

(--backend cpu builds a 2-layer, hidden-256 model of the same vocabulary: the CPU loop's size.)

Writes OUT_DIR/pretrained_first_loss.json.
"""
import glob
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from megatron_skill.contract import call  # noqa: E402


def _hf_model(folder: Path, tiny: bool):
    import torch
    import transformers

    shape = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2) if tiny else dict(hidden_size=1024, intermediate_size=2816,
                                                          num_hidden_layers=8, num_attention_heads=16,
                                                          num_key_value_heads=4)
    config = transformers.LlamaConfig(
        vocab_size=32000, **shape, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.save_pretrained(folder)
    return model


def _loss(model, batches, device, autocast: bool) -> float:
    import torch

    total = count = 0.0
    model = model.to(device)
    with torch.no_grad(), torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=autocast):
        for b in batches:
            logits = model(b["tokens"].to(device)).logits.float()
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].to(device).flatten(),
                                                       reduction="none")
            mask = b["loss_mask"].to(device).flatten().float()
            total += (losses * mask).sum().item()
            count += mask.sum().item()
    return total / count


def main() -> None:
    import torch

    out_dir = Path(sys.argv[1]).absolute()
    backend = sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else "gpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = _hf_model(out_dir / "hf", tiny=backend == "cpu")
    imp = call("import-hf", {"hf_model": str(out_dir / "hf"), "output": str(out_dir / "mcore")})
    assert imp["ok"], imp
    request = {"hf_config": str(out_dir / "mcore" / "hf"), "backend": backend, "num_gpus": 1, "seq_length": 1024,
               "global_batch_size": 8, "runs_root": str(out_dir / "runs"),
               "training": {"pretrained": str(out_dir / "mcore"), "mock_data": True, "train_iters": 1,
                            "log_interval": 1}}
    if backend == "gpu":
        request["gpu"] = "h200" if "H200" in torch.cuda.get_device_name() else "h100-sxm"
    run = call("train", request)
    assert run["ok"], run
    first = run["result"]["loss_curve"][0][1]
    batches = torch.load(glob.glob(str(out_dir / "runs" / "*" / "first_batch-dp0.pt"))[0])
    device = "cuda" if backend == "gpu" else "cpu"
    fp32, bf16 = _loss(model, batches, device, False), _loss(model, batches, device, True)
    record = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if device == "cuda" else "CPU",
              "command": f"python benchmarks/pretrained_first_loss.py OUT_DIR --backend {backend}",
              "megatron_first_loss": first, "hf_loss_fp32": round(fp32, 6), "hf_loss_bf16_autocast": round(bf16, 6),
              "relative_difference_fp32": round(abs(first - fp32) / fp32, 7),
              "relative_difference_bf16": round(abs(first - bf16) / bf16, 7),
              "tokens": int(sum(b["loss_mask"].sum().item() for b in batches)),
              "import_seconds": imp["result"]["seconds"], "run": run["result"]["run_id"]}
    (out_dir / "pretrained_first_loss.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
