"""validate on NVIDIA's own Megatron-LM example scripts, timed as a user runs it (a new process
each, Megatron's parser verdicts not cached), with the GPU count each script is meant for.

    python benchmarks/validate_examples.py /path/to/Megatron-LM   # a checkout at tag core_v0.19.0

Prints one row per script: seconds, valid, the error and warning codes."""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [("examples/llama/train_llama3_8b_h100_fp8.sh", 8), ("examples/gpt3/train_gpt3_175b_distributed.sh", 128),
           ("examples/mixtral/train_mixtral_8x7b_distributed.sh", 64),
           ("examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", 256)]


def main() -> None:
    checkout = Path(sys.argv[1])
    print("| script | GPUs | seconds | valid | errors | warnings |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as cache:
        for rel, gpus in SCRIPTS:
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, str(ROOT / "tools" / "launch.py"), "validate", "--script",
                                   str(checkout / rel), "--num-gpus", str(gpus)], capture_output=True, text=True,
                                  env={**os.environ, "MEGATRON_SKILL_CACHE": cache})
            took = time.perf_counter() - started
            r = json.loads(proc.stdout)["result"]
            print(f"| {rel} | {gpus} | {took:.2f} | {r['valid']} | {', '.join(e['code'] for e in r['errors'])} | "
                  f"{', '.join(w['code'] for w in r['warnings'])} |")


if __name__ == "__main__":
    main()
