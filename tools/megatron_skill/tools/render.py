"""The render tool: launch scripts from templates/, every Megatron flag checked first.

A render request is a plan request (model, cluster, sequence, batch) plus, optionally, the
layout to use (else the planner's best), the launcher, and the training settings.  The
run id is the request id: the same request always writes the same files to the same place.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

from .. import files
from ..adapter import arguments as megatron_args
from ..adapter import flags as megatron_flags
from ..adapter import images
from ..contract import ROOT, Context, Tool, invoke
from ..convert import pretrained
from ..convert.pretrained import pretraining_rate_warning, training_settings
from ..core.defaults import schema_defaults
from ..core.flops import padded_vocab_size
from ..core.layout import RULES, Layout, check_layout
from ..core.megatron_options import MegatronOptions
from ..core.moe import MoEOptions
from ..core.options import RuntimeOptions, fp8_local_note
from ..core.planner import predict, rank, search
from ..core.resolve import (
    DEFAULT_TRAIN_ITERS,
    check_precision,
    default_global_batch,
    default_seq_length,
    fake_rank,
    resolve_cluster,
    resolve_model,
)
from ..data.datasets import MASK_SUFFIX, is_weight, match_tokenizer
from ..errors import ToolError
from ..locks import write_atomic

TEMPLATES = ROOT / "templates"
LAUNCHERS = {"torchrun": "torchrun.sh.j2", "torchrun-multinode": "torchrun_multinode.sh.j2",
             "slurm": "slurm.sbatch.j2", "kubernetes": "kubernetes.yaml.j2"}
SCRIPT_NAMES = {"torchrun": "launch.sh", "torchrun-multinode": "launch_multinode.sh", "slurm": "launch.sbatch",
                "kubernetes": "pytorchjob.yaml"}
ENTRY_SCRIPT = ROOT / "tools" / "pretrain_gpt.py"
RUN_DIR_MARK = megatron_args.job_variable("RUN_DIR")  # no run_dir given: the script's own $RUN_DIR
# #SBATCH lines are read by sbatch, not bash: quoting does not apply, so values must be plain.
SLURM_SAFE = re.compile(r"^[A-Za-z0-9._:+@-]+$")
SLURM_PATH = re.compile(r"^/[A-Za-z0-9._/+@-]+$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _comment(value: object) -> str:
    """Text safe inside a '#' comment: no line breaks or control characters."""
    return "".join(ch if ch.isprintable() else "?" for ch in str(value))


def _quote(value: object) -> str:
    """shlex.quote, and quotes around commas and equals signs too (bash does not need them;
    in an array shellcheck reads a bare comma as a mistake, SC2054, and a bare '=' as a
    mistaken index assignment, SC2191)."""
    text = shlex.quote(str(value))
    return f"'{text}'" if ("," in text or "=" in text) and not text.startswith("'") else text


def _path(value: str) -> str:
    """A path argparse cannot mistake for a flag: './-x', not '-x'."""
    return "./" + value if value.startswith("-") else value


def _job_path(req: dict, key: str) -> str | None:
    """A path of the job's machine as the script writes it: quoted, so a leading ~ would stay a
    folder named ~ (bash expands it only bare), and the home folder here is not the job's."""
    value = req.get(key)
    if value is not None and value.startswith("~"):
        raise ToolError("bad_request", f"{key} {value!r} starts with ~, which the script's quoted paths do not "
                        "expand (the job would write into a folder named ~)", where=f"/{key}",
                        fix=f"give {key} as an absolute path on the machine the job runs on"
                            + (", or leave it out (runs/RUN_ID in the folder the job starts in)" if key == "run_dir" else ""))
    return value


def _environment():
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["q"] = _quote
    env.filters["comment"] = _comment
    env.filters["yq"] = lambda v: json.dumps(str(v))  # a YAML double-quoted scalar
    return env


def _group_args(argv: list[str]) -> list[list[str]]:
    """One flag and its values per line, so the script reads like a Megatron command."""
    lines: list[list[str]] = []
    for a in argv:
        if a.startswith("--") or not lines:
            lines.append([a])
        else:
            lines[-1].append(a)
    return lines


def _needs_te(lay: Layout, model, gpu) -> str:
    """What of the layout only Transformer Engine's layers run, in words (the rule it breaks on
    local layers); empty when the local layers run it too."""
    rule = check_layout(lay, model, gpu, lay.world_size, te=False)
    return RULES[rule].message if rule in ("cp_needs_te", "qk_norm_sp_needs_te") else ""


