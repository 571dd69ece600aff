"""Time and peak memory of import-hf and export-hf for a 1B-class shape (Llama 3.2 1B's: 16
layers, hidden 2048, 32 heads / 8 groups, MLP 8192, vocabulary 128,256, tied embeddings),
randomly initialised here and saved in bf16 by transformers (nothing downloaded). The peak
resident memory is each tool's own report (the operating system's maximum resident set size of
the import's largest worker, of the export's process).

    python benchmarks/convert_speed.py OUT_DIR [TP]      # TP: the import's workers (default 1)

Writes OUT_DIR/convert_speed.json and prints a table row for references/benchmarks.md.
"""
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hf_model(folder: Path) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=True, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(folder, max_shard_size="1GB")


def _tool(name: str, *args: str) -> tuple[dict, float]:
    """(answer, seconds)."""
    started = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), name, *args], capture_output=True,
                          text=True)
    seconds = time.time() - started
    out = json.loads(proc.stdout)
    if not out["ok"]:
        raise SystemExit(f"{name} failed: {out['error']}\n{proc.stderr[-3000:]}")
    return out["result"], seconds


def main() -> None:
    out_dir = Path(sys.argv[1])
    tp = sys.argv[2] if len(sys.argv) > 2 else "1"
    out_dir.mkdir(parents=True, exist_ok=True)
    hf = out_dir / "hf-1b"
    if not (hf / "config.json").exists():
        print("building and saving the 1B-class model ...", file=sys.stderr)
        _hf_model(hf)
    shard_bytes = max(f.stat().st_size for f in hf.glob("*.safetensors"))
    imp, imp_s = _tool("import-hf", "--hf-model", str(hf), "--output", str(out_dir / "mcore"),
                                "--layout", json.dumps({"tp": int(tp)}))
    exp, exp_s = _tool("export-hf", "--checkpoint", str(out_dir / "mcore"), "--output",
                                str(out_dir / "hf-back"))
    record = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
              "command": f"python benchmarks/convert_speed.py OUT_DIR {tp}",
              "weights_gib": round(imp["bytes_read"] / 2**30, 2), "largest_shard_gib": round(shard_bytes / 2**30, 2),
              "import": {"seconds": round(imp_s, 1), "workers": imp["workers"],
                         "peak_rss_mib_per_worker": imp["peak_rss_mib_per_worker"]},
              "export": {"seconds": round(exp_s, 1), "peak_rss_mib": exp["peak_rss_mib"], "dtype": exp["dtype"]}}
    (out_dir / "convert_speed.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
