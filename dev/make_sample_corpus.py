#!/usr/bin/env python3
"""Write data/sample/corpus.jsonl: a small corpus of real English text made in this repo.

The documents are the prose paragraphs of the skill's own Markdown (README, SKILL.md,
instructions.md, references/) and the docstrings of its Python modules: no download, no
third-party text.  Code blocks and tables are left out.  The demo and the tests tokenize it with prepare-data and train on it.
    python dev/make_sample_corpus.py [OUT.jsonl]
"""
import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["README.md", "SKILL.md", "instructions.md",
           *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "references").glob("*.md"))]


def paragraphs(text: str):
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for block in re.split(r"\n\s*\n", text):
        lines = [ln.strip() for ln in block.strip().splitlines()]
        if not lines or lines[0].startswith(("|", "#", "---")) or any(ln.startswith("|") for ln in lines):
            continue
        para = " ".join(lines)
        if len(para) >= 60:
            yield para


def docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)):
            doc = ast.get_docstring(node)
            if doc:
                yield from paragraphs(doc)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "data" / "sample" / "corpus.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with open(out, "w") as f:
        for src in SOURCES:
            for para in paragraphs((ROOT / src).read_text()):
                f.write(json.dumps({"text": para, "source": src}) + "\n")
                n += 1
        for py in sorted((ROOT / "tools" / "megatron_skill").rglob("*.py")):
            for para in docstrings(py):
                f.write(json.dumps({"text": para, "source": str(py.relative_to(ROOT))}) + "\n")
                n += 1
    print(f"wrote {out}: {n} documents", file=sys.stderr)


if __name__ == "__main__":
    main()
