"""The validate tool: check a launch script (the skill's or anyone's) or a render request.

A script is read as bash would read it, never run (script_args, shell): each way through its
undecided conditions that starts Megatron gives one argument vector, checked on its own; a
finding true of only some ways says which. Each vector is checked for unknown and obsolete
flags (an exact replacement, computed from the script's values and checked again), values
Megatron's parser refuses, the combinations Megatron's validate_args asserts, the layout
rules (world size, divisibility, FP8 before Hopper, CUDA_DEVICE_MAX_CONNECTIONS), and memory
for the layout and the attention path that will run. Where megatron-core is importable,
Megatron's own parser and validate_args run too, and what they warn of is a warning; the
answer's `checks` says how deep the check went. Everything is found in one pass: a value that
cannot be read is left out of the other checks, and Megatron's checks (which stop at the first
refusal) read a copy with each error the skill found and can repair repaired.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import shlex
import stat
from pathlib import Path
from typing import Any

from ..adapter import arguments as megatron_args
from ..adapter import described, manifest
from ..adapter import flags as megatron_flags
from ..adapter import parser as megatron_parser
from ..adapter import script as script_args
from ..contract import ROOT, Context, Tool, invoke, validate_request
from ..core.catalog import get_gpu
from ..core.flops import padded_vocab_size
from ..core.layout import RULES, Layout, broken_rules
from ..core.memory import GIB, memory_report
from ..core.memory import peak as memory_peak
from ..core.model import REFUSED_WHEN_BUILT, ModelConfig
from ..core.moe import MoEOptions
from ..errors import ToolError

# What Megatron's validate_args warns of, by the rule the skill knows it as (so that a warning
# is not said twice); anything else it says keeps the code megatron_warning.
MEGATRON_WARNING_CODES = (("Disabling sequence parallelism", "sp_needs_tp"),)


def _finding(code: str, message: str, fix: str, where: str | None = None, severity: str = "error",
             **extra: Any) -> dict:
    out = {"code": code, "severity": severity, "message": message, "fix": fix}
    if where:
        out["where"] = where
    out.update({k: v for k, v in extra.items() if v is not None})
    return out


# Megatron-LM's training entries that add no flags of their own beyond its optional groups
MEGATRON_PLAIN_ENTRIES = {"pretrain_gpt", "pretrain_mamba", "pretrain_hybrid"}


@dataclasses.dataclass
class Launch:
    """One argument vector to check, with what the script says around it."""
    args: list[str]
    world: int | None
    env: dict[str, str]
    lines: list[int] | None = None       # the script line of each argument
    entry: str | None = None
    path: str | None = None              # the way through the script's conditions
    script_text: str = ""                # the script, for what the vector alone does not show
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[dict] = dataclasses.field(default_factory=list)   # warnings about how the vector was found

    @property
    def kind(self) -> str:
        """gpt: Megatron's GPT entry (or the skill's), whose flags the manifest holds and whose model
        the planner costs; training: another training entry (its own flags and model besides);
        other: inference, conversion and the like."""
        if self.entry is None:
            return "gpt"
        stem = script_args.entry_stem(self.entry)
        if stem == "pretrain_gpt":
            return "gpt"
        return "training" if re.match(r"(pretrain|train|finetune|sft)", stem) else "other"

    @property
    def megatrons_own(self) -> bool:
        """A training entry of Megatron-LM's that adds no flags of its own beyond the optional
        groups (pretrain_mamba.py runs pretrain_hybrid.py, which adds only modelopt's)."""
        return self.entry is not None and script_args.entry_stem(self.entry) in MEGATRON_PLAIN_ENTRIES

    def where(self, flag: str) -> str | None:
        if self.lines:
            for a, line in zip(self.args, self.lines):
                if a.split("=", 1)[0] == flag:
                    return f"line {line}"
        return None


# Megatron-LM's entries that core_v0.19.0 moved out of its root or removed (its tree read at that
# tag against core_v0.12.0's): where each is now, or None where it is gone.
MOVED_ENTRIES = {"pretrain_bert.py": "examples/bert/pretrain_bert.py", "pretrain_t5.py": "examples/t5/pretrain_t5.py",
                 "pretrain_retro.py": None, "pretrain_ict.py": None, "pretrain_vision_classify.py": None,
                 "pretrain_vision_dino.py": None, "pretrain_vision_inpaint.py": None}


def _entry_notes(launch: Launch) -> list[dict]:
    """A root entry of an older Megatron-LM that 0.19's tree no longer has there (a warning: the
    script may run an older checkout, whose flags are another matter)."""
    if launch.entry is None:
        return []
    parts = launch.entry.replace("\\", "/").split("/")
    name = parts[-1]
    if name not in MOVED_ENTRIES or (len(parts) > 1 and parts[-2] in ("bert", "t5")):
        return []
    now = MOVED_ENTRIES[name]
    return [_finding("entry_moved", f"{name}: Megatron-LM core_v0.19.0 has no {name} at its root" +
                     (f"; it is {now}" if now else "; the model was removed"),
                     f"run {now} of a 0.19 checkout" if now else
                     f"run a Megatron-LM release that has {name}, and validate against its flags", severity="warning")]


# ---- one vector ----------------------------------------------------------------------
def _flag_findings(launch: Launch) -> tuple[list[dict], list[str]]:
    """Unknown and obsolete flags, each with its exact fix; and the vector Megatron's parser can
    read (unknown flags and their values left out)."""
    reader = _FlagReader(launch)
    for a in launch.args:
        if a.startswith("--"):
            reader.flag(a)
        else:
            reader.word(a)
    if reader.stray:
        reader.findings.append(reader.stray_finding())
    return reader.findings, reader.clean


class _FlagReader:
    """A launch's argument vector read word by word as Megatron's parser reads it: which words are
    a flag's values, which flags are unknown, obsolete or conditional, and which words no flag takes."""

    def __init__(self, launch: Launch):
        self.launch = launch
        self.known = megatron_flags.known_flags()
        _, changes = megatron_flags.rewrite_obsolete(launch.args)
        self.fixes = {c["flag"]: c for c in changes}
        self.findings: list[dict] = []
        self.clean: list[str] = []      # what Megatron's parser can read
        self.skip_values = False        # the words after a flag left out are its values: left out too
        self.owner, self.room = None, 0   # the flag whose values are being read, and how many it still takes
        self.stray: list[str] = []      # words that no flag takes
        self.choose = None   # a conditional flag whose value comes next, and the values it takes

    def word(self, a: str) -> None:
        if self.choose is not None:
            self.findings.extend(_choice(self.choose[0], a, self.choose[1], self.launch))
            self.choose = None
        if self.skip_values:
            return
        if self.room == 0:
            if "$" not in a:   # a variable the script leaves to its caller is not a stray word
                self.stray.append(a)
            return
        if self.room > 0:
            self.room -= 1
        self.clean.append(a)

    def flag(self, a: str) -> None:
        flag = a.split("=", 1)[0]
        self.skip_values, self.choose = False, None
        if flag in self.known:
            self.owner = flag
            n = megatron_flags.arity(flag)
            self.room = (0 if "=" in a else n) if n is not None else -1   # -1: a list takes any number
        else:
            self.owner, self.room = None, 0
        entry = megatron_flags.obsolete_entry(flag)
        group = megatron_flags.conditional_group(flag) if flag not in self.known else None
        if entry is not None:
            self._obsolete(a, flag, entry)
        elif group is not None:
            self._conditional(a, flag, group)
        elif flag not in self.known:
            self._unknown(flag)
        else:
            self.clean.append(a)

    def _obsolete(self, a: str, flag: str, entry: megatron_flags.Obsolete) -> None:
        known = flag in self.known
        fix = (self.fixes.get(flag) or {"fix": entry.fix_text(flag)})["fix"]
        message = _obsolete_message(flag, entry, known)
        # another entry may define the old name itself (examples/multimodal's train.py adds --use-te)
        own = not known and self.launch.kind != "gpt" and not self.launch.megatrons_own
        if own:
            message += f"; {self.launch.entry} may add it itself (its extra_args_provider)"
            fix = f"check it against {self.launch.entry}'s own arguments; in Megatron's: {fix}"
        self.findings.append(_finding("obsolete_flag", message, fix, self.launch.where(flag),
                                      severity="error" if (entry.refused and known) or (not known and not own)
                                      else "warning"))
        if known:
            self.clean.append(a)
        else:
            self.skip_values = True
            if not own:   # read as what replaces it (a renamed recompute flag still recomputes)
                self.clean.extend((self.fixes.get(flag) or {}).get("added", []))

    def _conditional(self, a: str, flag: str, group) -> None:
        n, choices = group.flags[flag]
        value = a.split("=", 1)[1] if "=" in a else None
        self.findings.append(_finding(
            "conditional_flag", f"{flag} is a flag of Megatron's optional {group.name} arguments: "
            f"{group.condition}; elsewhere (the skill's entry, or no nvidia-modelopt) the parser refuses it",
            "run this launch where nvidia-modelopt imports (NGC's PyTorch container with a Megatron-LM "
            f"checkout of the same tag), or drop {flag}" + (f" (values: {', '.join(choices)})" if choices else ""),
            self.launch.where(flag), severity="warning", source=group.source))
        if choices and value is not None:
            self.findings.extend(_choice(flag, value, choices, self.launch))
        self.owner, self.room = None, 0
        self.skip_values = n > 0 and value is None
        self.choose = (flag, choices) if self.skip_values and choices else None

    def _unknown(self, flag: str) -> None:
        hint = megatron_flags.suggest(flag)
        launch = self.launch
        if launch.info.get("fragment"):
            # flags a script only defines (no launch in it): the entry that reads them is not known
            self.findings.append(_finding("unknown_flag", f"{flag} is not a flag of Megatron's pretrain_gpt.py; the "
                                          "script starts no launch, so the entry that reads it (which may add it "
                                          "itself) is not known", (hint + "; else " if hint else "") +
                                          "check it against that entry's own arguments", launch.where(flag),
                                          severity="warning"))
        elif launch.kind == "gpt" or launch.megatrons_own:
            entry = script_args.entry_stem(launch.entry) + ".py" if launch.entry else "pretrain_gpt.py"
            self.findings.append(_finding("unknown_flag", f"{flag} is not a flag of Megatron's {entry}",
                                          hint or "remove it", launch.where(flag)))
        else:   # the entry may add it (extra_args_provider): not ours to refuse
            self.findings.append(_finding("unknown_flag", f"{flag} is not a flag of Megatron's pretrain_gpt.py; "
                                          f"{launch.entry} may add it itself", hint or "check it against "
                                          f"{launch.entry}'s own arguments", launch.where(flag), severity="warning"))
        self.skip_values = True

    def stray_finding(self) -> dict:
        quoted = " ".join(self.stray[:6]) + (" ..." if len(self.stray) > 6 else "")
        # a template's placeholder in the script's code (a comment's "<1 or 2>" is no value)
        code = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in (self.launch.script_text or "").splitlines())
        placeholders = re.findall(r"<[^<>\n]{1,80}>", code)
        words = {w for p in placeholders for w in p.strip("<>").split()}
        placeholder = placeholders[0] if placeholders else None
        if placeholder and all("<" in w or ">" in w or w in words for w in self.stray):
            # a template's "<some dir>", expanded unquoted: its words split the value it stands in
            return _finding(
                "placeholder", f"the script holds a placeholder to fill in ({placeholder}): as it stands, "
                f"its words split a flag's value and leave {len(self.stray)} word(s) no flag takes ({quoted})",
                f"replace {placeholder} with a real value before the script runs",
                self.launch.where(self.owner) if self.owner else None, severity="warning")
        if self.launch.kind == "other":   # a tool of its own (a converter, an inspector): its positionals
            return _finding("stray_arguments", f"{len(self.stray)} word(s) no Megatron training flag takes "
                            f"({quoted}): {self.launch.entry} is not a training entry, and they may be its own "
                            "positional arguments", f"check them against {self.launch.entry}'s own usage",
                            self.launch.where(self.owner) if self.owner else None, severity="warning")
        split = bool(re.search(r"(?<![\"'])\$\{\w+\[[@*]\]\}", self.launch.script_text or ""))
        return _finding(
            "stray_arguments", f"{len(self.stray)} word(s) that no flag takes ({quoted}): Megatron's parser refuses "
            "them as unrecognized arguments" + (": an unquoted ${ARRAY[@]} expansion splits a quoted item such as "
                                                "\"--flag 'a b'\" into several words" if split else ""),
            "quote the array expansions (\"${ARGS[@]}\") so that each item stays one word, or give the value "
            "as the flag expects", self.launch.where(self.owner) if self.owner else None)


