"""The tool contract, written once: schemas, request ids, JSON in and out, exit codes.

Every tool is registered with a function ``run(request, ctx) -> result``.  This module
validates the request against ``schemas/<tool>.request.json`` (and fills its defaults)
before the function sees it, derives the request id, wraps the result or the error in
the response envelope, and builds the command line from the same schema, so the flags,
``--help`` and the JSON form can never drift apart.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import sys
import textwrap
import traceback
from typing import Any, Callable

from . import files
from .errors import ToolError
from .package_data import data_root, schema_dir

# The folder holding schemas/ and templates/: the repository in a checkout, the package installed.
ROOT = data_root()
SCHEMA_DIR = schema_dir()
# Keys that change how a request is carried out or shown, not what it asks for.
NON_SEMANTIC = {"dry_run", "resume", "workers"}  # workers: how fast, not what


# Control characters a request's text may carry (an escape sequence in a path or a model name)
# are shown escaped on the terminal: a progress line or summary never moves the cursor, recolours
# or retitles the terminal it is read on.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0b, 0x20), 0x7f)}
_CONTROL.update({c: f"\\x{c:02x}" for c in range(0x80, 0xa0)})


def shown_on_terminal(text: str) -> str:
    """text with its control characters (other than tab and newline) escaped as \\xNN."""
    return text.translate(_CONTROL)


def _to_stderr(message: str) -> None:
    print(shown_on_terminal(message), file=sys.stderr, flush=True)


@dataclasses.dataclass
class Context:
    """How a request is carried out: dry run or not, where progress goes, and the id of the
    request being served (set by call; a tool that calls another passes its own context on)."""
    dry_run: bool = False
    progress: Callable[[str], None] = _to_stderr
    request_id: str | None = None


@dataclasses.dataclass
class Tool:
    name: str
    summary: str
    run: Callable[[dict, Context], dict]


def tool_names() -> list[str]:
    """Every tool's name, without importing any tool."""
    from .tools import MODULES

    return list(MODULES)


def get_tool(name: str) -> Tool:
    """One tool by name, its module imported now (the tools package is imported here, when a
    request is made, so that no module imports in a circle)."""
    from .tools import get

    return get(name)


def tools() -> dict[str, Tool]:
    """Every tool by name, each module imported."""
    return {name: get_tool(name) for name in tool_names()}


def load_schema(tool: str, kind: str) -> dict:
    return json.loads((SCHEMA_DIR / f"{tool}.{kind}.json").read_text())


