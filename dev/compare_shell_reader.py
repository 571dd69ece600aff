#!/usr/bin/env python3
"""Compare the script reader (adapter/shell.py) before and after a change, on a corpus of scripts.

    .venv/bin/python dev/compare_shell_reader.py collect CORPUS --megatron-examples DIR [--tests T ...]
    .venv/bin/python dev/compare_shell_reader.py dump CORPUS OUT.json [--reader OLD_SHELL.py]
    .venv/bin/python dev/compare_shell_reader.py compare BEFORE.json AFTER.json

collect gathers the corpus into the folder CORPUS, one case a folder (meta.json: the text, the
script's name, env and positional arguments the reader was given; files/: the script's folder,
so that what it sources is read again): every *.sh under tests/fixtures, the *.sh of a Megatron-LM
examples folder (git archive of a tag), scripts render writes, and every script the named test files
hand to the reader while they run (this file is loaded into pytest as a plugin that records each
call of shell.read). dump reads each case with the reader as the tree has it now and writes, per
case, every path: its launches (entry, args, launcher, env, where, lines, sbatch), choices, end,
unresolved names, the first path's variables, and the notes, or the syntax error. compare prints
the cases whose dumps differ (one JSON object: counts and the first differences of each case).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

MAX_COPY_FILES = 300
MAX_COPY_BYTES = 4 << 20


def _case_key(text: str, env, positional, files: dict[str, bytes]) -> str:
    h = hashlib.sha256(text.encode("utf-8", "replace"))
    h.update(json.dumps([env, positional], sort_keys=True, default=str).encode())
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name])
    return h.hexdigest()[:16]


def _folder_files(folder: Path | None) -> dict[str, bytes]:
    """The small files of a script's folder (and below), as the reader may source them."""
    out: dict[str, bytes] = {}
    if folder is None or not folder.is_dir():
        return out
    total = 0
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        for name in names:
            path = Path(root) / name
            try:
                if not path.is_file() or path.is_symlink() or path.stat().st_size > (1 << 20):
                    continue
                data = path.read_bytes()
            except OSError:
                continue
            total += len(data)
            if len(out) >= MAX_COPY_FILES or total > MAX_COPY_BYTES:
                return out
            out[str(path.relative_to(folder))] = data
    return out


def save_case(corpus: Path, origin: str, text: str, script_path: Path | None, env, positional) -> None:
    files = _folder_files(script_path.parent if script_path else None)
    key = _case_key(text, env, positional, files)
    case = corpus / key
    if case.exists():
        return
    (case / "files").mkdir(parents=True)
    for name, data in files.items():
        (case / "files" / name).parent.mkdir(parents=True, exist_ok=True)
        (case / "files" / name).write_bytes(data)
    meta = {"origin": origin, "text": text, "script": script_path.name if script_path else None,
            "env": dict(env) if env else None, "positional": list(positional) if positional is not None else None}
    (case / "meta.json").write_text(json.dumps(meta))


# ---------------------------------------------------------------- pytest plugin: record the reader's inputs

def pytest_configure(config):  # loaded with -p compare_shell_reader while collect runs the tests
    corpus = os.environ.get("COMPARE_SHELL_CORPUS")
    if not corpus:
        return
    from megatron_skill.adapter import shell

    original = shell.read

    def recording(text, script_path=None, env=None, positional=None):
        try:
            save_case(Path(corpus), "test:" + os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0], text,
                      Path(script_path) if script_path else None, env, positional)
        except OSError:
            pass
        return original(text, script_path, env, positional)

    shell.read = recording


# ---------------------------------------------------------------- collect

def collect(corpus: Path, examples: Path | None, tests: list[str]) -> dict:
    corpus.mkdir(parents=True, exist_ok=True)
    for path in sorted((ROOT / "tests" / "fixtures").rglob("*.sh")):
        save_case(corpus, "fixture:" + str(path.relative_to(ROOT)), path.read_text(errors="replace"), path, None, None)
    if examples is not None:
        for path in sorted(examples.rglob("*.sh")):
            save_case(corpus, "megatron:" + str(path.relative_to(examples)), path.read_text(errors="replace"),
                      path, None, None)
    from megatron_skill.contract import call
    with tempfile.TemporaryDirectory() as tmp:
        requests = [dict(model="llama3-8b", num_gpus=8, seq_length=8192, global_batch_size=128),
                    dict(model="mixtral-8x7b", num_gpus=64, seq_length=4096, launcher="slurm"),
                    dict(model="deepseek-v3", num_gpus=1024, seq_length=4096, launcher="torchrun-multinode"),
                    dict(model="llama3-70b", num_gpus=64, seq_length=4096, launcher="slurm", fp8=True),
                    dict(model="qwen3-30b-a3b", num_gpus=16, seq_length=4096, launcher="torchrun-multinode")]
        for k, req in enumerate(requests):
            env = call("render", {**req, "output_dir": f"{tmp}/r{k}"})
            for f in (env.get("result") or {}).get("files", []):
                path = Path(f["path"])
                if path.suffix in (".sh", ".sbatch", ".slurm") or path.read_text(errors="replace").startswith("#!"):
                    save_case(corpus, f"render:{req['model']}:{req.get('launcher', 'torchrun')}:{path.name}",
                              path.read_text(errors="replace"), path, None, None)
    if tests:
        env = dict(os.environ, COMPARE_SHELL_CORPUS=str(corpus.resolve()),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "dev"), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "compare_shell_reader", "-p",
                               "no:cacheprovider", *tests], cwd=ROOT, env=env, capture_output=True, text=True)
        tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    else:
        proc, tail = None, []
    return {"corpus": str(corpus), "cases": sum(1 for _ in corpus.iterdir()),
            "tests_rc": None if proc is None else proc.returncode, "tests": tail}