def _choice(flag: str, value: str, choices: tuple[str, ...], launch: Launch) -> list[dict]:
    """A bad_value error where a conditional flag's value is not one of its choices ($ left alone)."""
    if value in choices or "$" in value:
        return []
    return [_finding("bad_value", f"{flag} {value}: not one of its choices ({', '.join(choices)})",
                     f"give one of {', '.join(choices)}", launch.where(flag))]


def _obsolete_message(flag: str, entry: megatron_flags.Obsolete, known: bool) -> str:
    """What Megatron 0.19 does with an obsolete flag, in its own words where its code has them."""
    retired = megatron_flags.megatron_retired().get(flag)
    says = f' (Megatron: "{retired.says}")' if retired else ""
    if not known:
        return f"{flag} is obsolete: Megatron 0.19 does not know it"
    if entry.refused:
        return f"{flag} is retired: Megatron 0.19's parser reads it, then validate_args stops on it" + says
    return f"{flag} is deprecated: Megatron 0.19 accepts it and ignores or translates it" + says


def fixed_vector(args: list[str]) -> list[str]:
    """args with every obsolete flag replaced, every unknown flag that is a clear misspelling of a
    known one corrected, and words split off a one-value flag's value joined back to it (as the
    script's quotes meant); other unknown flags (and their values) kept for the user."""
    out, _ = megatron_flags.rewrite_obsolete(args)
    known = megatron_flags.known_flags()
    fixed: list[str] = []
    room, owner_at, takes = 0, None, None   # values the flag before still takes; where its one value is
    for a in out:
        flag, eq, value = a.partition("=")
        if a.startswith("--"):
            if flag not in known and megatron_flags.conditional_group(flag) is None:
                hint = megatron_flags.suggest(flag) or ""
                m = re.fullmatch(r"did you mean (--[\w-]+)\?", hint)
                if m:
                    a, flag = m.group(1) + eq + value, m.group(1)
            takes = megatron_flags.arity(flag) if flag in known else None
            room, owner_at = (0 if eq else takes) if takes is not None else -1, None
            fixed.append(a)
            continue
        if room == 0 and owner_at is not None and "$" not in a:
            fixed[owner_at] += " " + a        # a stray word: part of the value before it
            continue
        if room > 0:
            room -= 1
            # only a one-value flag's value gathers the words after it (not one of several values)
            owner_at = len(fixed) if room == 0 and takes == 1 else None
        fixed.append(a)
    return fixed


