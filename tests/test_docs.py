"""The Markdown is half of the skill: its flags parse, its commands run, its figures have sources."""
import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT, require_modules, run_cli, run_inproc

DOCS = [ROOT / "README.md", ROOT / "SKILL.md", ROOT / "instructions.md", *sorted((ROOT / "references").glob("*.md"))]
TEMPLATES = sorted((ROOT / "templates").glob("*.j2"))
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")
# Stand-ins for the placeholders the examples use, so that every example runs here.
PLACEHOLDERS = {"their_launch.sh": "tests/fixtures/scripts/good_torchrun.sh",
                "runs/ID/logs/train.log": "tests/fixtures/logs/h200-kill-resume.log"}
ACTING = {"render", "train", "bench", "prepare-data", "import-hf", "export-hf"}  # these run with --dry-run here
# The Hugging Face examples' folders (references/pretrained.md, instructions.md section 12): a tiny
# model, its import and chat data, made for real once (pretrained_example).
PRETRAINED_PLACEHOLDERS = ("/models/Llama-3.2-1B", "/models/Qwen3-8B", "runs/ckpt/llama1b", "/ckpt/qwen3-8b",
                           "runs/RUN_ID/checkpoints", "chats.jsonl", "runs/data/chats", "/data/chats")


DATA_FENCES = ("json", "json5", "yaml", "toml")


def code_blocks(path, data=False):
    """The fenced blocks of a markdown file, whatever their language tag (json5 too, so a later
    block is not read from a closing fence); data blocks (JSON, YAML) only when data is true."""
    return [body for tag, body in re.findall(r"```([a-z0-9_+-]*)\n(.*?)```", path.read_text(), flags=re.S)
            if data or tag not in DATA_FENCES]


def commands(block):
    """Logical lines (continuations joined), without comments."""
    text = block.replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            yield line


def megatron_option_strings():
    import argparse

    from megatron.training.arguments import add_megatron_arguments

    from megatron_skill.adapter.skill_flags import add_skill_arguments

    parser = add_skill_arguments(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))
    return {opt for action in parser._actions for opt in action.option_strings}


def launcher_option_strings():
    from torch.distributed.run import get_args_parser

    torchrun = {opt.replace("_", "-") for a in get_args_parser()._actions for opt in a.option_strings}
    slurm = {"--nodes", "--ntasks-per-node", "--gpus-per-node", "--time", "--partition", "--account", "--output",
             "--job-name", "--exclusive", "--cpus-per-task", "--kill-on-bad-exit", "--wait", "--chdir", "--comment",
             "--set", "--jobid", "--fini", "--program", "--exclude"}  # sbatch, srun, strigger
    # srun's Pyxis plugin, and apptainer exec
    containers = {"--container-image", "--container-mounts", "--container-workdir", "--no-container-mount-home",
                  "--nv", "--bind", "--pwd"}
    import emit_event

    emitter = {opt for sub in emit_event.build_parser()._subparsers._group_actions[0].choices.values()
               for a in sub._actions for opt in a.option_strings}
    return torchrun | slurm | containers | emitter


def test_every_megatron_flag_in_markdown_code_blocks_and_templates_is_known_to_megatrons_parser():
    known = megatron_option_strings()
    launchers = launcher_option_strings()
    found, unknown = set(), []
    for doc in DOCS:
        for block in code_blocks(doc):
            for line in commands(block):
                if "launch.py" in line or "run_levers.py" in line or line.startswith(("bash ", "pip ", "git ")):
                    continue  # the skill's own tools: checked against their schemas below
                for flag in FLAG.findall(line):
                    found.add(flag)
                    if flag not in known and flag not in launchers:
                        unknown.append(f"{doc.name}: {flag}")
    for tpl in TEMPLATES:
        for line in tpl.read_text().splitlines():
            if line.lstrip().startswith("#"):
                continue
            for flag in FLAG.findall(line):
                if flag == "--skill-":
                    continue
                found.add(flag)
                if flag not in known and flag not in launchers:
                    unknown.append(f"{tpl.name}: {flag}")
    assert not unknown, unknown
    assert "--transformer-impl" in found  # the extraction sees the templates' Megatron flags