def _layout_from_request(req: dict, model, gpu, n_gpus: int, seq: int, gbs: int) -> tuple[Layout, Any]:
    opts = RuntimeOptions.from_request(req.get("runtime"), te=req["transformer_engine"], moe=req.get("moe"),
                                       megatron=req.get("megatron_options"))
    opts.megatron.check_request((req.get("layout") or {}).get("precision") or req["precision"], opts.te)
    if req.get("layout"):
        fields = {k: v for k, v in req["layout"].items() if k in {f.name for f in dataclasses.fields(Layout)}}
        fields.update(seq_length=seq, gbs=gbs)
        fields.setdefault("precision", req["precision"])
        fields.setdefault("dp", max(1, n_gpus // (fields.get("tp", 1) * fields.get("pp", 1) * fields.get("cp", 1))))
        fields.setdefault("sequence_parallel", fields.get("tp", 1) > 1)
        lay = Layout(**fields)
        rule = check_layout(lay, model, gpu, n_gpus, req["transformer_engine"], opts.moe, opts.megatron)
        if rule:
            raise ToolError("infeasible", f"the layout {lay.label()} breaks the rule {rule!r}: {RULES[rule].message}",
                            where="/layout", fix=f"{RULES[rule].for_request()}; or run plan and take one of its layouts")
        cand = predict(model, gpu, lay, padded_vocab_size(model.vocab_size, lay.tp), opts)
        if cand.peak_gib > gpu.memory_gib:
            raise ToolError("infeasible", f"the layout {lay.label()} needs {cand.peak_gib:.1f} GiB per GPU, "
                            f"more than the {gpu.memory_gib} GiB of {gpu.key}", where="/layout",
                            fix="more recompute, a smaller micro-batch, or more TP/PP; plan finds one that fits")
        return lay, cand
    check_precision(req["precision"], gpu)
    precisions = ["fp8"] if req["precision"] == "fp8" else ["bf16"]
    res = search(model, gpu, n_gpus, seq, gbs, precisions, opts=opts)
    if not res.candidates:
        raise ToolError("infeasible", f"no layout of {model.name} fits {n_gpus} x {gpu.key}", where="/num_gpus",
                        fix="run plan for the reasons, and change the GPU count, batch or sequence length")
    best = rank(res.candidates)[0]
    return best.layout, best


def default_runs_root() -> Path:
    """Where outputs go when no folder is given: MEGATRON_SKILL_RUNS, else ./runs; never inside
    the skill's own folder where that cannot be written (an installed skill is often read-only)."""
    import os

    if os.environ.get("MEGATRON_SKILL_RUNS"):
        return Path(os.environ["MEGATRON_SKILL_RUNS"])
    here = Path.cwd().resolve()
    if here.is_relative_to(ROOT) and not os.access(ROOT, os.W_OK):
        return Path.home() / "megatron-runs"
    return Path("runs")


def _container(req: dict, launcher: str) -> dict | None:
    spec = req.get("container")
    if not spec:
        return None
    if launcher != "slurm":
        raise ToolError("bad_request", f"containers are rendered for Slurm job steps, not for {launcher}",
                        where="/container", fix="use launcher slurm, or start the torchrun script inside the container")
    return {"mounts": [], **spec, "given_image": spec["image"],
            "image": images.for_runtime(spec["image"], spec["runtime"], where="/container/image"),
            "command": "singularity" if spec["runtime"] == "singularity" else "apptainer"}


def _home_relative_skill() -> str:
    """The skill's folder as "$HOME/..." when it lives in the home folder of whoever renders: cluster
    nodes mostly share home folders, and $HOME is the job's own there. Empty otherwise (the job
    then needs MEGATRON_SKILL_HOME): no path of this machine is written."""
    import os

    try:
        rel = ROOT.relative_to(Path(os.path.expanduser("~")).resolve())
    except ValueError:
        return ""
    return f"$HOME/{rel}" if re.fullmatch(r"[A-Za-z0-9._/+-]+", str(rel)) and str(rel) != "." else ""


def _k8s_context(context: dict, k8s: dict, run_id: str, nodes: int, req: dict, training: dict) -> dict:
    """What the PyTorchJob template needs: the pods' environment, and the job step (the same checks
    and Megatron vector as every launcher) that each pod runs."""
    env = [("RUN_ID", run_id), ("RUN_DIR", context["run_dir"]), ("PYTHON", req["python"]),
           ("MEGATRON_SKILL_HOME", context["skill_home"])]
    if context["data_from_env"]:  # the values a user fills in (the step says so when they are empty)
        env += [("DATA_PATH", "")] + ([("TOKENIZER_MODEL", "")] if context["tokenizer_from_env"] else [])
    env += list(context["env"].items())
    step = _environment().get_template("kubernetes_step.sh.j2").render(**context)
    step = megatron_args.JOB_VARIABLE.sub(r'"$\1"', step)
    preflight = ""
    if context["import_step"]:
        preflight = _environment().get_template("kubernetes_preflight.sh.j2").render(**context).rstrip("\n")
    return {"k8s": k8s, "k8s_name": f"megatron-{run_id[:8].lower()}", "pod_env": env, "step": step.rstrip("\n"),
            "preflight": preflight,
            "roles": [(role, n) for role, n in (("Master", 1), ("Worker", nodes - 1)) if n > 0]}


def _data_checks(training: dict) -> list[str]:
    """The files the job checks for where it runs (shell words): each dataset's .bin and .idx, the
    tokenizer folder; from the job's environment when the request gives no data."""
    start = [_quote(training["pretrained"])] if training.get("pretrained") else []  # the weights to start from
    if training.get("mock_data"):
        return start
    given = [_quote(training[f]) for f in TOKENIZER_FILES if training.get(f)]
    if not training.get("data_path"):
        return ['"$DATA_PATH.bin"', '"$DATA_PATH.idx"'] + (['"$TOKENIZER_MODEL"'] if _tokenizer_from_env(training)
                                                          else given) + start
    words = [_quote(p + ext) for p in training["data_path"] if not is_weight(p) for ext in (".bin", ".idx")]
    return words + given + start


def _data_mounts(training: dict, mounts: list[str]) -> list[str]:
    """The folders of the datasets and the tokenizer files the request names, the checkpoint the
    run starts from, and the folder its checkpoints are saved in, mounted into the container at
    their own paths (the job step checks and reads them there, and a save inside the container's
    own file system is lost with it), unless a mount already covers them (the run folder; the
    import's folder holds its tokenizer before it exists). Relative paths and the run folder's
    are the job's own and are left as they are."""
    named = [(f"/training/data_path/{i}", str(Path(p).parent)) for i, p in enumerate(training.get("data_path") or [])
             if not is_weight(p)] + [(f"/training/{f}", training[f]) for f in TOKENIZER_FILES if training.get(f)]
    if training.get("pretrained"):
        named.append(("/training/pretrained", training["pretrained"]))
    if training.get("save"):   # Megatron makes the folder itself: its parent is what exists
        named.append(("/training/save", str(Path(training["save"]).parent)))
    targets = [m.split(":")[1] for m in mounts]
    added = []
    for where, path in named:
        path = path.rstrip("/") or "/"
        if not path.startswith("/") or any(path == t or path.startswith(t.rstrip("/") + "/") for t in targets):
            continue
        if path == "/" or not MOUNTABLE.match(path):
            raise ToolError("bad_request", f"{path!r} cannot be mounted into the container (the folder / itself, or "
                            "characters a mount list cannot carry)", where=where,
                            fix="keep it in a folder of its own, named with letters, digits and . _ / @ + - only, or "
                                "mount it yourself with container.mounts")
        targets.append(path)
        added.append(f"{path}:{path}")
    return added


# Megatron's tokenizer types for GPT text (megatron.core.tokenizers' build_tokenizer): the
# training fields each reads, and the package the job's Python needs to build it. The others
# (BERT word pieces, multimodal, SFT) are not for this entry; the request schema refuses them.
TOKENIZERS = {
    "HuggingFaceTokenizer": (("tokenizer_model",), "transformers"),
    "SentencePieceTokenizer": (("tokenizer_model",), "sentencepiece"),
    "GPTSentencePieceTokenizer": (("tokenizer_model",), "sentencepiece"),
    "Llama2Tokenizer": (("tokenizer_model",), "sentencepiece"),
    "TikTokenizer": (("tokenizer_model",), "tiktoken"),
    "GPT2BPETokenizer": (("vocab_file", "merge_file"), "transformers"),
    "NullTokenizer": ((), None),
}
TOKENIZER_FILES = {"tokenizer_model": "--tokenizer-model", "vocab_file": "--vocab-file", "merge_file": "--merge-file"}
TOKENIZER_FLAGS = ("--tokenizer-type", "--vocab-size", *TOKENIZER_FILES.values())


def tokenizer_type(training: dict) -> str:
    """The type the request names, else the one its files imply: NullTokenizer for mock data and
    for data without a tokenizer (bytes), a Hugging Face folder otherwise (given or from the job)."""
    if training.get("tokenizer_type"):
        return training["tokenizer_type"]
    if training.get("mock_data") or (training.get("data_path") and not training.get("tokenizer_model")):
        return "NullTokenizer"
    return "HuggingFaceTokenizer"


def _data_from_env(training: dict) -> bool:
    return not training.get("data_path") and not training.get("mock_data")


def _tokenizer_from_env(training: dict) -> bool:
    """TOKENIZER_MODEL comes from the job's environment with its data, unless the request names the
    tokenizer (given, or the import's) or its type reads no such file."""
    return (_data_from_env(training) and not training.get("tokenizer_model")
            and "tokenizer_model" in TOKENIZERS[tokenizer_type(training)][0])


def check_tokenizer(training: dict) -> None:
    """The files a named tokenizer type reads are given (TOKENIZER_MODEL may come from the job's
    environment with its data), and none it would not read."""
    kind = training.get("tokenizer_type")
    if not kind:
        return
    reads, _ = TOKENIZERS[kind]
    if training.get("mock_data") and kind != "NullTokenizer":
        raise ToolError("bad_request", f"mock data is made with NullTokenizer, not {kind}",
                        where="/training/tokenizer_type", fix="leave tokenizer_type out with mock_data, or give data_path")
    for field in reads:
        if not training.get(field) and not (field == "tokenizer_model" and _data_from_env(training)):
            raise ToolError("bad_request", f"{kind} reads {TOKENIZER_FILES[field]}, which the request does not give",
                            where=f"/training/{field}", fix=f"give training.{field} (a path as the job sees it)")
    extra = [f for f in TOKENIZER_FILES if training.get(f) and f not in reads]
    if extra:
        raise ToolError("bad_request", f"{kind} does not read {', '.join(extra)}", where=f"/training/{extra[0]}",
                        fix=f"leave {', '.join(extra)} out, or name the tokenizer_type that reads it")
    if kind == "GPT2BPETokenizer" and _data_from_env(training):
        raise ToolError("bad_request", "GPT2BPETokenizer reads a vocabulary and merges file, which the job's "
                        "TOKENIZER_MODEL cannot name", where="/training/data_path",
                        fix="give training.data_path with vocab_file and merge_file")


def tokenizer_args(training: dict) -> list[str]:
    """--tokenizer-type and the files (or vocabulary size) that type reads."""
    kind = tokenizer_type(training)
    args = ["--tokenizer-type", kind]
    for field in TOKENIZERS[kind][0]:
        args += [TOKENIZER_FILES[field], training.get(field) or megatron_args.job_variable("TOKENIZER_MODEL")]
    if kind == "NullTokenizer":
        args += ["--vocab-size", str(training["vocab_size"])]
    return args


def with_tokenizer_args(argv: list[str], training: dict) -> list[str]:
    """The argument vector with its tokenizer flags those of the request's tokenizer type, in place."""
    out, at, i = [], None, 0
    while i < len(argv):
        if argv[i] in TOKENIZER_FLAGS:
            at = len(out) if at is None else at
            i += 2
            continue
        out.append(argv[i])
        i += 1
    at = len(out) if at is None else at
    return out[:at] + tokenizer_args(training) + out[at:]


def _tokenizer_check(training: dict) -> dict | None:
    """What the job step imports before the first step to build its tokenizer (None: nothing)."""
    kind = tokenizer_type(training)
    package = TOKENIZERS[kind][1]
    return {"type": kind, "package": package} if package else None


def checked_version(parser_check: str) -> str:
    """The megatron-core version the script's flags were checked against: the installed one where
    Megatron's own parser ran, else the flag manifest's."""
    from ..environment import version

    if parser_check.startswith("manifest "):
        return parser_check.split(" ", 1)[1]
    return version("megatron-core") or megatron_flags.load_manifest()["megatron_core"]


# What import-hf needs in the job's Python beside torch and megatron-core (tools/launch.py's
# planning modules, the safetensors reader, psutil for Megatron's torch_dist writer).
IMPORT_MODULES = ("safetensors", "psutil", "jinja2", "jsonschema")


def environment_check(context: dict, for_import: bool = False) -> dict:
    """What the job's Python must have before anything starts, as the check in the script reads
    it: the megatron-core version the flags were checked against, the tokenizer's package, the
    reason Transformer Engine is needed (None: the local layers will do), and the import's modules."""
    te = None
    if context["needs_te"]:
        te = f"this layout needs it ({context['needs_te']})"
    elif context["fsdp"]:
        te = "Megatron-FSDP runs on Transformer Engine's layers"
    elif context["precision_aware"]:
        te = ("the precision-aware optimizer is Transformer Engine's Adam, and the plan's memory counts its smaller "
              "states")
    elif context["fp8"] and context["megatron_lm"]:
        te = ("this plan trains in FP8, which with Megatron-LM's entry script needs Transformer Engine (render "
              "without megatron_lm for the skill's own FP8 layers)")
    elif context["fp8"] and not context["fp8_local"]:
        te = ("this job was planned to train in FP8 with Transformer Engine (or render with runtime.fp8_linear "
              f"true for the skill's own FP8 layers: {context['fp8_local_note']})")
    return {"megatron_core": context["megatron_core"], "tokenizer": context["tokenizer_check"], "te": te,
            "modules": list(IMPORT_MODULES) if for_import else [], "checkout": bool(context["megatron_lm"])}


def _check_values(req: dict) -> None:
    training = req.get("training") or {}
    if training.get("lr_warmup_iters") is not None and training["lr_warmup_iters"] >= training["train_iters"]:
        raise ToolError("bad_request", "lr_warmup_iters must be below train_iters (Megatron's scheduler "
                        "asserts warm-up < decay steps)", where="/training/lr_warmup_iters",
                        fix="lower lr_warmup_iters, or leave it out for a tenth of train_iters")
    slurm = req.get("slurm") or {}
    for key in ("job_name", "partition", "account", "time"):
        v = slurm.get(key)
        if v is not None and not SLURM_SAFE.match(str(v)):
            raise ToolError("bad_request", f"slurm.{key} {v!r} has characters an #SBATCH line cannot carry",
                            where=f"/slurm/{key}", fix="use letters, digits and . _ : + @ - only")
    for key in (req.get("env") or {}):
        if not ENV_NAME.match(key):
            raise ToolError("bad_request", f"{key!r} is not an environment variable name", where="/env",
                            fix="use letters, digits and _ (not starting with a digit)")


# The first start from pretrained weights: the weights only, iteration 0, a fresh optimizer and
# RNG. Megatron does the same by itself when --load holds no checkpoint and
# --pretrained-checkpoint is given; the script says it in flags, and only while the run has no
# checkpoint of its own (a resume must load the optimizer, the RNG and the iteration).
FIRST_START_ARGS = ["--finetune", "--no-load-optim", "--no-load-rng"]
CHECKPOINT_TRACKER = "latest_checkpointed_iteration.txt"  # Megatron's (and train's) sign of a checkpoint


def _start_description(training: dict) -> dict:
    """What the script loads on its first start and on a restart, in the answer's words."""
    tracker = f"{training['save']}/{CHECKPOINT_TRACKER}" if training.get("checkpoint", True) else None
    return {"first_start_args": FIRST_START_ARGS, "resume_args": [],
            "first_start_while_missing": megatron_args.JOB_VARIABLE.sub(r"$\1", tracker) if tracker else None,
            "rule": "the script adds first_start_args (weights only, iteration 0, fresh optimizer and RNG) while the "
                    "run has no checkpoint of its own; once it has saved, a restart resumes from that checkpoint "
                    "with its optimizer, RNG and iteration" if tracker else
                    "checkpoint false: every start is a first start from the pretrained weights"}


def _fake_rank_args(fake: int | None, model) -> list[str]:
    """--fake-process-group; and for MoE, routing forced balanced (Megatron's benchmarking
    switch): the other ranks' tokens are not real, so dropless routing would otherwise follow
    whatever this rank's copies of them say, not the balanced load the planner sizes for."""
    if fake is None:
        return []
    return ["--fake-process-group"] + (["--moe-router-force-load-balancing"] if model.is_moe else [])


MOUNTABLE = re.compile(r"^/[A-Za-z0-9._/@+-]*$")  # what a container mount list (SRC:DST,...) can carry


def import_step(req: dict, model, k8s: dict | None) -> dict | None:
    """The import of a Hugging Face folder on the cluster that the job runs before training (None:
    the request starts from no such folder): its paths as the job sees them, and import-hf's words."""
    spec = req.get("import_hf")
    if not spec:
        return None
    training = req.get("training") or {}
    output = spec.get("output") or training.get("pretrained")
    if not output:
        raise ToolError("bad_request", "import_hf names the Hugging Face folder but not where its import goes",
                        where="/import_hf/output", fix="give import_hf.output (or training.pretrained), a folder "
                        "as the job sees it")
    if training.get("pretrained") and training["pretrained"] != output:
        raise ToolError("bad_request", f"training.pretrained {training['pretrained']!r} is not the import's output "
                        f"{output!r}: the run would not start from the weights the job imports",
                        where="/training/pretrained", fix="leave training.pretrained out (the import's output is "
                        "where the run starts), or give the same folder")
    if req.get("fake_rank") is not None:
        raise ToolError("bad_request", "a fake_rank run measures one rank's memory; it imports nothing",
                        where="/import_hf", fix="import first (import-hf), or leave fake_rank out")
    if req.get("hf_config"):   # the job's import-hf checks the same config: refuse now, not once the job has its nodes
        from ..convert.hf import check_config
        from ..core.model import hf_config_json
        check_config(hf_config_json(req["hf_config"])[0], where="/hf_config")
    paths = {"hf_model": spec["hf_model"], "output": output}
    for key, path in paths.items():
        where = "/import_hf/" + key if key in spec else "/training/pretrained"
        files.check_names(path, where)
        if not path.startswith("/") or path.rstrip("/") == "":
            raise ToolError("bad_request", f"{path!r} is not an absolute path below /", where=where,
                            fix="give the path as the job's nodes see it, from /")
        if (req.get("container") or k8s) and not MOUNTABLE.match(path):
            raise ToolError("bad_request", f"{path!r} has characters a container mount list cannot carry",
                            where=where, fix="use letters, digits and . _ / @ + - only")
        if k8s and not (path + "/").startswith(k8s["mount_path"].rstrip("/") + "/"):
            raise ToolError("bad_request", f"{path} is not on the claim the pods mount at {k8s['mount_path']}",
                            where=where, fix=f"give a path below {k8s['mount_path']} (the volume claim "
                            f"{k8s['volume_claim']}), where every pod sees it")
    if paths["hf_model"].rstrip("/") == output.rstrip("/"):
        raise ToolError("bad_request", "the import's output is the Hugging Face folder itself", where="/import_hf/output",
                        fix="give a new folder for the Megatron checkpoint")
    if req.get("container") and str(Path(output).parent) == "/":  # its parent is mounted into the container
        raise ToolError("bad_request", f"the import's output {output} lies in /, which the container cannot mount",
                        where="/import_hf/output" if spec.get("output") else "/training/pretrained",
                        fix="give a folder below a folder of its own (e.g. /shared/ckpt/NAME)")
    args = ["import-hf", "--hf-model", paths["hf_model"], "--output", output]
    if spec.get("dtype", "auto") != "auto":
        args += ["--dtype", spec["dtype"]]
    here = Path(paths["hf_model"])  # the folder as this machine sees it, where it does (a shared file system)
    if files.is_file(here / "config.json"):
        pretrained.same_model(here, model, "/import_hf/hf_model", f"the Hugging Face folder {here}")
    visible = files.is_dir(here)
    tokenizer = None if visible and not files.is_file(here / "tokenizer.json") else output.rstrip("/") + "/hf"
    return {"hf_model": paths["hf_model"], "output": output, "parent": str(Path(output).parent), "args": args,
            "tokenizer": tokenizer, "visible_here": visible,
            "command": "python tools/launch.py " + " ".join(shlex.quote(a) for a in args)}


@dataclasses.dataclass
class _Job:
    """What a render request resolves to before any flag is written: the model on its GPUs, the
    layout and its prediction, how the job is started and where it writes."""
    req: dict            # the request with what the job's own choices add (defaults, the import's output)
    model: Any
    gpu: Any
    lay: Layout
    cand: Any            # the planner's prediction of lay
    n_gpus: int
    nodes: int
    gpus_here: int       # the processes torchrun starts on one node
    fake: int | None     # the one rank a fake_rank run measures (None: a real job)
    run_id: str
    out_dir: Path        # where the script is written
    run_dir: str         # where the job writes, as the script says it
    k8s: dict | None
    importing: dict | None

    @property
    def launcher(self) -> str:
        return self.req["launcher"]


@dataclasses.dataclass
class _Flags:
    """Megatron's argument vector for the job, in the two variants the script may run, each
    checked by Megatron's parser."""
    argv: list[str]          # the whole vector, as the answer shows it
    common: list[str]        # what both variants pass
    local: list[str]         # added without Transformer Engine (Megatron's local layers)
    te: list[str]            # added with Transformer Engine
    fp8_local: bool          # FP8 through the skill's own linear layers where TE is missing
    env: dict[str, str]
    parser_check: str


def build(req: dict, ctx: Context) -> dict[str, Any]:
    """Everything render would write, without writing it."""
    job = _resolve_job(req, ctx)
    training, start, notes = _training(job)
    container = _container(job.req, job.launcher)
    if container and job.importing:  # the job's container sees the Hugging Face folder and the import's folder
        container["mounts"] = [*container["mounts"], *(f"{p}:{p}" for p in (job.importing["hf_model"],
                                                                             job.importing["parent"]))]
    if container:  # the data and the tokenizer the request names, where the job step looks for them
        container["mounts"] = [*container["mounts"], *_data_mounts(training, container["mounts"])]
    flags = _flags(job, training, start is not None)
    if start:
        start = {**start, "loading": _start_description(training)}
    context = _script_context(job, training, start, container, flags, ctx)
    text = _environment().get_template(LAUNCHERS[job.launcher]).render(**context)
    text = megatron_args.JOB_VARIABLE.sub(r'"$\1"', text).replace('RUN_DIR=${RUN_DIR:-"$RUN_DIR"}',
                                                                   "RUN_DIR=${RUN_DIR:-$PWD/runs/" + job.run_id + "}")
    return _answer(job, flags, start, container, context, text, notes)


def _resolve_job(req: dict, ctx: Context) -> _Job:
    """The request's model, GPUs, layout and places; an error for a job its launcher cannot start."""
    training = req.get("training") or {}
    req = {**req, "training": {**training, "train_iters": training.get("train_iters") or DEFAULT_TRAIN_ITERS["gpu"]}}
    _check_values(req)
    model = resolve_model(req)
    gpu, n_gpus, per_node = resolve_cluster(req)
    seq = req.get("seq_length") or default_seq_length(model)
    gbs = req.get("global_batch_size") or default_global_batch(seq)
    lay, cand = _layout_from_request(req, model, gpu, n_gpus, seq, gbs)
    fake = _launched_rank(req, lay, n_gpus, per_node)
    run_id = req.get("run_id") or ctx.request_id
    out_dir = Path(req.get("output_dir") or default_runs_root() / run_id)
    files.output_folder(out_dir, "/output_dir")
    k8s = _kubernetes(req)
    if k8s:  # every pod sees the claim: the run directory and the skill's folder live there
        req = {"run_dir": f"{k8s['mount_path']}/runs/{run_id}",
               "skill_home": f"{k8s['mount_path']}/megatron-core-training", **req}
    # Without a run_dir the job's own working folder holds it (runs/RUN_ID there): the script
    # carries no path of the machine that rendered it.
    run_dir = _job_path(req, "run_dir") or RUN_DIR_MARK
    importing = import_step(req, model, k8s)
    if importing:  # the run starts from what the job imports
        req = {**req, "training": {**req["training"], "pretrained": importing["output"]}}
    return _Job(req=req, model=model, gpu=gpu, lay=lay, cand=cand, n_gpus=n_gpus, nodes=max(1, n_gpus // per_node),
                gpus_here=1 if fake is not None else min(per_node, n_gpus), fake=fake, run_id=run_id,
                out_dir=out_dir, run_dir=run_dir, k8s=k8s, importing=importing)


def _launched_rank(req: dict, lay: Layout, n_gpus: int, per_node: int) -> int | None:
    """The rank a fake_rank run measures (None: every rank runs), once the launcher is known to
    start the job's processes: torchrun alone starts one node, the others whole nodes."""
    launcher, nodes = req["launcher"], max(1, n_gpus // per_node)
    fake = fake_rank(req["fake_rank"], lay) if req.get("fake_rank") is not None else None
    if fake is not None and launcher != "torchrun":
        raise ToolError("bad_request", "a fake_rank run is one process on this machine", where="/launcher",
                        fix="use launcher torchrun (or leave fake_rank out)")
    if launcher == "torchrun" and nodes > 1 and fake is None:
        raise ToolError("bad_request", f"{n_gpus} GPUs need {nodes} nodes; torchrun alone starts one",
                        where="/launcher", fix="use launcher torchrun-multinode or slurm")
    if n_gpus % per_node and n_gpus > per_node and fake is None:
        raise ToolError("bad_request", f"{n_gpus} GPUs is not a whole number of {per_node}-GPU nodes",
                        where="/num_gpus", fix="use a multiple of gpus_per_node")
    return fake


def _kubernetes(req: dict) -> dict | None:
    """The PyTorchJob's options over their defaults (None: another launcher)."""
    k8s = {**schema_defaults("kubernetes"), **(req.get("kubernetes") or {})} if req["launcher"] == "kubernetes" else None
    if req.get("kubernetes") and not k8s:
        raise ToolError("bad_request", "kubernetes options belong to launcher kubernetes", where="/kubernetes",
                        fix="use launcher kubernetes, or leave kubernetes out")
    if k8s:
        k8s["image"] = images.for_runtime(k8s["image"], "kubernetes", where="/kubernetes/image")
    return k8s


def _training(job: _Job) -> tuple[dict, dict | None, list[str]]:
    """The training settings the script passes (paths as the job sees them), what the run starts
    from (None: from scratch), and the warnings on them."""
    req, model = job.req, job.model
    training = match_tokenizer(training_settings(model, req["training"]), model.vocab_size)
    notes = [w for w in (pretraining_rate_warning(model, req["training"]),) if w]
    notes += [f"the script trains the model without what its Hugging Face config says here: {a}"
              for a in model.approximations]
    training.setdefault("vocab_size", model.vocab_size)
    start = None
    if training.get("pretrained"):
        start = pretrained.describe(training["pretrained"], model, job.lay.tp, need_local=False,
                                    job_imports=job.importing is not None)
        training.update(pretrained=_path(training["pretrained"]), vocab_divisor=start["vocab_divisor"])
        tokenizer = start["tokenizer"] or (job.importing or {}).get("tokenizer")
        if (tokenizer and not training.get("tokenizer_model") and not training.get("mock_data")
                and training.get("tokenizer_type") in (None, "HuggingFaceTokenizer")):
            training["tokenizer_model"] = tokenizer
    training["save"] = _path(training.get("save") or f"{job.run_dir}/checkpoints")
    if training.get("data_path"):
        for i, entry in enumerate(training["data_path"]):
            files.check_names(entry, f"/training/data_path/{i}", room=len(MASK_SUFFIX + ".bin"))
        training["data_path"] = [_path(p) for p in training["data_path"]]
    for field in TOKENIZER_FILES:
        if training.get(field):
            training[field] = _path(training[field])
    check_tokenizer(training)
    training["tensorboard_dir"] = f"{job.run_dir}/tensorboard"
    if MegatronOptions.from_request(req.get("megatron_options")).fsdp:
        training["ckpt_format"] = None   # Megatron-FSDP saves in its own format, which its flags name
    return training, start, notes


def _flags(job: _Job, training: dict, first_start: bool) -> _Flags:
    """Megatron's flags for the job, with and without Transformer Engine; Megatron's parser
    checks both (and the first start's loading flags, when the run starts from weights)."""
    req, lay, model, gpu = job.req, job.lay, job.model, job.gpu
    moe = MoEOptions.from_request(req.get("moe"))
    memory_options = MegatronOptions.from_request(req.get("megatron_options"))
    argv = (megatron_args.model_args(model, lay.seq_length, moe) + megatron_args.layout_args(lay, model, gpu, moe)
            + with_tokenizer_args(megatron_args.training_args(training), training) + memory_options.flags()
            + _fake_rank_args(job.fake, model))
    # Both variants the script may run, with and without Transformer Engine, must parse.  FP8
    # without TE is the skill entry's own linear layers (Megatron-LM's entry has none).
    skill_entry = not req.get("megatron_lm")
    # FP8 through the skill's own layers where TE is missing only when the request chose them
    # (runtime.fp8_linear, or a plan for local layers); otherwise the job stops: asked is what runs.
    fp8_local = lay.precision == "fp8" and skill_entry and (
        (req.get("runtime") or {}).get("fp8_linear") is True or not req["transformer_engine"])
    local = RuntimeOptions.from_request({**(req.get("runtime") or {}), **({"fp8_linear": True} if fp8_local else {})},
                                        te=False)
    local_flags = megatron_args.local_impl_flags(local, skill_entry=skill_entry)
    common_argv, te_fp8 = megatron_args.split_te_fp8(argv)
    te_args = te_fp8 + megatron_args.te_only_args(lay, gpu, job.fake is not None, model, moe, memory_options)
    env = _job_env(lay, memory_options, req)
    # what validate_args reads of the environment, as the script sets it
    script_env = {k: env.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_GRAPH_REGISTER")}
    parser_check = megatron_flags.check(common_argv + ["--transformer-impl", "local"] + local_flags,
                                        world_size=lay.world_size, env=script_env)
    megatron_flags.check(common_argv + ["--transformer-impl", "transformer_engine"] + te_args, world_size=lay.world_size,
                         env=script_env)
    if first_start:  # the first start's loading flags parse too
        megatron_flags.check(common_argv + FIRST_START_ARGS + ["--transformer-impl", "local"] + local_flags,
                             world_size=lay.world_size, env=script_env)
    return _Flags(argv=argv, common=common_argv, local=local_flags, te=te_args, fp8_local=fp8_local, env=env,
                  parser_check=parser_check)


def _job_env(lay: Layout, memory_options: MegatronOptions, req: dict) -> dict[str, str]:
    """The environment the script exports: the options' own, then the request's."""
    # One kernel queue orders TP's and CP's communication before the GEMMs it overlaps (Hopper);
    # Megatron-FSDP refuses it (its prefetches need several queues).
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if (lay.tp > 1 or lay.cp > 1) and not memory_options.fsdp else {}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    env.update(memory_options.env())
    env.update(req.get("env") or {})
    return env


def _script_context(job: _Job, training: dict, start: dict | None, container: dict | None, flags: _Flags,
                    ctx: Context) -> dict[str, Any]:
    """What the launcher's template is rendered with."""
    req, lay, cand, run_id, run_dir = job.req, job.lay, job.cand, job.run_id, job.run_dir
    entry = (str(Path(req["megatron_lm"]) / "pretrain_gpt.py") if req.get("megatron_lm") else str(ENTRY_SCRIPT))
    options = MegatronOptions.from_request(req.get("megatron_options"))
    slurm = {"job_name": f"megatron-{run_id[:8]}", "time": "04:00:00", "gpus": True, "exclusive": True,
             "partition": None, "account": None, "cpus_per_task": None, **(req.get("slurm") or {})}
    context = {
        "run_id": run_id, "label": lay.label(), "model_name": job.model.name, "gpu": job.gpu.key,
        "num_gpus": job.n_gpus, "nodes": job.nodes, "gpus_per_node": job.gpus_here, "run_dir": run_dir,
        "python": req["python"], "skill_home": _job_path(req, "skill_home") or "",
        "skill_home_default": _home_relative_skill(), "megatron_lm": req.get("megatron_lm"), "container": container,
        "fp8_local_note": fp8_local_note(lay), "data_checks": _data_checks(training),
        "data_from_env": _data_from_env(training), "tokenizer_from_env": _tokenizer_from_env(training),
        "entry": entry, "env": flags.env, "arg_lines": _group_args(flags.common), "no_te_flags": flags.local,
        "te_args": flags.te, "needs_te": _needs_te(lay, job.model, job.gpu), "fp8": lay.precision == "fp8",
        "fp8_local": flags.fp8_local, "parser_check": flags.parser_check, "master_port": req["master_port"],
        "peak_gib": f"{cand.peak_gib:.1f}", "tokens_per_s": f"{cand.tokens_per_s:,.0f}",
        "mfu": f"{cand.mfu:.3f}", "slurm": slurm, "script_name": SCRIPT_NAMES[job.launcher],
        "fake_rank": job.fake, "world_size": lay.world_size,
        "first_start_args": FIRST_START_ARGS if start else [],
        "tokenizer_check": _tokenizer_check(training),
        "fsdp": options.fsdp, "precision_aware": options.precision_aware_optimizer,
        "megatron_core": checked_version(flags.parser_check), "import_step": job.importing,
        "skill_launch": (f"{container['skill_mount']}/tools/launch.py" if container
                         else "$MEGATRON_SKILL_HOME/tools/launch.py" if job.k8s else "$SKILL_HOME/tools/launch.py"),
        "checkpoint_tracker": (_quote(training["save"] + "/" + CHECKPOINT_TRACKER)
                               if start and training.get("checkpoint", True) else ""),
        "request_id": ctx.request_id or run_id,
        # tools/slurm_job_end.sh (a Slurm trigger) finds the run here (without a path: WorkDir/runs/RUN_ID).
        "slurm_comment": f"megatron-skill:{run_id}" + (f":{run_dir}" if SLURM_PATH.match(run_dir) else ""),
        "layout_json": json.dumps({"tp": lay.tp, "pp": lay.pp, "vp": lay.vp, "cp": lay.cp, "ep": lay.ep, "dp": lay.dp,
                                   "mbs": lay.mbs, "gbs": lay.gbs, "seq_length": lay.seq_length,
                                   "num_gpus": job.n_gpus, "nodes": job.nodes}, separators=(",", ":")),
    }
    context["env_need"] = environment_check(context)
    context["import_need"] = environment_check(context, for_import=True)
    if job.k8s:
        context.update(_k8s_context(context, job.k8s, run_id, job.nodes, req, training))
    return context


def _answer(job: _Job, flags: _Flags, start: dict | None, container: dict | None, context: dict, text: str,
            notes: list[str]) -> dict[str, Any]:
    """render's answer (with the script's text and the warnings under _text and _notes, for run)."""
    launcher, lay, cand = job.launcher, job.lay, job.cand
    script = job.out_dir / SCRIPT_NAMES[launcher]
    run_cmd = {"torchrun": f"bash {script}", "torchrun-multinode": f"MASTER_ADDR=<host> bash {script}  # on every node",
               "slurm": f"sbatch {script}", "kubernetes": f"kubectl apply -f {script}"}[launcher]
    return {
        "run_id": job.run_id,
        "launcher": launcher,
        "layout": lay.to_json(),
        "label": lay.label(),
        "prediction": {"peak_gib": round(cand.peak_gib, 2), "tokens_per_s": round(cand.tokens_per_s),
                       "mfu": round(cand.mfu, 4), "transformer_engine": job.req["transformer_engine"]},
        "megatron_args": [megatron_args.JOB_VARIABLE.sub(r"$\1", a) for a in flags.argv],
        "parser_check": flags.parser_check,
        "files": [{"path": str(script), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                   "mode": "0644" if launcher == "kubernetes" else "0755"}],
        "run_dir": job.run_dir if job.run_dir != RUN_DIR_MARK else f"runs/{job.run_id} (in the folder the job starts in)",
        "command": run_cmd,
        **({"fake_rank": job.fake} if job.fake is not None else {}),
        **({"pretrained": start} if start else {}),
        **({"import": _import_description(job.importing, launcher)} if job.importing else {}),
        "environment_check": {k: v for k, v in context["env_need"].items() if k not in ("modules", "checkout")},
        "_notes": notes,
        **({"container": {"runtime": container["runtime"], "image": container["image"],
                          "image_given": container["given_image"]}} if container else {}),
        "_text": text,
    }


def _import_description(step: dict, launcher: str) -> dict:
    """Where and how the job imports the weights, in the answer's words."""
    where = {"slurm": "a job step before training (srun: one task on one node of the allocation), in the "
                      "job's container where it has one",
             "torchrun": "the script, before torchrun starts",
             "torchrun-multinode": "the script on every node before torchrun starts: the first to take the "
                                   "import's lock converts, the others wait for it",
             "kubernetes": "an init container of every pod (same image and claim): the first to take the "
                           "import's lock converts, the others wait for it"}[launcher]
    return {"hf_model": step["hf_model"], "output": step["output"], "command": step["command"], "runs_in": where,
            "idempotent": "the same import again answers already_done at once; a changed source folder is "
                          "converted again",
            "tokenizer": step["tokenizer"], "checked_here": step["visible_here"],
            "preflight": ["the environment check (the same as the training step's, and import-hf's modules)",
                          "doctor (its answer in RUN_DIR/logs/doctor.HOST.json)",
                          "import-hf (its answer in RUN_DIR/logs/import.HOST.json)"]}


RENDERED_MARK = "# Rendered by the megatron-core-training skill"
# The last line of a rendered file: the digest of every line above it. A file whose lines no longer
# match it was edited since (by a person): render leaves it, as it leaves a file it never wrote.
DIGEST_LINE = "# render: sha256 {} of the lines above (an edit shows; render then leaves the file as it is)\n"
DIGEST = re.compile(r"^# render: sha256 ([0-9a-f]{64}) ", re.M)


def _with_digest(text: str) -> str:
    body = text if text.endswith("\n") else text + "\n"
    return body + DIGEST_LINE.format(hashlib.sha256(body.encode()).hexdigest())


def _edited(path: Path) -> bool:
    """Whether a rendered file's lines differ from the digest on its last line. One without the
    digest was rendered by a version before it (run folders of earlier runs, which resume and
    relayout render into again): taken as written, as render took every file it marked then."""
    try:
        text = files.read_text(path, "/output_dir", "launch script")
    except ToolError:
        return True
    found = list(DIGEST.finditer(text))
    if not found:
        return False
    m = found[-1]
    after = text[m.start():].partition("\n")[2]   # lines added below the digest are an edit too
    return bool(after.strip()) or hashlib.sha256(text[:m.start()].encode()).hexdigest() != m.group(1)


def _unseen_datasets(req: dict) -> list[str]:
    """Dataset prefixes whose .bin / .idx this machine cannot see: a warning, not an error (the
    job may run where other paths hold); train, which launches here, refuses them."""
    entries = (req.get("training") or {}).get("data_path") or []
    return [e for e in entries if not is_weight(e) and not (files.is_file(e + ".bin") and files.is_file(e + ".idx"))]


# What render takes from a plan: the fields of the plan request that say what is trained where.
FROM_PLAN = ("model", "hf_config", "gpu", "num_gpus", "nodes", "gpus_per_node", "seq_length", "global_batch_size",
             "transformer_engine", "moe", "megatron_options")
DEFAULTS = {"gpu": "h100-sxm", "precision": "bf16", "transformer_engine": True}
DERIVED = ("world_size", "expert_dp", "num_microbatches")


def with_plan(req: dict, ctx: Context) -> dict:
    """The request with what its plan says (a plan answer, or a plan request run here), and the
    defaults of what neither gives. A field given both ways is a bad request: asked once."""
    if "plan" not in req:
        return {**DEFAULTS, **req}
    given = req["plan"]
    if given.get("ok") is False:
        raise ToolError("bad_request", "the plan answer is an error, not a plan", where="/plan",
                        fix="give a plan answer with plans, or the plan request")
    answer = given["result"] if isinstance(given.get("result"), dict) else given
    if "plans" not in answer:
        request = {k: v for k, v in given.items() if k != "top"}
        answer = invoke("plan", {**request, "top": req["plan_rank"]}, ctx)
    if not isinstance(answer.get("request"), dict) or not isinstance(answer.get("plans"), list):
        raise ToolError("bad_request", "this plan answer does not carry its request and plans", where="/plan",
                        fix="give the plan request instead (render runs plan), or a whole answer of the plan tool")
    plans = answer["plans"]
    if req["plan_rank"] > len(plans):
        raise ToolError("bad_request", f"the plan has {len(plans)} layout(s), not {req['plan_rank']}",
                        where="/plan_rank", fix=f"give 1 to {len(plans)}, or plan with a larger top")
    twice = sorted(k for k in (*FROM_PLAN, "precision", "layout") if k in req)
    if twice:
        raise ToolError("bad_request", f"{', '.join(twice)} given and taken from the plan", where="/" + twice[0],
                        fix="leave them out: the plan says them (or leave the plan out and give them)")
    chosen = plans[req["plan_rank"] - 1].get("layout") or {}
    inherited = {k: v for k, v in answer["request"].items() if k in FROM_PLAN}
    out = {**DEFAULTS, **{k: v for k, v in req.items() if k != "plan"}, **inherited,
           "precision": chosen.get("precision", "bf16"), "layout": {k: v for k, v in chosen.items() if k not in DERIVED}}
    # What came from the plan is checked as if it had been given here (an edited answer is input too).
    from ..contract import validate_request

    validate_request("render", {k: v for k, v in out.items() if k not in ("plan_rank",)})
    return out


def _head(path: Path) -> str:
    """The start of a script already at path ('' for what is not a regular UTF-8 file: not ours)."""
    try:
        return files.read_text(path, "/output_dir", "launch script")[:2000]
    except ToolError:
        return ""


def _stock_image(req: dict) -> bool:
    """The container is NVIDIA's PyTorch image as published (the default): it has TE but no
    megatron-core."""
    image = (req.get("container") or {}).get("image") or ""
    return re.sub(r"^(docker://|nvcr\.io[/#])", "", image).startswith("nvidia/pytorch:")


def run(req: dict, ctx: Context) -> dict[str, Any]:
    req = with_plan(req, ctx)
    out = build(req, ctx)
    text = out.pop("_text")
    notes = out.pop("_notes")
    path = Path(out["files"][0]["path"])
    unseen = _unseen_datasets(req)
    warnings = notes + [f"dataset {e}: no .bin / .idx on this machine; the job stops at start-up unless they "
                        "exist where it runs" for e in unseen]
    if req.get("megatron_lm"):
        warnings += [f"dataset {p} has a chat loss mask ({p}{MASK_SUFFIX}.bin), which Megatron-LM's pretrain_gpt.py "
                     "does not read: the prompts would be learned too (leave megatron_lm out to use the skill's entry)"
                     for p in (req.get("training") or {}).get("data_path") or [] if files.is_file(p + MASK_SUFFIX + ".idx")]
    if _stock_image(req):
        warnings.append(f"container image {req['container']['image']} is NVIDIA's PyTorch image, which has no "
                        "megatron-core: the job step stops at its environment check unless the image is one built "
                        "from it with pip install 'megatron-core==0.19.*' (give it as container.image)")
    if warnings:
        out["warnings"] = warnings
    for w in warnings:  # a person at the terminal reads stderr; the JSON keeps them too
        ctx.progress(f"render: warning: {w}")
    if files.kind_of(path) != "missing" and RENDERED_MARK not in _head(path):
        raise ToolError("conflict", f"{path} exists and was not written by render", where="/output_dir",
                        fix="choose another output_dir (the file is left as it is)")
    if files.kind_of(path) != "missing" and _edited(path):
        raise ToolError("conflict", f"{path} was written by render and edited since (its digest line no longer "
                        "matches its lines): render leaves the edit",
                        where="/output_dir", fix="choose another output_dir, or move the edited file away first")
    text = _with_digest(text)
    if ctx.dry_run:
        out["dry_run"] = True
        out["actions"] = [f"mkdir -p {path.parent}", f"write {path} ({len(text)} bytes, mode {out['files'][0]['mode']})"]
        out["files"][0]["content"] = text
        return out
    files.make_folder(path.parent, "/output_dir")
    try:
        write_atomic(path, text, mode=0o644 if out["launcher"] == "kubernetes" else 0o755)  # never half a script
    except OSError as e:  # a folder this user may not write, a read-only file system, a full disk
        raise files.os_error(e, path, "/output_dir", "launch script") from None
    ctx.progress(f"render: wrote {path} ({out['label']})")
    return out


TOOL = Tool(name="render", summary="Write torchrun / Slurm launch scripts for a plan; every Megatron "
                     "flag checked by Megatron's own parser.", run=run)