def check_launch(launch: Launch, gpu_name: str | None, recheck_fix: bool = True) -> dict[str, Any]:
    flag_findings, clean = _flag_findings(launch)
    findings = list(launch.notes) + _entry_notes(launch) + flag_findings
    checks: dict[str, str] = {}
    assumed: dict[str, str] = {}
    have_megatron = megatron_parser.available()
    result: dict[str, Any] = {"megatron_args": launch.args, "checks": checks, "assumed": assumed,
                              "layout": None, "predicted_peak_gib": None}
    clean, checks["flags"] = _readable(clean, launch, findings, assumed)
    if clean is None:
        result["memory"] = {"skipped": "a value could not be read (see the bad_value error)"}
        return _close(result, findings, launch, gpu_name, recheck_fix)
    ns = described.parse_values(megatron_flags.rewrite_obsolete(clean)[0])   # as Megatron reads them
    for combo in megatron_flags.COMBINATIONS:
        if combo.when(ns):
            findings.append(_finding(combo.code, combo.message, combo.fix, launch.where(combo.flag)))
    gpu = get_gpu(gpu_name, where="/gpu") if gpu_name else None
    size, source, read = described.vocabulary(ns)
    result["vocabulary"] = {"size": size, "source": source, "read": read}
    model, why = described.model_from_args(ns, assumed)
    if model is None and all(getattr(ns, k, None) is not None for k in described.MODEL_SIZE_ARGUMENTS):
        beyond = described.OUT_OF_RANGE in (why or "")
        # an error only where no GPU holds the model; else this check's own reading stops here and
        # Megatron's checks, which still run, say whether Megatron refuses it
        findings.append(_finding("model_out_of_range" if beyond else "bad_model",
                                 f"the model-size flags describe no model this check covers: {why}",
                                 "correct the model-size flags (a typo?); the layout and memory are unchecked",
                                 severity="error" if (beyond and described.no_run_has(why))
                                 or REFUSED_WHEN_BUILT in (why or "") else "warning"))
        result["memory"] = {"skipped": f"no model: {why}"}
    elif model is None:
        findings.append(_finding("incomplete", f"cannot check the layout: {why}", "set the model-size flags",
                                 severity="warning"))
        result["memory"] = {"skipped": f"no model: {why}"}
    else:
        _check_layout(launch, ns, model, gpu, findings, result, assumed, have_megatron)
    impl = getattr(ns, "transformer_impl", None)
    if impl == "local":
        skill_entry = any(a.startswith("--skill-") for a in launch.args)   # only the skill's entry knows them
        missing = [f for f in megatron_args.no_te_flags_needed(skill_entry) if f not in launch.args]
        if missing:
            findings.append(_finding("local_needs_no_fusion", "--transformer-impl local without " + " ".join(missing),
                                     "add them where Transformer Engine and apex are absent (the fused paths import "
                                     "them and fail)", severity="warning"))
    _recipe_traps(launch, ns, model, findings, checks)
    _megatron_checks(launch, clean, findings, checks, have_megatron)
    return _close(result, findings, launch, gpu_name, recheck_fix)


def _training_dtype(ns: argparse.Namespace, findings: list[dict], launch: Launch, assumed: dict[str, str]) -> str:
    """bf16, fp16 or fp32 (neither flag: Megatron's default), with what the memory check makes of it."""
    if getattr(ns, "bf16", False):
        return "bf16"
    if getattr(ns, "fp16", False):
        assumed["precision"] = "fp16, costed as bf16 (two bytes a value alike; the loss scaler's state is small)"
        return "fp16"
    left = [a for a in launch.args if not a.startswith("--") and UNRESOLVED.match(a)]
    if left:   # a word of the launch only the run expands ($PRECISION_ARGS) may hold the flag
        assumed["precision"] = (f"bf16: the launch sets neither --bf16 nor --fp16, and {left[0]}, which only the "
                                "run expands, may")
        return "bf16"
    if launch.kind != "other":
        findings.append(_finding(
            "fp32_training", "neither --bf16 nor --fp16: Megatron trains in fp32, with twice the activation memory "
            "of 16-bit training and without the BF16 tensor-core rate (LLM recipes train in bf16)",
            "add --bf16", severity="warning"))
    return "fp32"


# What training recipes (Llama, GPT-3, Qwen, NVIDIA's own) set where Megatron's defaults differ.
RECIPE_VALUES = {"adam_beta2": 0.95, "weight_decay": 0.1}
TOKENIZER_PACKAGES = {"SentencePieceTokenizer": "sentencepiece", "GPTSentencePieceTokenizer": "sentencepiece",
                      "Llama2Tokenizer": "sentencepiece", "TikTokenizer": "tiktoken",
                      "HuggingFaceTokenizer": "transformers"}


def _recipe_traps(launch: Launch, ns: argparse.Namespace, model: ModelConfig | None, findings: list[dict],
                  checks: dict[str, str]) -> None:
    """Warnings for what a training launch leaves to Megatron's defaults where those differ from
    what training recipes use (the defaults read from Megatron's own parser), for a backend flag
    that old scripts carry, and for the package a tokenizer type needs where the job runs."""
    if launch.kind == "other":
        return   # inference, conversion: no training recipe, and an entry with its own tokenizer handling
    given = {a.split("=", 1)[0] for a in launch.args if a.startswith("--")}
    kind = getattr(ns, "tokenizer_type", None)
    package = TOKENIZER_PACKAGES.get(kind or "")
    if package:
        import importlib.util
        here = "installed here" if importlib.util.find_spec(package) else "not installed here"
        findings.append(_finding("tokenizer_needs_package", f"--tokenizer-type {kind} needs the {package} package "
                                 f"where the job runs ({here}); without it Megatron stops when it builds the "
                                 "tokenizer", f"pip install {package} in the job's Python (or its container)",
                                 launch.where("--tokenizer-type"), severity="warning"))
    backend = getattr(ns, "distributed_backend", None)
    if "--distributed-backend" in given:
        if backend == "gloo":
            findings.append(_finding("distributed_backend", "--distributed-backend gloo: every collective of a GPU "
                                     "run goes through the host (far slower than NCCL, and Megatron's overlapped "
                                     "communication assumes NCCL)", "drop --distributed-backend gloo (NCCL is "
                                     "Megatron's default)", launch.where("--distributed-backend"), severity="warning"))
        else:
            findings.append(_finding("distributed_backend", f"--distributed-backend {backend} is Megatron's default "
                                     "already: a flag old scripts carry that changes nothing", "drop it",
                                     launch.where("--distributed-backend"), severity="warning"))
    if launch.info.get("fragment"):
        return   # flags kept elsewhere: the recipe is not all here
    dflt, source = megatron_parser.defaults()
    checks["recipe"] = f"Megatron's defaults from {source}"
    llama_style = model is not None and (model.activation == "swiglu" or model.normalization == "RMSNorm")
    unset_dropout = [f"--{d.replace('_', '-')}" for d in ("hidden_dropout", "attention_dropout")
                     if f"--{d.replace('_', '-')}" not in given and (dflt.get(d) or 0) > 0]
    if llama_style and unset_dropout:
        findings.append(_finding("recipe_dropout", f"{' and '.join(unset_dropout)} not set: Megatron's default "
                                 f"{dflt.get('hidden_dropout')} applies, while Llama-style recipes (SwiGLU, RMSNorm) "
                                 "train without dropout; it also costs speed and memory (the dropout masks)",
                                 " ".join(f"{f} 0.0" for f in unset_dropout), severity="warning"))
    for dest, recipe in RECIPE_VALUES.items():
        flag = f"--{dest.replace('_', '-')}"
        if flag not in given and dflt.get(dest) is not None and dflt[dest] != recipe:
            findings.append(_finding(f"recipe_{dest}", f"{flag} not set: Megatron's default {dflt[dest]} applies, "
                                     f"while LLM pre-training recipes use {recipe}", f"{flag} {recipe}",
                                     severity="warning"))
    warmup = ("--lr-warmup-iters", "--lr-warmup-samples", "--lr-warmup-fraction")
    if not given & set(warmup) and not (dflt.get("lr_warmup_iters") or dflt.get("lr_warmup_samples")
                                        or dflt.get("lr_warmup_fraction")):
        iters = getattr(ns, "train_iters", None)
        hint = f" (about {max(1, iters // 100):,} of its {iters:,} iterations)" if isinstance(iters, int) and iters else ""
        findings.append(_finding("no_lr_warmup", "no learning-rate warm-up: Megatron starts at the full --lr "
                                 "(its default warm-up is 0), which recipes avoid; the first steps' loss can spike "
                                 "or diverge", f"--lr-warmup-iters N, about 1 % of the run{hint}",
                                 severity="warning"))