# ---------------------------------------------------------------- dump and compare

def _value(v):
    return list(v) if isinstance(v, tuple) else (v if isinstance(v, str) else repr(v))


def _reader_module(path: Path | None):
    """adapter/shell.py as the tree has it, or another version of that file (git show REV:path > f)."""
    from megatron_skill.adapter import shell
    if path is None:
        return shell
    import importlib.util
    spec = importlib.util.spec_from_file_location("megatron_skill.adapter._shell_compared", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def dump(corpus: Path, reader: Path | None = None) -> dict:
    shell = _reader_module(reader)
    out = {}
    for case in sorted(corpus.iterdir()):
        meta = json.loads((case / "meta.json").read_text())
        script = case / "files" / meta["script"] if meta["script"] else None
        positional = tuple(meta["positional"]) if meta["positional"] is not None else None
        try:
            reading = shell.read(meta["text"], script, meta["env"], positional)
        except shell.ShellSyntax as e:
            out[case.name] = {"origin": meta["origin"], "error": str(e), "line": e.line}
            continue
        paths = []
        for p in reading.paths:
            paths.append({
                "choices": p.choices, "ended": p.ended, "unresolved": p.unresolved,
                "launches": [{"entry": la.entry, "args": la.args, "launcher": la.launcher, "env": la.env,
                              "where": la.where, "lines": la.lines, "sbatch": la.sbatch} for la in p.launches]})
        first_vars = {k: _value(v) for k, v in sorted(reading.paths[0].vars.items())} if reading.paths else {}
        first_vars = {k: v for k, v in first_vars.items() if not (meta["env"] and k in meta["env"]) and k != "0"}
        out[case.name] = {"origin": meta["origin"], "notes": [n.replace(str(case), "CASE") for n in reading.notes],
                          "paths": paths, "vars": first_vars}
    return json.loads(json.dumps(out).replace(str(corpus.resolve()), "CORPUS").replace(str(corpus), "CORPUS"))


def _diff(a, b, where: str, out: list[str], limit: int = 6) -> None:
    if len(out) >= limit or a == b:
        return
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            _diff(a.get(k), b.get(k), f"{where}.{k}", out, limit)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out, limit)
    else:
        out.append(f"{where}: {json.dumps(a)[:300]} -> {json.dumps(b)[:300]}")


def compare(before: dict, after: dict) -> dict:
    differ = {}
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            lines: list[str] = []
            _diff(before.get(key), after.get(key), "", lines)
            differ[key] = {"origin": (before.get(key) or after.get(key))["origin"], "diff": lines}
    return {"cases": len(set(before) | set(after)), "identical": len(set(before) | set(after)) - len(differ),
            "differ": differ}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("corpus", type=Path)
    c.add_argument("--megatron-examples", type=Path)
    c.add_argument("--tests", nargs="*", default=[])
    d = sub.add_parser("dump")
    d.add_argument("corpus", type=Path)
    d.add_argument("out", type=Path)
    d.add_argument("--reader", type=Path, help="another version of adapter/shell.py to read with")
    m = sub.add_parser("compare")
    m.add_argument("before", type=Path)
    m.add_argument("after", type=Path)
    a = ap.parse_args()
    if a.cmd == "collect":
        result = collect(a.corpus, a.megatron_examples, a.tests)
    elif a.cmd == "dump":
        data = dump(a.corpus, a.reader)
        a.out.write_text(json.dumps(data, indent=1, sort_keys=True))
        result = {"cases": len(data), "errors": sum(1 for v in data.values() if "error" in v), "out": str(a.out)}
    else:
        result = compare(json.loads(a.before.read_text()), json.loads(a.after.read_text()))
    print(json.dumps(result, indent=1))
    return 0 if a.cmd != "compare" or not result["differ"] else 1


if __name__ == "__main__":
    sys.exit(main())