def test_markdown_megatron_commands_parse_with_megatrons_parser():
    """A whole pretrain_gpt.py command in a code block parses, values and all."""
    from megatron_skill.adapter import parser as megatron_parser

    checked = 0
    for doc in DOCS:
        for block in code_blocks(doc):
            for line in commands(block):
                if "pretrain_gpt.py" in line:
                    argv = shlex.split(line)
                    megatron_parser.parse(argv[argv.index(next(a for a in argv if a.endswith("pretrain_gpt.py"))) + 1:])
                    checked += 1
    assert checked >= 0


def launch_examples():
    out = []
    for doc in DOCS:
        for block in code_blocks(doc):
            for line in commands(block):
                if line.startswith("python tools/launch.py"):
                    out.append((doc.name, line))
    return out


@pytest.fixture(scope="module")
def sample_dataset(tmp_path_factory):
    """The dataset the examples' prepare-data line makes, made for real once (their own
    prepare-data lines run as dry-runs)."""
    prefix = tmp_path_factory.mktemp("data") / "corpus"
    rc, out, err = run_inproc("prepare-data", "--input", str(ROOT / "data" / "sample" / "corpus.jsonl"),
                              "--output-prefix", str(prefix))
    assert rc == 0, err
    return str(prefix)


@pytest.fixture(scope="module")
def pretrained_example(tmp_path_factory):
    require_modules("transformers", "safetensors", "tokenizers")
    from hf_tiny import CONVERSATIONS, hf_tokenizer, tiny

    root = tmp_path_factory.mktemp("pretrained")
    tiny("llama", root / "hf", vocab=384)
    hf_tokenizer(root / "hf")
    assert run_inproc("import-hf", "--hf-model", str(root / "hf"), "--output", str(root / "import"))[0] == 0
    (root / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    assert run_inproc("prepare-data", "--input", str(root / "chats.jsonl"), "--output-prefix", str(root / "chats"),
                      "--format", "chat", "--tokenizer", str(root / "import" / "hf"))[0] == 0
    real = {"/models/Llama-3.2-1B": root / "hf", "/models/Qwen3-8B": root / "hf", "runs/ckpt/llama1b": root / "import",
            "/ckpt/qwen3-8b": root / "import", "runs/RUN_ID/checkpoints": root / "import",
            "chats.jsonl": root / "chats.jsonl", "runs/data/chats": root / "chats", "/data/chats": root / "chats-new"}
    return {k: str(real[k]) for k in PRETRAINED_PLACEHOLDERS}


@pytest.mark.parametrize("doc,line", launch_examples())
def test_every_launch_example_in_the_markdown_runs(doc, line, tmp_path, sample_dataset, request):
    for placeholder, real in PLACEHOLDERS.items():
        line = line.replace(placeholder, real)
    if any(p in line for p in PRETRAINED_PLACEHOLDERS):
        for placeholder, real in sorted(request.getfixturevalue("pretrained_example").items(), key=lambda kv: -len(kv[0])):
            line = line.replace(placeholder, real)
    line = line.replace('"data_path": ["runs/data/corpus"]', f'"data_path": ["{sample_dataset}"]')
    argv = shlex.split(line)[2:]
    tool = argv[0]
    if tool in ACTING and "--dry-run" not in argv:
        argv.append("--dry-run")
    if tool in ("train", "bench") and "tiny-gpt" not in argv:
        # the example is for a GPU machine: show what it would run on an H200 there
        argv += [] if "--gpu" in argv else ["--gpu", "h200"]
        argv += ["--backend", "gpu"] if tool == "train" and "--backend" not in argv else []
    if tool in ("train", "bench") and "--runs-root" not in argv:
        argv += ["--runs-root", str(tmp_path / "runs")]
    if tool == "render" and "--output-dir" not in argv:
        argv += ["--output-dir", str(tmp_path / "out")]
    if "--pretty" in argv:
        argv.remove("--pretty")
    env = {}
    if tool == "on-event":  # a real run and a signed event for it: the example's files
        argv, env = _event_example(argv, tmp_path)
    rc, out, err = run_inproc(*argv, env=env)
    assert isinstance(out, dict), f"{doc}: {line}\n{err[-2000:]}"
    if tool == "validate":
        assert rc == 0 and out["result"]["valid"], out
    else:
        assert rc == 0 and out["ok"], f"{doc}: {line}\n{out}"


def _event_example(argv: list[str], tmp_path: Path) -> tuple[list[str], dict]:
    from megatron_skill.events import event as ev

    run = tmp_path / "runs" / "r0123456789abcdef"
    (run / "logs").mkdir(parents=True)
    (run / "launch.sh").write_text("#!/bin/bash\n")
    event = ev.sign(ev.new("job.failed", run.name, {"job_id": "7"}, "job", details={"signal": "SIGKILL"}), b"doc")
    (tmp_path / "event.json").write_text(json.dumps(ev.body(event)))
    argv = [str(tmp_path / a) if a in ("event.json", "runs") else a for a in argv] + ["--dry-run"]
    return argv, {ev.SECRET_ENV: "doc"}


def test_what_the_text_says_about_plan_outputs_holds():
    # production-examples.md and benchmarks.md: TP8 PP16 VP8 CP2 DP64 first for Llama 3.1 405B on 16,384 H100s.
    rc, out, _ = run_cli("plan", "--model", "llama3.1-405b", "--gpu", "h100-sxm", "--num-gpus", "16384",
                         "--seq-length", "8192", "--global-batch-size", "2048", "--top", "3")
    assert rc == 0 and out["result"]["plans"][0]["label"].startswith("TP8 PP16 VP8 CP2 DP64")
    # instructions.md section 8: CP is refused without Transformer Engine.
    rc, out, _ = run_cli("plan", "--model", "llama3-8b", "--gpu", "h100-sxm", "--num-gpus", "64", "--seq-length",
                         "131072", "--global-batch-size", "64", "--no-transformer-engine")
    assert all(p["layout"]["cp"] == 1 for p in out["result"]["plans"]) if rc == 0 else out["error"]["code"] == "infeasible"


def test_every_figure_of_ours_in_benchmarks_names_its_command_and_result_file():
    text = (ROOT / "references" / "benchmarks.md").read_text()
    ours = text.split("## Ours", 1)[1].split("## Published", 1)[0]
    sections = re.split(r"\n### ", ours)[1:]
    assert sections
    for sec in sections:
        has_figures = any(re.search(r"\|\s*[\d,.]+", ln) for ln in sec.splitlines() if ln.startswith("|"))
        if not has_figures:
            continue
        title = sec.splitlines()[0]
        assert re.search(r"python (tools|benchmarks)/\w+\.py|bash benchmarks/\w+\.sh|run_benchmarks\.sh", sec), title
        assert re.search(r"results/|levers/", sec), title
    for ref in set(re.findall(r"`(results/[\w./-]+\.(?:json|log))`", text)):
        assert (ROOT / "references" / ref).exists(), ref
    for ref in set(re.findall(r"`levers/([\w.-]+\.json)`", text)):
        assert (ROOT / "references" / "results" / "h200-2026-12-02" / "levers" / ref).exists(), ref


def test_errors_of_the_past_do_not_come_back():
    """Flags that do not exist or are obsolete appear only as 'replaced by' mentions, never in code."""
    bad = ["--fp8-hybrid", "--cpu-optimizer-type", "--use-flash-attn", "--use-mcore-models"]
    for doc in DOCS:
        for block in code_blocks(doc, data=True):
            for flag in bad:
                assert flag not in block, f"{doc.name} uses {flag} in a code block"
        text = doc.read_text()
        for line in text.splitlines():   # H100/H200's 1,979 is the dense FP8 or the sparse BF16 peak
            if "1,979" in line:
                assert re.search(r"spars|fp8", line, re.I), f"{doc.name}: 1,979 TFLOP/s without its kind: {line}"
    moe = (ROOT / "references" / "production-examples.md").read_text()
    assert "Nemotron-4 340B (dense, not MoE)" in moe and "not 8 x 7B = 56B" in moe


# Flags in the prose that are not Megatron's or a launcher's: pip's, skillsaw's and the lab scripts'
# (benchmarks/run_levers.py --set, --iters; benchmarks/published_runs.py --fit; benchmarks/peers.py
# --mbs, --out; dev/plan_snapshot.py --compare).
OTHER_PROGRAMS = {"--no-build-isolation", "--set", "--iters", "--strict", "--fit", "--store", "--mbs", "--out",
                  "--compare"}


def test_every_flag_in_inline_code_is_real_or_named_obsolete():
    """`--flag` spans in the prose, not only code blocks: each is a Megatron, launcher or tool flag,
    or one the validate tool reports as obsolete (so the text can say what replaced it)."""
    from megatron_skill.adapter.flags import OBSOLETE
    from megatron_skill.contract import build_parser, tools

    known = megatron_option_strings() | launcher_option_strings() | OTHER_PROGRAMS | set(OBSOLETE)
    for tool in tools().values():
        known |= {opt for action in build_parser(tool)._actions for opt in action.option_strings}
    unknown, seen = [], 0
    for doc in DOCS:
        for span in re.findall(r"`([^`\n]+)`", doc.read_text()):
            for flag in FLAG.findall(span.replace("--no-*-", "")):
                seen += 1
                if flag not in known:
                    unknown.append(f"{doc.name}: {flag}")
    assert not unknown, unknown
    assert seen > 50


# ---- facts with one source in code: the prose may not say otherwise ---------------------------

def _prose_sentences():
    """(where, sentence) for the Markdown's prose (code blocks and quoted messages left out) and
    every description in the schemas."""
    out = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", " ", doc.read_text(), flags=re.S)
        # inline code: a name or a value is read as its text, a quoted message or command (4 words or more) left out
        text = re.sub(r"`([^`\n]*)`", lambda m: " " if len(m.group(1).split()) >= 4 else m.group(1), text)
        for para in re.split(r"\n\s*\n", text):
            for sentence in re.split(r"(?<=[.;])\s+(?=[A-Z(`*-])", " ".join(para.split())):
                out.append((doc.name, sentence))
    def walk(name, node, path):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "description" and isinstance(v, str):
                    out.append((f"{name}{path}", v))
                else:
                    walk(name, v, f"{path}/{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(name, v, f"{path}/{i}")

    for schema in sorted((ROOT / "schemas").glob("*.json")):
        walk(schema.name, json.loads(schema.read_text()), "")
    return out


def _numbers(sentence):
    return [float(x.replace(",", "")) for x in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?(?![\w.%])", sentence)]


def _training_defaults():
    return json.loads((ROOT / "tools/megatron_skill/core/catalog/training_defaults.json").read_text())


def test_the_default_init_std_is_told_as_the_code_computes_it():
    """Where a sentence speaks of the default init std, each std it names is one the rule of
    training_defaults.json gives (the anchor, the cap, or its value at a catalog model's width)."""
    from megatron_skill.core import catalog
    from megatron_skill.core.resolve import training_defaults

    table = _training_defaults()["init_method_std"]
    models = [catalog.get_model(name) for name in catalog.model_names()]
    allowed = {table["anchor_std"], table["at_most"]} | {training_defaults(m, 1000)["init_method_std"] for m in models}
    allowed |= {round(table["anchor_std"] * (table["anchor_hidden"] / h) ** 0.5, 4) for h in (2048, 8192, 12288, 16384)}
    wrong, seen = [], 0
    for where, sentence in _prose_sentences():
        if re.search(r"init(_method_std|-method-std| std|ialisation std)", sentence) and "default" in sentence:
            seen += 1
            stds = [x for x in _numbers(sentence) if 0 < x < 0.1]
            wrong += [f"{where}: {x} in {sentence!r}" for x in stds if not any(abs(x - a) < 6e-5 for a in allowed)]
            if not stds and "init_method_std" in where:
                wrong.append(f"{where}: names no default in {sentence!r}")
    assert seen >= 2 and not wrong, wrong


def test_the_default_learning_rates_are_told_as_the_table_says():
    """Learning rates named as defaults are rows of training_defaults.json, and the schema's lr
    names every one of them, the default from pretrained weights included."""
    table = _training_defaults()
    rows = [*table["dense"], table["moe"], table["from_pretrained"]]
    allowed = {r[k] for r in rows for k in ("lr", "min_lr")}
    wrong = []
    for where, sentence in _prose_sentences():
        if re.search(r"\b(lr|LR|learning rate|rate)\b", sentence) and re.search(r"\bdefaults?\b", sentence):
            rates = [x for x in _numbers(sentence) if 0 < x < 1e-2]
            wrong += [f"{where}: {x:g} in {sentence!r}" for x in rates if not any(abs(x - a) < 1e-12 for a in allowed)]
    assert not wrong, wrong
    lr_text = json.loads((ROOT / "schemas/common.json").read_text())["$defs"]["training"]["properties"]["lr"]["description"]
    named = set(_numbers(lr_text))
    assert {r["lr"] for r in rows} <= named, (sorted({r["lr"] for r in rows} - named), lr_text)


# Claims that would contradict what the code does, each with the code that decides it.
def _hf_import_exists():
    from megatron_skill.contract import tools

    return "import-hf" in tools() and "export-hf" in tools()


def _fp8_runs_without_te():
    from megatron_skill.contract import call

    env = call("plan", {"model": "llama3.2-1b", "gpu": "h200", "num_gpus": 1, "seq_length": 4096, "precision": "fp8",
                        "transformer_engine": False, "top": 1})
    return env["ok"] and env["result"]["plans"][0]["layout"]["precision"] == "fp8"


def _cp_needs_te():
    from megatron_skill.contract import call

    env = call("plan", {"model": "llama3-8b", "gpu": "h100-sxm", "num_gpus": 16, "seq_length": 32768,
                        "global_batch_size": 16, "transformer_engine": False, "constraints": {"cp": 2}})
    return not env["ok"] or all(p["layout"]["cp"] == 1 for p in env["result"]["plans"])


CONTRADICTIONS = [
    (_hf_import_exists, "Hugging Face import and export are tools of the skill", [
        r"only pre-?trains?\b", r"pre-?trains? (only )?from random initiali[sz]ation\.",
        r"needs? (a converter|Megatron-Bridge|NeMo)[^.]*(Hugging Face|HF) checkpoint",
        r"(Hugging Face|HF) checkpoint[^.]*needs? (a converter|Megatron-Bridge)",
        r"(cannot|can't|does not|doesn't|no way to) (import|load|convert|start from) (a )?(Hugging Face|HF)"]),
    (_fp8_runs_without_te, "FP8 runs without Transformer Engine, through the skill's own FP8 layers", [
        r"FP8 (always |only )?(needs|requires) (Transformer Engine|TE)\.",
        r"FP8 (is )?(not available|impossible|unsupported) without (Transformer Engine|TE)",
        r"without (Transformer Engine|TE),? (there is )?no FP8"]),
    (_cp_needs_te, "context parallelism needs Transformer Engine", [
        r"(context parallelism|\bCP\b)[^.]*(runs|works|is available|is supported) without (Transformer Engine|TE)\b",
        r"(context parallelism|\bCP\b) (does not|doesn't) need (Transformer Engine|TE)\b"]),
]


@pytest.mark.parametrize("fact,claim,patterns", CONTRADICTIONS, ids=[c[1][:40] for c in CONTRADICTIONS])
def test_no_prose_contradicts_what_the_code_does(fact, claim, patterns):
    assert fact(), f"the code no longer holds: {claim}; change the prose and this test together"
    found = [f"{where}: {sentence!r}" for where, sentence in _prose_sentences()
             for p in patterns if re.search(p, sentence, flags=re.I)]
    assert not found, found


# How the prose names each family the import converts (convert/hf.py ARCHITECTURES), and names
# of families it does not convert that a list of supported ones must not hold.
FAMILY_NAMES = {"llama": r"\bLlama\b", "mistral": r"\bMistral\b", "qwen2": r"\bQwen ?2\b",
                "qwen3": r"\bQwen ?(?:2 ?/ ?)?3\b(?!-MoE)", "mixtral": r"\bMixtral\b", "qwen3_moe": r"\bQwen3-MoE\b"}
NOT_CONVERTED = r"\b(Gemma|DeepSeek|Phi-?\d|Falcon|GPT-?2|Mamba|Nemotron|OLMo|Baichuan)\b"


def test_every_list_of_the_imports_families_is_the_codes():
    """A sentence that lists the families import-hf converts (it names five of them or more; one
    naming a few, as what a test covers, is not such a list) names every family of
    convert/hf.py's ARCHITECTURES and none it does not convert; a family added in code fails
    here until the docs (and FAMILY_NAMES) say so."""
    from megatron_skill.convert.hf import ARCHITECTURES

    assert set(ARCHITECTURES.values()) == set(FAMILY_NAMES)
    lists = [(where, s) for where, s in _prose_sentences()
             if sum(bool(re.search(p, s)) for p in FAMILY_NAMES.values()) >= len(FAMILY_NAMES) - 1]
    assert len({where for where, _ in lists}) >= 3, lists   # SKILL.md, choosing.md, pretrained.md
    for where, sentence in lists:
        missing = [f for f, pattern in FAMILY_NAMES.items() if not re.search(pattern, sentence)]
        assert not missing, (where, missing, sentence[:300])
        assert not re.search(NOT_CONVERTED, sentence), (where, sentence[:300])