def _readable(clean: list[str], launch: Launch, findings: list[dict],
              assumed: dict[str, str]) -> tuple[list[str] | None, str]:
    """clean with each flag whose value the manifest refuses left out (each an error), so that
    the other checks still run; None where the refusal names no flag. And what checked them."""
    for _ in range(len(clean)):
        try:
            return clean, megatron_flags.check_values(clean)
        except ToolError as e:
            refused = re.search(r"argument (--[\w-]+)", e.message)
            unresolved = refused and _unresolved_value(clean, refused.group(1))
            if unresolved:   # the script leaves it to whoever starts it: not this check's to refuse
                flag = refused.group(1)
                findings.append(_finding(
                    "unresolved_value", f"{flag} {unresolved}: the script does not set it (a variable of the job's "
                    f"environment, or a command's output), so its value is not checked", f"make sure {unresolved} "
                    f"is set where the job starts (Megatron refuses {flag} without a value of its type), or set it "
                    "in the script", launch.where(flag), severity="warning"))
                assumed[flag] = f"left out: its value {unresolved} is known only when the job starts"
            else:
                findings.append(_finding("bad_value", e.message, e.fix or "correct the value",
                                         launch.where(refused.group(1)) if refused else None))
            if refused is None:
                return None, "refused a value: the other checks need the values read"
            if not unresolved:
                assumed[refused.group(1)] = "left out: its value could not be read (see the bad_value error)"
            clean = _without(clean, {refused.group(1)})
    return None, "refused a value: the other checks need the values read"


UNRESOLVED = re.compile(r"\$(\{|\(|[A-Za-z_])")   # $NAME, ${...}, $(...): left for the run to expand


def _unresolved_value(args: list[str], flag: str) -> str | None:
    """The value of flag's last occurrence in args (the one Megatron's parser keeps) where the
    script left it to the run ($VAR, ${VAR}, $(command)), else None (a literal: its own error)."""
    found = megatron_flags.last_value(args, flag)
    return found if found is not None and UNRESOLVED.search(found) else None


def _without(args: list[str], drop: set[str]) -> list[str]:
    """args less each flag in drop and the values that follow it."""
    out: list[str] = []
    dropping = False
    for a in args:
        if a.startswith("--"):
            dropping = a.split("=", 1)[0] in drop
        if not dropping:
            out.append(a)
    return out


def _check_layout(launch: Launch, ns: argparse.Namespace, model: ModelConfig, gpu: Any, findings: list[dict],
                  result: dict[str, Any], assumed: dict[str, str], have_megatron: bool) -> None:
    world = launch.world
    lay = described.layout_from_args(ns, model, world, assumed)
    uneven = _uneven_virtual_split(ns, model, lay.pp)
    if uneven:
        findings.append(_finding("vp_layers", uneven, RULES["vp_layers"].fix,
                                 launch.where("--num-layers-per-virtual-pipeline-stage")))
        lay = dataclasses.replace(lay, vp=1)   # costed without the virtual stages it cannot have
    beyond = described.beyond_plan_bounds(lay=lay)
    if beyond:
        findings.append(_finding("layout_out_of_range", f"the layout and batch flags describe no run this check "
                                 f"covers: {beyond}", "correct the parallel sizes, batch sizes and sequence length",
                                 severity="error" if described.no_run_has(beyond) else "warning"))
        result["memory"] = {"skipped": f"no layout: {beyond}"}
        return
    result["layout"] = {**lay.to_json(), **({"vp": None} if uneven else {})}
    result["model"] = {"params_b": round(model.total_params() / 1e9, 3), "activation": model.activation,
                       "num_layers": model.num_layers, "hidden_size": model.hidden_size}
    if world is not None and world % (lay.tp * lay.pp * lay.cp):
        findings.append(_finding("world_size", f"{world} GPUs cannot be split into TP {lay.tp} x PP {lay.pp} x "
                                 f"CP {lay.cp} (DP would be {world / (lay.tp * lay.pp * lay.cp):.2f})",
                                 RULES["world_size"].fix))
    te = described.transformer_engine(ns)
    moe = MoEOptions.from_args(ns)
    for rule in broken_rules(lay, model, gpu or get_gpu("h100-sxm"), lay.world_size, te=te, moe=moe):
        if rule == "world_size" or (rule == "fp8_arch" and gpu is None):
            continue
        if rule == "tp_query_groups" and not (ns.group_query_attention and ns.num_query_groups):
            continue   # no query groups set: each head is its own, and tp_heads says it
        if rule == "sp_needs_tp":
            if not have_megatron:  # where Megatron runs, its own warning says it
                findings.append(_finding(rule, "sequence parallel at TP 1: Megatron switches it off (a warning, "
                                         "not an error)", RULES[rule].fix, launch.where("--sequence-parallel"),
                                         severity="warning"))
            continue
        findings.append(_finding(rule, RULES[rule].message, RULES[rule].fix))
    if lay.sequence_parallel and lay.tp == 1:   # as Megatron runs it (it switches SP off at TP 1)
        lay = dataclasses.replace(lay, sequence_parallel=False)
        result["layout"]["sequence_parallel"] = False
    # Megatron asserts it on Hopper and older, unless FSDP or the MoE all-to-all overlap run (they
    # want several queues; Megatron only warns then)
    several_queues = bool(ns.use_megatron_fsdp or ns.use_torch_fsdp2 or ns.overlap_moe_expert_parallel_comm)
    if (lay.tp > 1 or lay.cp > 1) and launch.env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1" and \
            (gpu is None or float(gpu.compute_capability) < 10) and not several_queues:
        findings.append(_finding("cuda_device_max_connections",
                                 "TP or CP > 1 without CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron refuses to start "
                                 "on Hopper and older)", "export CUDA_DEVICE_MAX_CONNECTIONS=1 before the launch"))
    _pretrained_rows(launch, ns, lay.tp, findings, result)
    result["memory"] = _memory_verdict(launch, ns, model, lay, gpu, findings, assumed)
    result["predicted_peak_gib"] = result["memory"].get("peak_gib")