def schema_registry():
    """Every schema in schemas/, by its $id, so that "$ref": "common.json#..." resolves offline."""
    from referencing import Registry, Resource

    resources = []
    for path in sorted(SCHEMA_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        resources.append((doc.get("$id", path.name), Resource.from_contents(doc)))
    return Registry().with_resources(resources)


def request_id(tool: str, request: dict) -> str:
    """A hash of the canonical request: the same request always gets the same id. Canonical: a
    path with a slash in it is absolute and normalised (./x, dir/../x and the absolute path are
    one file; a bare name is left as written), and a Hugging Face config the request names counts
    by its content (an edited config.json is another model, so another request)."""
    canonical = {k: with_absolute_paths(v) for k, v in request.items() if k not in NON_SEMANTIC}
    if isinstance(request.get("hf_config"), str):
        config = request["hf_config"]   # a folder and its config.json are one config (every tool reads it so)
        config = os.path.join(config, "config.json") if os.path.isdir(config) else config
        canonical["hf_config"] = os.path.normpath(os.path.abspath(config))
        canonical["hf_config_sha256"] = _config_digest(config)
    return _hashed(tool, canonical)


def legacy_request_id(tool: str, request: dict) -> str:
    """The id as versions before the canonical paths made it (the request as written): what the
    records those versions left hold."""
    return _hashed(tool, {k: v for k, v in request.items() if k not in NON_SEMANTIC})


def _hashed(tool: str, canonical: dict) -> str:
    blob = json.dumps({"tool": tool, "request": canonical}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def with_absolute_paths(value: Any) -> Any:
    """value with every path in it absolute and normalised; a path is a string of one word with a
    slash in it (not a URL): a script's text, a bare name or a flag is left as it is. A record keeps
    its request so, to give the same id from any working folder."""
    if isinstance(value, dict):
        return {k: with_absolute_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [with_absolute_paths(v) for v in value]
    if isinstance(value, str) and "/" in value and "://" not in value and not any(c.isspace() for c in value):
        return os.path.normpath(os.path.abspath(value))
    return value


def _config_digest(path: str) -> str | None:
    """The SHA-256 of a Hugging Face config.json; None where it cannot be read (the tool's own
    check says why)."""
    from .files import read_regular

    try:
        return hashlib.sha256(read_regular(path, 1 << 20)).hexdigest()
    except (OSError, ToolError):
        return None


def _resolve(prop: dict) -> dict:
    ref = prop.get("$ref", "")
    if ref.startswith("common.json#/$defs/"):
        common = json.loads((SCHEMA_DIR / "common.json").read_text())
        return {**common["$defs"][ref.rsplit("/", 1)[1]], **{k: v for k, v in prop.items() if k != "$ref"}}
    return prop


def _fill_defaults(schema: dict, request: dict) -> dict:
    """Top-level defaults, and the defaults of object-valued fields one level down."""
    out = dict(request)
    for key, prop in schema.get("properties", {}).items():
        prop = _resolve(prop)
        if key not in out and "default" in prop:
            out[key] = prop["default"]
        if isinstance(out.get(key), dict) and prop.get("type") == "object":
            inner = dict(out[key])
            for k, p in prop.get("properties", {}).items():
                if k not in inner and "default" in p:
                    inner[k] = p["default"]
            out[key] = inner
    return out


MAX_DEPTH = 32


def check_values(request: Any) -> None:
    """What JSON Schema cannot say, checked for every value at any depth before the schema
    runs: no NaN or Infinity, no text that is not Unicode (a lone surrogate) or holds a NUL
    byte (no path, argument or variable can), no nesting deeper than MAX_DEPTH."""
    stack: list[tuple[Any, str, int]] = [(request, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ToolError("bad_request", f"the request is nested more than {MAX_DEPTH} levels deep",
                            where=where or "/", fix="no field of any tool nests that deep: check the request")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("bad_request", f"{value} is not a number a request may hold", where=where or "/",
                            fix="give a finite number (JSON has no NaN or Infinity)")
        if isinstance(value, str):
            _check_text(value, where)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise ToolError("bad_request", f"key {key!r} is not a string", where=where or "/",
                                    fix="JSON object keys are strings")
                _check_text(key, where + "/" + key)
                stack.append((item, f"{where}/{key}", depth + 1))
        elif isinstance(value, (list, tuple)):
            stack.extend((item, f"{where}/{i}", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    if "\x00" in text:
        raise ToolError("bad_request", "text holds a NUL character", where=where or "/",
                        fix="remove the \\u0000: no path, argument or variable can hold one")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ToolError("bad_request", f"text holds a lone surrogate (\\u{ord(text[e.start]):04x}), which is "
                        "not Unicode", where=where or "/", fix="send valid UTF-8 text") from None


def validator(schema: dict):
    """Draft 2020-12, except that an integer is an int: 8.0 is refused where a count is asked
    (JSON Schema would accept it, and the tools would then compute with a float)."""
    import jsonschema

    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _, v: isinstance(v, int) and not isinstance(v, bool))
    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)
    return cls(schema, registry=schema_registry())


def validate_request(tool: str, request: Any) -> dict:
    """The request checked against its schema, with defaults filled in; or one ToolError."""
    import jsonschema

    schema = load_schema(tool, "request")
    if not isinstance(request, dict):
        raise ToolError("bad_request", "the request must be a JSON object", where="/",
                        fix=f"see schemas/{tool}.request.json")
    check_values(request)
    checker = validator(schema)
    errors = sorted(checker.iter_errors(request), key=lambda e: (len(list(e.absolute_path)), e.message))
    if errors:
        err = jsonschema.exceptions.best_match(errors) or errors[0]
        where = "/" + "/".join(str(p) for p in err.absolute_path)
        prop = err.schema if isinstance(err.schema, dict) else {}
        hint = prop.get("description", "")
        if err.validator == "additionalProperties":
            known = sorted(prop.get("properties", {})) if prop.get("additionalProperties") is False else []
            hint = f"known fields here: {', '.join(known)}" if known else f"see schemas/{tool}.request.json"
        elif "enum" in prop:
            hint = f"one of {prop['enum']}"
        elif err.validator in ("oneOf", "anyOf") and all("required" in alt for alt in prop[err.validator]):
            # each branch a set of fields to give (on-event: event, event_file, or a policy to save)
            names = [" with ".join(alt["required"]) for alt in prop[err.validator]]
            given = [n for alt in prop[err.validator] for n in alt["required"][:1]
                     if isinstance(err.instance, dict) and n in err.instance]
            message = (f"give one of: {'; '.join(names)}" if not given else
                       f"give only one of: {'; '.join(names)} (given: {', '.join(given)})")
            raise ToolError("bad_request", message, where=where, fix=f"give exactly one of: {'; '.join(names)} "
                            f"(schemas/{tool}.request.json)")
        elif err.validator in ("oneOf", "anyOf") and err.absolute_path:
            hint = "give " + " or ".join(_alternative(alt) for alt in prop[err.validator])
        elif err.validator == "type" and "integer" in str(err.validator_value) and isinstance(err.instance, float):
            hint = "give a whole number without a decimal point"
        elif err.validator == "type":   # in JSON's words, not Python's ("True is not of type 'integer'")
            wanted = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
            shown = json.dumps(err.instance)
            words = " or ".join(JSON_TYPES.get(str(w), str(w)) for w in wanted)
            message = f"{shown if len(shown) <= 60 else shown[:57] + '...'} is {_json_kind(err.instance)}, not {words}"
            raise ToolError("bad_request", message, where=where, fix=f"give {words}" + (f" ({hint})" if hint else ""))
        raise ToolError("bad_request", err.message, where=where,
                        fix=(hint or f"see schemas/{tool}.request.json"))
    return _fill_defaults(schema, request)


JSON_TYPES = {"integer": "an integer", "number": "a number", "string": "a string", "boolean": "true or false",
              "object": "an object", "array": "an array", "null": "null"}


def _json_kind(value: Any) -> str:
    """A JSON value's type, as JSON names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object", type(None): "null"}.get(type(value), "a value")


def _alternative(alt: dict) -> str:
    """One branch of a oneOf / anyOf, in words: 'one of [...]', 'an integer >= 0'."""
    if "enum" in alt:
        return f"one of {alt['enum']}"
    text = {"integer": "an integer", "string": "a string", "object": "an object"}.get(alt.get("type"), str(alt))
    return text + (f" >= {alt['minimum']}" if "minimum" in alt else "")


def call(tool_name: str, request: dict, ctx: Context | None = None) -> dict:
    """Run a tool from Python: the same envelope the command line prints. Never raises for a
    request: a bug of ours is an 'internal' error (exit 9), told apart from the user's errors."""
    ctx = ctx or Context(dry_run=request.get("dry_run") is True if isinstance(request, dict) else False)
    tool = get_tool(tool_name)
    rid = None
    remembering = None
    try:
        req = validate_request(tool_name, request)
        rid = request_id(tool_name, req)
        ctx.request_id = rid
        if ctx.dry_run:  # a dry run writes nothing, Megatron's parser's verdicts included
            from .adapter import parser

            remembering = (parser.REMEMBER, parser.REMEMBER.set(False))
        env = {"ok": True, "tool": tool_name, "request_id": rid, "result": tool.run(req, ctx)}
    except ToolError as e:
        env = {"ok": False, "tool": tool_name, "error": e.to_json()}
    except RecursionError:
        env = {"ok": False, "tool": tool_name, "error": ToolError(
            "bad_request", "the request is nested too deeply", where="/", fix="check the request").to_json()}
    except OSError as e:
        env = {"ok": False, "tool": tool_name, "error": _os_error(e)}
    except Exception as e:  # noqa: BLE001 -- a bug of ours: one JSON error, the traceback on request
        if os.environ.get("MEGATRON_SKILL_DEBUG"):
            traceback.print_exc()
        env = {"ok": False, "tool": tool_name, "error": {
            "code": "internal", "message": f"internal error: {type(e).__name__}: {e}",
            "fix": "set MEGATRON_SKILL_DEBUG=1 for the traceback and report it"}}
    finally:
        if remembering:
            remembering[0].reset(remembering[1])
    if not env["ok"]:
        env["error"] = _bounded(env["error"])
    if rid and "request_id" not in env:
        env["request_id"] = rid
    return strict_json(env)


ERROR_TEXT_LIMIT = 2000  # characters of an error's message, where or fix


def _bounded(error: dict) -> dict:
    """An error whose message, where and fix are each at most ERROR_TEXT_LIMIT characters: they
    quote what the request gave (an unknown 50 MB model name, a schema's 'x is not of type'), and
    an answer is read by a person or an agent, not a 50 MB echo of its own request."""
    out = dict(error)
    for key in ("message", "where", "fix"):
        text = out.get(key)
        if isinstance(text, str) and len(text) > ERROR_TEXT_LIMIT:
            keep = ERROR_TEXT_LIMIT // 2
            out[key] = f"{text[:keep]}... ({len(text) - 2 * keep:,} characters left out) ...{text[-keep:]}"
    return out


# What the machine refuses, whatever the code: no permission, a read-only file system, a full disk
# or quota, too many open files. A tool's own checks name these where it opens its paths; one
# that reaches call is still the machine's answer, not a bug of the skill's.
MACHINE_ERRNOS = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
                  errno.EROFS: "read-only file system", errno.ENOSPC: "no space left on the disk",
                  errno.EDQUOT: "disk quota exceeded", errno.EMFILE: "too many open files",
                  errno.ENFILE: "too many open files in the system", errno.EIO: "input/output error"}


def _os_error(e: OSError) -> dict:
    if e.errno not in MACHINE_ERRNOS:
        if os.environ.get("MEGATRON_SKILL_DEBUG"):
            traceback.print_exc()
        return {"code": "internal", "message": f"internal error: {type(e).__name__}: {e}",
                "fix": "set MEGATRON_SKILL_DEBUG=1 for the traceback and report it"}
    name = e.filename if isinstance(e.filename, str) else None
    return ToolError("environment", f"{MACHINE_ERRNOS[e.errno]}" + (f": {name}" if name else f" ({e})"),
                     where=name or "file system",
                     fix="give paths this user may read and write, on a disk with room (df -h, ls -ld)").to_json()


def invoke(tool_name: str, request: dict, parent: Context) -> dict:
    """One tool using another: through the same validation, defaults and envelope as any other
    caller, reporting to the parent's progress; the result, or the other tool's error raised as
    the caller's own."""
    env = call(tool_name, request, Context(dry_run=request.get("dry_run") is True, progress=parent.progress))
    if not env["ok"]:
        e = env["error"]
        raise ToolError(e["code"] if e["code"] != "internal" else "internal", f"{tool_name}: {e['message']}",
                        where=e.get("where"), fix=e.get("fix"), details=e.get("details"))
    return env["result"]


def request_fields(tool_name: str) -> set[str]:
    """The fields a tool's request may have (its schema's properties)."""
    return set(load_schema(tool_name, "request")["properties"])


def strict_json(value: Any) -> Any:
    """value with every NaN or Infinity replaced by null, so that it is strict JSON; the
    envelope then lists where they were (non_finite: JSON pointers and what they held)."""
    found: list[dict[str, str]] = []

    def clean(v: Any, where: str) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            found.append({"where": where, "value": str(v)})
            return None
        if isinstance(v, dict):
            return {k: clean(x, f"{where}/{k}") for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x, f"{where}/{i}") for i, x in enumerate(v)]
        return v

    out = clean(value, "")
    if found and isinstance(out, dict):
        out["non_finite"] = found
    return out


def exit_code(envelope: dict) -> int:
    if envelope.get("ok"):
        # validate answers ok with valid: false when it finds errors: exit 7 lets a shell branch on it.
        return 7 if envelope.get("result", {}).get("valid") is False else 0
    from .errors import EXIT_CODES
    return EXIT_CODES.get(envelope["error"]["code"], 1)


# ---- command line --------------------------------------------------------------------
def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _json_or_text(text: str) -> Any:
    """A flag's value: JSON where it parses as strict JSON (an object, a list, a number), else the text."""
    try:
        return files.parse_json(text, "a flag's value", "argv", unicode_checked_later=True)
    except ToolError:
        return text


def _scalar(kind: str | list | None) -> Callable[[str], Any]:
    kinds = kind if isinstance(kind, list) else [kind]
    if kinds == ["integer"]:
        return int
    if kinds == ["number"]:
        return float
    if kinds == ["string"]:
        return str
    return _json_or_text


def build_parser(tool: Tool) -> argparse.ArgumentParser:
    schema = load_schema(tool.name, "request")
    p = argparse.ArgumentParser(
        prog=f"launch.py {tool.name}", description=schema.get("description", tool.summary),
        epilog=_epilog(tool.name, schema), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--request", metavar="FILE", help="the whole request as JSON, from FILE or - for stdin; "
                   "flags given as well override its fields")
    p.add_argument("--pretty", action="store_true", help="indent the JSON output")
    for key, prop in schema.get("properties", {}).items():
        prop = _resolve(prop)
        if key == "dry_run":
            p.add_argument("--dry-run", dest="dry_run", action="store_true", default=None,
                           help=prop.get("description"))
            continue
        help_ = prop.get("description", "")
        if "default" in prop and prop["default"] != {}:
            help_ += f" (default: {json.dumps(prop['default'])})"
        kind = prop.get("type")
        if kind == "object" and prop.get("properties"):
            help_ += f" [JSON object; fields: {', '.join(prop['properties'])}]"
        elif kind == "object":
            help_ += " [JSON object]"
        if "enum" in prop and "one of" not in help_:
            help_ += f" (one of: {', '.join(map(str, prop['enum']))})"
        if kind == "boolean":
            p.add_argument(_flag(key), dest=key, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif kind == "array":
            item = prop.get("items", {}).get("type")
            p.add_argument(_flag(key), dest=key, nargs="+", type=_scalar(item), default=None, help=help_)
        else:
            p.add_argument(_flag(key), dest=key, type=_scalar(kind), default=None, help=help_,
                           metavar=key.upper() if kind != "object" else "JSON")
    return p


def _epilog(tool: str, schema: dict) -> str:
    lines = [f"Request schema: schemas/{tool}.request.json. Output: one JSON object on stdout; progress on "
             "stderr. Exit codes: 0 ok, 2 bad request, 3 not found, 4 infeasible, 5 environment, 6 conflict, "
             "7 invalid script, 8 runtime failure, 9 internal error (a bug: report it), 10 event refused."]
    props = schema.get("properties", {})
    if "model" in props or "gpu" in props:
        from .core.catalog import gpu_names, model_names

        if "model" in props:
            lines.append("Models in the catalog: " + ", ".join(model_names()) + ".")
        if "gpu" in props:
            lines.append("GPUs in the catalog: " + ", ".join(gpu_names()) + ".")
    return "\n\n".join(textwrap.fill(line, 100) for line in lines)


def _read_request(source: str) -> Any:
    """The request of --request: a regular file (never a FIFO or a device, which could wait or
    never end) or stdin, of bounded size, UTF-8 and strict JSON."""
    if source == "-":
        if sys.stdin is None:  # closed by the caller (launch.py opens /dev/null there; embedded use may not)
            raise ToolError("bad_request", "--request - reads the request on stdin, which is closed", where="--request",
                            fix="pipe the request into the tool, or give --request FILE")
        binary = getattr(sys.stdin, "buffer", None)  # none where stdin is a text stream of Python's (embedded use)
        try:
            data = (binary or sys.stdin).read(files.JSON_LIMIT + 1)
        except (OSError, ValueError) as e:  # a folder or an unreadable device as stdin, a closed stream
            raise ToolError("bad_request", f"cannot read the request on stdin: {e}", where="--request",
                            fix="pipe one JSON request into the tool, or give --request FILE") from None
        if len(data) > files.JSON_LIMIT:
            raise ToolError("bad_request", f"the request on stdin is larger than {files.JSON_LIMIT:,} bytes",
                            where="--request", fix="give one JSON request")
        text = files.decode(data, "the request on stdin", where="--request") if binary else data
    else:
        text = files.read_text(source, where="--request", what="request file")
    where = "stdin" if source == "-" else source
    if not text.strip():
        raise ToolError("bad_request", f"the request in {where} is empty", where="--request",
                        fix="give one JSON object (for no fields at all: {})")
    return parse_json(text, where="--request", name=f"the request in {where}", unique_keys=True)


def parse_json(text: str, where: str, name: str, unique_keys: bool = False) -> Any:
    """A request's strict JSON (files.parse_json; a lone surrogate is refused where the request's
    values are checked, with the field that holds it); unique_keys: an object that gives a key twice
    is refused too (Python keeps the last, another reader the first: {"dry_run": true, "dry_run":
    false} reads as a dry run to a person and ran for real)."""
    return files.parse_json(text, name, where, unique_keys=unique_keys, unicode_checked_later=True)


@contextlib.contextmanager
def _stdout_to_stderr():
    """While a tool runs, whatever writes to stdout (a library's print or logging handler, a
    child process) goes to stderr: stdout carries the one JSON envelope and nothing else."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1 (embedded use): nothing to protect
        yield
        return
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _take_arg_vector(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """A tool's --args takes a whole Megatron argument vector, whose items are flags themselves
    (--args --fp8-hybrid --bf16): everything after it up to the tool's own next option. argparse
    alone would refuse the first item for starting with '--'."""
    if "--args" not in argv or "--args" not in parser._option_string_actions:
        return argv, None
    own = set(parser._option_string_actions)
    start = argv.index("--args") + 1
    end = start
    while end < len(argv) and argv[end].split("=", 1)[0] not in own:
        end += 1
    return argv[:start - 1] + argv[end:], argv[start:end]


class _OnceEach(argparse.Namespace):
    """The parsed flags, each with one value: argparse keeps the last of a flag given twice
    (--num-gpus 8 --num-gpus 16, --request a --request b, --resume --no-resume), which a script
    that appends flags to a command line did not mean; a second, different value is refused
    instead (the same value again changes nothing). argparse sets every field once to its default
    first, then once per time the flag is given."""

    def __setattr__(self, key: str, value: Any) -> None:
        seen = self.__dict__.setdefault("_set_count", {})
        count, first = seen.get(key, (0, None))
        if count == 1:
            first = value
        elif count >= 2 and value != first:
            flag = _flag(key)
            raise ToolError("bad_request", f"{flag} is given twice, with two values ({_shown(first)} and "
                            f"{_shown(value)})", where="argv",
                            fix=f"give {flag} once (a switch and its negated form count as the same flag)")
        seen[key] = (count + 1, first)
        super().__setattr__(key, value)


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def main_for(tool: Tool, argv: list[str]) -> int:
    # argparse prints usage and exits 2 on bad flags; turn that into the JSON error too.
    def fail(message: str) -> None:
        raise ToolError("bad_request", message, where="argv", fix=f"see: launch.py {tool.name} --help")
    pretty = "--pretty" in argv
    try:
        parser = build_parser(tool)
        parser.error = fail  # type: ignore[method-assign]
        argv, vector = _take_arg_vector(parser, argv)
        args = parser.parse_args(argv, namespace=_OnceEach())
        request: dict = {}
        if args.request:
            request = _read_request(args.request)
            if not isinstance(request, dict):
                raise ToolError("bad_request", "the request must be a JSON object", where="--request",
                                fix=f"see schemas/{tool.name}.request.json")
        for key, value in vars(args).items():
            if key in ("request", "pretty", "_set_count") or value is None:
                continue
            request[key] = value
        if vector is not None:
            request["args"] = vector
        with _stdout_to_stderr():
            envelope = call(tool.name, request)
    except ToolError as e:
        envelope = {"ok": False, "tool": tool.name, "error": _bounded(e.to_json())}
    except KeyboardInterrupt:
        envelope = {"ok": False, "tool": tool.name,
                    "error": {"code": "runtime", "message": "interrupted", "fix": "run it again"}}
    except Exception as e:  # a bug of ours: still one JSON error, the traceback only on request
        if os.environ.get("MEGATRON_SKILL_DEBUG"):
            traceback.print_exc()
        print(f"internal error: {type(e).__name__}: {e}", file=sys.stderr)
        envelope = {"ok": False, "tool": tool.name,
                    "error": {"code": "internal", "message": f"internal error: {type(e).__name__}: {e}",
                              "fix": "set MEGATRON_SKILL_DEBUG=1 for the traceback and report it"}}
    try:
        print(json.dumps(strict_json(envelope), indent=2 if pretty else None, allow_nan=False), flush=True)
    except BrokenPipeError:  # the reader stopped early (| head): not our error
        sys.stdout = open(os.devnull, "w")
    return exit_code(envelope)