def _memory_verdict(launch: Launch, ns: argparse.Namespace, model: ModelConfig, lay: Layout, gpu: Any,
                    findings: list[dict], assumed: dict[str, str]) -> dict[str, Any]:
    """_memory for Megatron's GPT entry; for fp32 training its 16-bit cost as a lower bound (an
    error where even that does not fit, no verdict where it does); nothing for another entry."""
    fp32 = _training_dtype(ns, findings, launch, assumed) == "fp32"
    if launch.kind != "gpt":
        return {"skipped": f"{launch.entry} is not Megatron's GPT training entry: its model and memory are not the "
                           "ones the planner costs"}
    memory = _memory(launch, ns, model, lay, gpu, findings, assumed)
    if fp32 and "peak_gib" in memory:
        return {"skipped": "fp32 training: the memory model costs 16-bit weights and activations",
                "lower_bound_gib": memory["peak_gib"]}
    return memory


def _uneven_virtual_split(ns: argparse.Namespace, model: ModelConfig, pp: int) -> str | None:
    """Where --num-layers-per-virtual-pipeline-stage does not divide the layers of a pipeline rank
    (counted as Megatron counts them), why; None otherwise (an uneven PP split is pp_layers')."""
    per_chunk = ns.num_layers_per_virtual_pipeline_stage
    layers = model.num_layers + bool(ns.account_for_embedding_in_pipeline_split) + \
        bool(ns.account_for_loss_in_pipeline_split)
    if not per_chunk or ns.num_virtual_stages_per_pipeline_rank or layers % pp:
        return None
    if (layers // pp) % per_chunk == 0:
        return None
    return (f"--num-layers-per-virtual-pipeline-stage {per_chunk} does not divide the {layers // pp} layers of each "
            f"pipeline rank: no whole number of virtual stages (Megatron refuses it)")


def _pretrained_rows(launch: Launch, ns: argparse.Namespace, tp: int, findings: list[dict],
                     result: dict[str, Any]) -> None:
    """A checkpoint the script starts from (--pretrained-checkpoint, or --load with --finetune)
    that lies here: its embedding rows against the rows this script pads its vocabulary to at its
    TP. A converted checkpoint loaded at another TP than it was padded for fails at load with a
    shape mismatch; the fix is the divisor that pads to the checkpoint's rows."""
    flag = "--pretrained-checkpoint" if getattr(ns, "pretrained_checkpoint", None) else "--load"
    path = getattr(ns, "pretrained_checkpoint", None) or (ns.load if getattr(ns, "finetune", False) else None)
    if not path or not Path(path).is_dir():
        return  # not given, or it lives where the job runs
    from ..convert import checkpoint
    folder = checkpoint.iteration_dir(Path(path))
    if checkpoint.kind(folder) != "torch_dist":
        return
    try:
        from ..convert.checkpoint import padded_vocab_of
        rows = padded_vocab_of(folder)
    except ImportError:
        return
    vocab = getattr(ns, "vocab_size", None)
    tok = getattr(ns, "tokenizer_model", None)
    if vocab is None and tok and (Path(tok) / "tokenizer.json").is_file():
        try:
            from tokenizers import Tokenizer
            vocab = Tokenizer.from_file(str(Path(tok) / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        except Exception:  # noqa: BLE001 -- an unreadable tokenizer is Megatron's to report
            return
    if rows is None or vocab is None:
        return
    padded = padded_vocab_size(vocab, tp, getattr(ns, "make_vocab_size_divisible_by", None) or 128)
    result["pretrained"] = {"path": path, "embedding_rows": rows, "padded_vocab": padded}
    if padded != rows:
        fix = (f"add --make-vocab-size-divisible-by {rows // tp} (pads {vocab} tokens to the checkpoint's {rows} "
               f"rows at TP {tp})" if rows % tp == 0 and rows >= vocab else
               f"the checkpoint's {rows} rows do not split over TP {tp}: convert it again for this vocabulary")
        findings.append(_finding("pretrained_vocab_rows", f"the checkpoint at {path} holds {rows} embedding rows; "
                                 f"this script pads its {vocab}-token vocabulary to {padded} at TP {tp}, so the load "
                                 "fails with a shape mismatch", fix, launch.where(flag)))


def _memory(launch: Launch, ns: argparse.Namespace, model: ModelConfig, lay: Layout, gpu: Any,
            findings: list[dict], assumed: dict[str, str]) -> dict[str, Any]:
    """The planner's memory for this layout and attention path, whatever else was found."""
    opts = described.memory_options(ns, lay, assumed)
    try:
        mem = memory_report(model, lay, padded_vocab_size(model.vocab_size, lay.tp), opts)
    except (ZeroDivisionError, ValueError) as e:   # a layout broken past costing (see its error)
        broken = list(dict.fromkeys(f["code"] for f in findings if f["severity"] == "error"))
        return {"skipped": f"not costed: the layout breaks {', '.join(broken)} (the errors above); its memory is "
                           "predicted once they are fixed" if broken else f"the layout cannot be costed: {e}"}
    attention = "unfused" if opts.score_bytes else ("sdpa" if opts.fused_head else "flash")
    peak = memory_peak(mem) / GIB
    out = {"peak_gib": round(peak, 2), "attention": attention,
           "stages": {name: round(m.total / GIB, 2) for name, m in mem.items()}}
    if attention == "unfused":
        scores = lay.mbs * model.num_attention_heads / lay.tp * lay.seq_length ** 2 * 2 / GIB
        findings.append(_finding(
            "unfused_attention", "Megatron's entry on --transformer-impl local runs the unfused DotProductAttention: "
            f"it writes the whole S x S score matrix of each layer ({scores:.1f} GiB in bf16 at this micro-batch) "
            "and passes over it several times, forward and backward; on one H100 a stock 1B run took 13.7k "
            "tokens/s where the skill's entry took 50.9k (references/troubleshooting.md, 'Slower than expected')",
            "Transformer Engine's layers (--transformer-impl transformer_engine, flash attention), or the skill's "
            "entry script (tools/pretrain_gpt.py: torch SDPA) with --no-create-attention-mask-in-dataloader",
            launch.where("--transformer-impl"), severity="warning"))
    if gpu is None:
        out["fit"] = "not checked: name the GPU (gpu) to compare with its memory"
    elif peak > gpu.memory_gib:
        out["fit"] = f"exceeds {gpu.key}'s {gpu.memory_gib} GiB"
        fix = "add recompute, lower --micro-batch-size, or raise TP/PP; 'launch.py plan' lists layouts that fit"
        if attention == "unfused":
            fix = ("use attention that keeps no S x S scores: Transformer Engine's layers "
                   "(--transformer-impl transformer_engine) or the skill's entry (SDPA); or " + fix)
        findings.append(_finding("out_of_memory", f"predicted {peak:.1f} GiB per GPU on {gpu.key} "
                                 f"({gpu.memory_gib} GiB) with {attention} attention", fix))
    else:
        out["fit"] = f"fits {gpu.key}'s {gpu.memory_gib} GiB"
        if peak > NEAR_CAPACITY * gpu.memory_gib:
            fix = ("leave headroom: a smaller --micro-batch-size, selective recompute, or more TP/PP; "
                   "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation")
            if attention == "unfused":
                fix = ("attention that keeps no S x S scores (Transformer Engine's layers, or the skill's entry "
                       "with SDPA) frees the most; or " + fix)
            findings.append(_finding("memory_near_capacity", f"predicted {peak:.1f} of {gpu.key}'s "
                                     f"{gpu.memory_gib} GiB per GPU ({peak / gpu.memory_gib:.0%}) with {attention} "
                                     "attention: the allocator's cache, fragmentation and NCCL's buffers can tip "
                                     "it over", fix, severity="warning"))
    return out


def _megatron_checks(launch: Launch, clean: list[str], findings: list[dict], checks: dict[str, str],
                     have_megatron: bool) -> None:
    """Megatron's own parser and validate_args, where megatron-core imports: what they refuse is
    an error, what they warn of a warning. Where they cannot run, the answer says so."""
    if not have_megatron:
        checks["megatron"] = "skipped: megatron-core is not importable here (the planning-only install)"
        findings.append(_finding(
            "megatron_checks_skipped", "Megatron's own parser and validate_args did not run (megatron-core is not "
            "installed here): only the flag manifest and the skill's copies of Megatron's rules were checked",
            "run validate where megatron-core 0.19 is installed (tools/setup.sh) for Megatron's full checks",
            severity="warning"))
        return
    blocking = sorted({f["code"] for f in findings if f["severity"] == "error"} - set(REPAIRS) - NOT_MEGATRONS)
    if blocking:
        checks["megatron"] = (f"skipped: Megatron would stop at {', '.join(blocking)} before its other checks "
                              "(they run once those are fixed)")
        return
    argv, env, repaired = _repaired_copy(launch, clean, findings)
    # An entry other than a training one passes validate_args defaults of its own (inference
    # servers set the micro-batch, for one): there only Megatron's parser speaks for it.
    world = launch.world if launch.kind != "other" else None
    on = f" on a copy with {', '.join(repaired)} repaired" if repaired else ""
    try:
        said = megatron_parser.check(argv, world_size=world, env=env)
    except ToolError as e:
        findings.append(_refusal_finding(e, f" (checked{on})" if on else ""))
        checks["megatron"] = ("Megatron's parser and validate_args refused the arguments" if world else
                              "Megatron's parser refused the arguments") + on
        _megatron_warnings(getattr(e, "warnings", []), findings)
        _refusals_after(e, argv, world, env, findings)
        return
    checks["megatron"] = (f"Megatron's parser and validate_args ran at world size {world}" if world else
                          f"Megatron's parser ran; validate_args skipped: {launch.entry} sets defaults of its own"
                          if launch.kind == "other" else
                          "Megatron's parser ran; validate_args skipped: the GPU count is not known (pass num_gpus)") + on
    _megatron_warnings(said, findings)


def _refusal_finding(e: ToolError, note: str) -> dict:
    """Megatron's refusal as an error, its fix naming the flags of the arguments its check reads."""
    named = megatron_flags.flags_named(e.message)
    fix = (f"set or change {' / '.join(named)} (the check reads them)" if named and (e.fix or "").startswith("fix the")
           else e.fix or "fix the combination Megatron names")
    return _finding("megatron_validate_args", e.message + note, fix)


MORE_REFUSALS = 4   # Megatron's checks run again on a copy without a refused flag, this many times at most
# sizes Megatron requires (its required_args) or every layout reads: never left out of the copy
REQUIRED_FLAGS = {"--num-layers", "--hidden-size", "--num-attention-heads", "--max-position-embeddings",
                  "--seq-length", "--micro-batch-size", "--global-batch-size", "--ffn-hidden-size",
                  "--encoder-num-layers"}


def _refusals_after(e: ToolError, argv: list[str], world: int | None, env: dict, findings: list[dict]) -> None:
    """Megatron stops at its first failed check: where that check names a flag the copy gives,
    the copy without it is checked again, so that the checks after it speak in the same pass
    (an assert on --min-lr against --lr, then a --save without --save-interval)."""
    left_out: list[str] = []
    for _ in range(MORE_REFUSALS):
        given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}   # --flag value and --flag=value alike
        flag = next((f for f in megatron_flags.flags_named(e.message) if f in given and f not in REQUIRED_FLAGS), None)
        if flag is None:
            return
        argv = _without(argv, {flag})
        left_out.append(flag)
        try:
            megatron_parser.check(argv, world_size=world, env=env)
            return
        except ToolError as again:
            e = again
            if any(f[2:].replace("-", "_") in e.message for f in left_out):
                return   # a refusal of the copy's own making (the flag left out was needed): not the launch's
            findings.append(_refusal_finding(e, f" (found with {', '.join(left_out)} left out of the copy)"))


# How validate repairs an error on the copy of the arguments that Megatron's own checks read, so
# that they run in the same pass: the flags to leave out. Obsolete flags get their replacement.
REPAIRS = {**{c.code: (c.flag,) for c in megatron_flags.COMBINATIONS},
           "vp_layers": ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
           "vp_needs_pp": ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank"),
           "obsolete_flag": (), "cuda_device_max_connections": ()}
# Errors Megatron's parser and validate_args do not see (memory, the GPU, what runs, what loads),
# or whose words never reach them (unknown flags and unreadable values are left out of what they
# read). Stray words are not among them: they may be a split value, whose verdict is fixed_args'.
NOT_MEGATRONS = {"out_of_memory", "fp8_arch", "cp_needs_te", "qk_norm_sp_needs_te", "moe_flex_needs_te",
                 "tp_within_nvlink", "pretrained_vocab_rows", "unknown_flag", "bad_value", "model_out_of_range",
                 "bad_model", "layout_out_of_range", "crlf_line_endings"}


def _repaired_copy(launch: Launch, clean: list[str], findings: list[dict]) -> tuple[list[str], dict, list[str]]:
    """The arguments and environment Megatron's own checks read, with each error that has a
    repair repaired, and the codes repaired."""
    codes = [c for c in dict.fromkeys(f["code"] for f in findings if f["severity"] == "error") if c in REPAIRS]
    drop = {flag for c in codes for flag in REPAIRS[c]}
    argv = megatron_flags.rewrite_obsolete(_without(clean, drop))[0] if codes else clean
    # what the launch's environment says (None: unset, as a script may leave it for FSDP)
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1" if "cuda_device_max_connections" in codes
           else launch.env.get("CUDA_DEVICE_MAX_CONNECTIONS")}
    return argv, env, codes


def _megatron_warnings(said: list[str], findings: list[dict]) -> None:
    """What Megatron warned of, each once, under the code of the rule the skill knows it as."""
    have = {f["code"] for f in findings} | {f["message"] for f in findings}
    for text in said:
        code = next((c for pattern, c in MEGATRON_WARNING_CODES if pattern in text), "megatron_warning")
        message = f"Megatron warns: {text}"
        if code not in have and message not in have:
            findings.append(_finding(code, message, "none needed to run: Megatron proceeds as it says; change the "
                                     "flags to silence it", severity="warning"))
            have.add(code if code != "megatron_warning" else message)


def _close(result: dict[str, Any], findings: list[dict], launch: Launch, gpu_name: str | None,
           recheck_fix: bool) -> dict[str, Any]:
    """The findings, and where any has an exact fix, the fixed vector checked again."""
    result["findings"] = findings
    if recheck_fix and any(f["code"] in ("obsolete_flag", "unknown_flag", "stray_arguments") for f in findings):
        fixed = fixed_vector(launch.args)
        if fixed != launch.args:
            again = check_launch(dataclasses.replace(launch, args=fixed, lines=None), gpu_name, recheck_fix=False)
            errors = [f for f in again["findings"] if f["severity"] == "error"]
            result["fixed_args"] = {"args": fixed, "valid": not errors,
                                    "remaining_errors": [f"{f['code']}: {f['message']}" for f in errors]}
    return result


# A predicted peak above this share of the GPU's memory is a warning (the prediction's own
# allowance for the CUDA context and NCCL is inside the peak; the allocator's cache is not).
NEAR_CAPACITY = 0.9


# ---- reading what was given ----------------------------------------------------------
MAX_SCRIPT_BYTES = 1 << 20  # launch scripts are kilobytes; more is not a launch script
MAX_ARGS = 4096  # Megatron's parser (argparse) slows down with the square of the argument count


def read_script(path: Path) -> str:
    """A launch script's text: a regular file of at most MAX_SCRIPT_BYTES, without NUL bytes
    (a binary file is not a script). Read, never run."""
    fix = "give the path of a launch script (bash, as text)"
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise ToolError("bad_request", f"{path} is not a regular file", where="/script", fix=fix)
        if info.st_size > MAX_SCRIPT_BYTES:
            raise ToolError("bad_request", f"{path} is {info.st_size:,} bytes, more than a launch script "
                            f"({MAX_SCRIPT_BYTES:,} at most)", where="/script", fix=fix)
        with open(path, "rb") as f:
            data = f.read(MAX_SCRIPT_BYTES + 1)
    except OSError as e:
        raise ToolError("not_found", f"cannot read {path}: {e.strerror}", where="/script", fix=fix) from None
    if b"\0" in data:
        raise ToolError("bad_request", f"{path} holds NUL bytes: a binary file, not a script", where="/script",
                        fix=fix)
    return data.decode("utf-8", errors="replace")


def split_arg_strings(args: list[str]) -> list[str]:
    """An argument vector, where an item holding several shell words (--args "--fp8-hybrid --bf16")
    is split as the shell would split it."""
    out: list[str] = []
    for item in args:
        if item.startswith("-") and any(c.isspace() for c in item):
            try:
                out += shlex.split(item)
                continue
            except ValueError:
                pass
        out.append(item)
    return out


def flag_fragment(text: str) -> list[str] | None:
    """The flags of a text that holds nothing but flags and their values (comments, blank lines
    and line continuations aside), as conf snippets and notes do; None for anything else."""
    lines = [ln.split(" #")[0].strip() for ln in text.replace("\\\n", " ").splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith("#")]
    if not lines or not all(ln.startswith("--") for ln in lines):
        return None
    try:
        return shlex.split(" ".join(lines))
    except ValueError:
        return None


def script_launches(text: str, script_path: Path | None, env: dict[str, str], num_gpus: int | None,
                    positional: list[str] | None = None) -> tuple[list[Launch], dict[str, Any]]:
    """The Megatron launches of a script, one per way through it that starts one (identical
    ones once), and what the reader could not follow."""
    known = megatron_flags.known_flags()
    reading = script_args.read(text, script_path, env, known, positional)
    about: dict[str, Any] = {"paths": reading.paths}
    if reading.notes:
        about["notes"] = reading.notes
    if reading.ended:
        about["paths_without_launch"] = reading.ended
    if not reading.launches:
        if reading.flag_variables:   # a configuration file: the flags it defines, for a launch elsewhere
            names = list(reading.flag_variables)
            note = _finding("no_launch", "the script starts no Megatron launch; the flags it defines in "
                            f"{', '.join(names)} were checked as they stand", "validate the script that launches "
                            "with them for the world size and memory checks", severity="warning")
            args = [w for name in names for w in reading.flag_variables[name]]
            return [Launch(args=args, world=num_gpus, env=env, script_text=text, notes=[note],
                           info={"fragment": True, "variables": names})], about
        raise ToolError("invalid_script", "no Megatron launch found: no way through the script starts a Python "
                        "entry" + (f" ({'; '.join(reading.ended[:3])})" if reading.ended else ""), where="script",
                        fix="give the script that runs pretrain_gpt.py (or the skill's tools/pretrain_gpt.py); a "
                            "script that needs arguments of its own gets them through script_args")
    megatron = [ex for ex in reading.launches if any(a.split("=", 1)[0] in known for a in ex.args)]
    if not megatron:
        entries = sorted({str(ex.entry) for ex in reading.launches})
        unresolved = sorted({v for ex in reading.launches for v in ex.unresolved
                             if any(f"${v}" in a or f"${{{v}}}" in a for a in ex.args)})
        if unresolved:
            raise ToolError("invalid_script", f"the script runs {', '.join(entries)} with arguments from "
                            f"{', '.join('$' + v for v in unresolved)}, which it does not set (its caller does)",
                            where="script", fix=f"give {', '.join(unresolved)} in env, or validate the script that "
                                                "sets them")
        raise ToolError("invalid_script", f"the script runs {', '.join(entries)}, which receives no Megatron flags: "
                        "it is not a launch of Megatron's training entry (pretrain_gpt.py and the like), so there is "
                        "no argument vector to check", where="script",
                        fix="validate checks launches of Megatron's training entries; give such a script, or the "
                            "argument vector itself (args)")
    launches, seen = [], set()
    for ex in megatron:
        world = num_gpus or ex.world
        key = (tuple(ex.args), world, ex.env.get("CUDA_DEVICE_MAX_CONNECTIONS"))
        if key in seen:
            continue
        seen.add(key)
        launches.append(Launch(args=ex.args, world=world, env={**ex.env, **env}, lines=ex.lines, entry=ex.entry,
                               path="; ".join(ex.choices) or None, script_text=text, info=script_args.summary(ex),
                               notes=_line_ending_findings(text) + _placeholder_findings(reading.placeholders)))
    return launches, about


def _placeholder_findings(placeholders: list[str]) -> list[dict]:
    if not placeholders:
        return []
    shown = ", ".join(placeholders[:4]) + (" ..." if len(placeholders) > 4 else "")
    return [_finding("unfilled_placeholder", f"the script holds a template's placeholders ({shown}): bash reads "
                     "< and > as redirections and cannot run it as it stands (the other findings read them as "
                     "quoted values)", "replace each placeholder with its real value")]


def _line_ending_findings(text: str) -> list[dict]:
    """Windows line endings: the reader takes CR LF as a line's end, bash does not. It keeps each
    CR as the last character of the line's last word: `set -o pipefail<CR>` is an invalid option,
    a flag's value ends in a CR, a backslash before CR LF continues nothing."""
    if "\r\n" not in text:
        return []
    first = text[:text.index("\r\n")].count("\n") + 1
    return [_finding("crlf_line_endings", f"the script has Windows line endings (CR LF, from line {first}): bash "
                     "keeps each CR as part of the line's last word, so options, flag values and line "
                     "continuations break (the findings below read it as if the CRs were gone)",
                     "convert the script to Unix line endings: dos2unix script.sh, or sed -i 's/\\r$//' script.sh",
                     where=f"line {first}")]


def _combine(checked: list[tuple[Launch, dict[str, Any]]]) -> list[dict]:
    """Findings of every launch; one that holds on only some ways through the script lists them."""
    if len(checked) == 1:
        return checked[0][1]["findings"]
    order: list[tuple] = []
    by_key: dict[tuple, tuple[dict, list[str]]] = {}
    for launch, res in checked:
        for f in res["findings"]:
            key = (f["code"], f["severity"], f["message"])
            if key not in by_key:
                by_key[key] = (f, [])
                order.append(key)
            by_key[key][1].append(launch.path or "the way with no undecided condition")
    out = []
    for key in order:
        f, paths = by_key[key]
        out.append(f if len(paths) == len(checked) else {**f, "paths": paths})
    return out


def run(req: dict, ctx: Context) -> dict[str, Any]:
    sources = [k for k in ("script", "script_text", "args", "render_request") if req.get(k) is not None]
    if len(sources) != 1:
        raise ToolError("bad_request", "give exactly one of script, script_text, args or render_request", where="/",
                        fix="validate --script launch.sh")
    if req.get("render_request") is not None:
        return _validate_request(req["render_request"], ctx)
    launches, about, skill_home = _launches(req, ctx)
    for launch in launches:
        if len(launch.args) > MAX_ARGS:
            raise ToolError("bad_request", f"{len(launch.args):,} arguments reach Megatron; a launch passes a few "
                            f"hundred (at most {MAX_ARGS:,} are checked)",
                            where="/args" if req.get("args") else "/script",
                            fix="give the launch script itself, not a generated or repeated one")
    # the fixed vector is checked again for the first launch, the one the answer reports it for
    checked = [(launch, check_launch(launch, req.get("gpu"), recheck_fix=i == 0)) for i, launch in enumerate(launches)]
    findings = _combine(checked)
    errors = [f for f in findings if f["severity"] == "error"]
    warnings = [f for f in findings if f["severity"] == "warning"]
    ctx.progress(f"validate: {len(errors)} error(s), {len(warnings)} warning(s) over {len(launches)} launch(es)")
    first_launch, first = checked[0]
    out = {"valid": not errors, "errors": errors, "warnings": warnings, "world_size": first_launch.world,
           "layout": first["layout"], "predicted_peak_gib": first["predicted_peak_gib"],
           "memory": first.get("memory"), "checks": first["checks"], "assumed": {**first["assumed"], **skill_home},
           "script": {**first_launch.info, **about}, "num_megatron_args": len(first_launch.args)}
    out.update({k: first[k] for k in ("fixed_args", "pretrained", "vocabulary") if k in first})
    if len(checked) > 1:
        out["launches"] = [{"path": la.path, "entry": la.entry, "world_size": la.world,
                            "num_megatron_args": len(la.args), "layout": res["layout"],
                            "predicted_peak_gib": res["predicted_peak_gib"],
                            "valid": not any(f["severity"] == "error" for f in res["findings"])}
                           for la, res in checked]
    return out


def _launches(req: dict, ctx: Context) -> tuple[list[Launch], dict[str, Any], dict[str, str]]:
    """The Megatron launches the request holds (an argument vector, a fragment of flags, or what a
    script or a PyTorchJob's step runs); what was read to find them; and what was assumed of the
    skill's own folder."""
    env = dict(req.get("env") or {})
    script_path = Path(req["script"]) if req.get("script") else None
    text = read_script(script_path) if script_path else (req.get("script_text") or "")
    about: dict[str, Any] = {}
    num_gpus = req.get("num_gpus")
    if req.get("args") is None and manifest.is_manifest(text):
        # A Kubernetes PyTorchJob: its pods' job step, with the pods' environment and the job's GPUs.
        step = manifest.job_step(text)
        text, env, script_path = step["script"], {**step["env"], **env}, None
        num_gpus = num_gpus or step["num_gpus"]
        about["manifest"] = {"kind": "PyTorchJob", "name": step["name"], "role": step["role"],
                             "replicas": step["replicas"]}
    fragment = flag_fragment(text) if req.get("args") is None else None
    skill_home = {}
    if "MEGATRON_SKILL_HOME" in text and "MEGATRON_SKILL_HOME" not in env:
        # A script of this skill's reads its folder from the job's environment: read as here.
        env["MEGATRON_SKILL_HOME"] = str(ROOT)
        skill_home = {"MEGATRON_SKILL_HOME": "this skill's folder (the job gives its own where it runs)"}
    if req.get("args") is not None:
        launches = [Launch(args=split_arg_strings(req["args"]), world=num_gpus, env=env)]
    elif fragment is not None:  # a file or text of flags only (a conf snippet): the flags themselves
        launches = [Launch(args=fragment, world=num_gpus, env=env, info={"fragment": True})]
    else:
        ctx.progress("validate: reading the script (as bash would, without running it)")
        launches, read = script_launches(text, script_path, env, num_gpus, req.get("script_args"))
        about.update(read)
    return launches, about, skill_home


def _validate_request(sub: dict, ctx: Context) -> dict[str, Any]:
    """A render request: rendered through the contract as a dry run (nothing written), so every
    error render would raise is found, then its argument vector checked like any other. A render
    request that does not match render's schema (a count given as text) is this request's error,
    not a finding about a script: bad_request, where in render_request."""
    try:
        validate_request("render", {**sub, "dry_run": True})
    except ToolError as e:
        raise ToolError(e.code, f"render_request: {e.message}", where="/render_request" + (
            e.where if e.where and e.where.startswith("/") and e.where != "/" else ""), fix=e.fix,
            details=e.details) from None
    try:
        built = invoke("render", {**sub, "dry_run": True}, ctx)
    except ToolError as e:
        where = "/render_request" + (e.where if e.where and e.where.startswith("/") else "")
        err = _finding(e.code, e.message, e.fix or "", where)
        return {"valid": False, "errors": [err], "warnings": [], "world_size": None, "layout": None,
                "predicted_peak_gib": None, "script": {}, "num_megatron_args": 0}
    lay = built["layout"]
    launch = Launch(args=built["megatron_args"], world=lay["world_size"], env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    result = check_launch(launch, sub.get("gpu"))
    errors = [f for f in result["findings"] if f["severity"] == "error"]
    return {"valid": not errors, "errors": errors,
            "warnings": [f for f in result["findings"] if f["severity"] == "warning"],
            "world_size": lay["world_size"], "layout": lay, "predicted_peak_gib": result.get("predicted_peak_gib"),
            "memory": result.get("memory"), "checks": result["checks"], "assumed": result["assumed"],
            "script": {}, "num_megatron_args": len(built["megatron_args"]),
            **({"vocabulary": result["vocabulary"]} if "vocabulary" in result else {})}


TOOL = Tool(name="validate", summary="Check a launch script or argument vector: unknown / obsolete flags, "
                     "Megatron's rules, memory fit; every error names its fix.", run=run)
