"""The config tree in and out: `parse_config` (TOML plus dotted CLI overrides, type checks; no validation: that is
scaletrain.validate's `load_config`), a walker over the dataclasses (TOML in and out, help text), and the saved
config of a run.

Written instead of using a CLI library so that every problem is collected and reported at once, each with the
nearest valid key, before any work starts. scaletrain.config stays a leaf of plain dataclasses; all the
machinery that reads and writes them is here.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import tomli_w

from scaletrain.config import RENAMED_KEYS, Config, SourceConfig, translate_renamed
from scaletrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def parse_config(path: str | None, overrides: list[str]) -> tuple[Config, list[str]]:
    """The config a TOML file and its `--a.b value` overrides make, types checked, not validated; and every
    problem found (a field with a problem keeps its default)."""
    raw: dict = read_toml(path) if path else {}
    problems = parse_overrides(overrides, raw)
    cfg, type_problems = to_dataclass(Config, raw)
    return cfg, problems + type_problems


def fields_typed(problems: list[str]) -> bool:
    """Whether a config parsed with these problems has every field as given (only unknown keys were found), so
    that checks across fields can run on it."""
    return all(isinstance(p, UnknownKey) for p in problems)


def resolve_paths(cfg: Config) -> None:
    """Make every local path the config names absolute against the working directory, as it enters: the run's
    config.toml then names the same files from any directory, and a resume compares paths, not their spellings.
    URLs (s3://, file://, ...) stay as written."""

    def local(path: str) -> str:
        return path if not path or "://" in path else str(absolute(path))

    cfg.run.dir = local(cfg.run.dir)
    cfg.data.cache_dir = local(cfg.data.cache_dir)
    cfg.checkpoint.storage = local(cfg.checkpoint.storage)
    if cfg.data.tokenizer != "byte":
        cfg.data.tokenizer = local(cfg.data.tokenizer)
    for source in cfg.data.sources:
        source.path = local(source.path)
    if cfg.model.init_from.startswith("hf:"):
        cfg.model.init_from = "hf:" + local(cfg.model.init_from[3:])


def absolute(path: str | Path) -> Path:
    """A path as the user typed it, made absolute against the working directory (links are kept as typed)."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def saved_config(path: Path) -> dict:
    """The resolved config a run last started with (its config.toml at `path`), with today's defaults for keys it
    lacks and its paths made absolute (a run saved before paths were stored resolved named them relative to the
    directory it ran from, which a continuing command is typed from too)."""
    saved = with_defaults(read_toml(str(path)))
    cfg, problems = to_dataclass(Config, saved)
    if problems:
        return saved  # resume_problems names what differs
    resolve_paths(cfg)
    return to_dict(cfg)


def with_defaults(saved: dict) -> dict:
    """A saved config with its renamed keys under their new names (config.RENAMED_KEYS) and the keys it lacks set
    to today's defaults (and each data source's too): a run saved before a field existed ran with what that field's
    default does, so a resume after an upgrade is the same run."""

    def merge(base: dict, over: dict) -> dict:
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
        return out

    out = merge(to_dict(Config()), translate_renamed(saved))
    sources = out.get("data", {}).get("sources")
    if isinstance(sources, list):
        base = to_dict(SourceConfig())
        out["data"]["sources"] = [merge(base, s) if isinstance(s, dict) else s for s in sources]
    return out


def to_dict(cfg: object) -> dict:
    """The config as plain TOML-writable data (None values dropped, as TOML has no null)."""

    def clean(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        if isinstance(v, list):
            return [clean(x) for x in v]
        return v

    return clean(dataclasses.asdict(cfg))


class CliValue(str):
    """A value typed on the command line: parsed by the type of the field it lands in."""


def read_toml(path: str) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file '{path}' does not exist; pass --config with a file from configs/")
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file '{path}' is not valid TOML: {e}") from None


def write_toml(data: dict, path: Path) -> None:
    path.write_text(tomli_w.dumps(data))


def parse_overrides(args: list[str], raw: dict) -> list[str]:
    """Merge `--a.b value` / `--a.b=value` pairs into `raw`; return problems with the argument list itself."""
    problems = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            problems.append(f"unexpected argument '{arg}': overrides look like --section.key VALUE")
            i += 1
            continue
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            problems.append(f"'{arg}' has no value: write {arg} VALUE or {arg}=VALUE")
            i += 1
            continue
        parts = key.replace("-", "_").split(".")
        node = raw
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = CliValue(value)
    return problems


class UnknownKey(str):
    """The problem of a key the config does not have: its section is still built from the keys it knows."""


def to_dataclass(cls: type, raw: dict, prefix: str = "") -> tuple[Any, list[str]]:
    """Build `cls` from nested dicts, converting CLI strings by field type; collect every problem."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        return cls(), [f"'{prefix.rstrip('.')}' must be a table of keys, got {raw!r}"]
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        dotted = prefix + key
        if key not in names:
            problems.append(UnknownKey(_unknown_key(dotted, cls, prefix)))
            continue
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            kwargs[key], inner = to_dataclass(hints[key], value, dotted + ".")
            problems += inner
            continue
        converted, problem = _coerce(value, hints[key], dotted)
        if problem:
            problems.append(problem)
        else:
            kwargs[key] = converted
    return cls(**kwargs), problems


def _coerce(value: Any, tp: Any, key: str) -> tuple[Any, str | None]:
    origin, args = get_origin(tp), get_args(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, CliValue):
            return None, f"'{key}' is a section; set its keys, e.g. --{key}.<key> VALUE"
        obj, problems = to_dataclass(tp, value, key + ".")
        return obj, "; ".join(problems) or None
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, CliValue) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None, None
        arms = [a for a in args if a is not type(None)]
        failures = []
        for arm in arms:
            converted, problem = _coerce(value, arm, key)
            if problem is None:
                return converted, None
            failures.append(problem)
        return None, failures[-1]
    if origin is Literal:
        text = str(value)
        if text in [str(a) for a in args]:
            return next(a for a in args if str(a) == text), None
        near = difflib.get_close_matches(text, [str(a) for a in args], n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        return None, f"'{key}' = {value!r} is not one of {', '.join(map(str, args))}{hint}"
    if origin is list:
        if isinstance(value, CliValue):
            value = _parse_cli_literal(value, list_hint=True)
        if not isinstance(value, list):
            return None, f"'{key}' must be a list, got {value!r}"
        out, problems = [], []
        for j, item in enumerate(value):
            converted, problem = _coerce(item, args[0], f"{key}[{j}]")
            problems += [problem] if problem else []
            out.append(converted)
        return out, "; ".join(problems) or None
    return _coerce_scalar(value, tp, key)


def _coerce_scalar(value: Any, tp: type, key: str) -> tuple[Any, str | None]:
    name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, tp)
    if isinstance(value, CliValue):
        if tp is str:
            return str(value), None
        if tp is bool:
            low = value.lower()
            if low in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return low in ("true", "1", "yes", "on"), None
            return None, f"'{key}' must be {name}, got '{value}'"
        try:
            return tp(value), None
        except ValueError:
            return None, f"'{key}' must be {name}, got '{value}'"
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value), None
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value, None
    return None, f"'{key}' must be {name}, got {value!r} ({type(value).__name__})"


def _parse_cli_literal(text: str, list_hint: bool = False) -> Any:
    """Parse a CLI value as a TOML literal (`[0.9, 0.95]`, `[{path="a"}]`); a bare `a,b` becomes a list."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if list_hint:
            return [CliValue(part.strip()) for part in text.split(",") if part.strip()]
        return text


def _unknown_key(dotted: str, cls: type, prefix: str) -> str:
    if dotted in RENAMED_KEYS:  # a key that moved: name its new place, whatever looks similar
        section, key = RENAMED_KEYS[dotted].split(".")
        return (
            f"unknown key '{dotted}': it was renamed '{section}.{key}' (--{section}.{key} VALUE, or {key} = ... "
            f"under [{section}])"
        )
    here = [prefix + f.name for f in dataclasses.fields(cls)]
    everywhere = all_keys(Config)
    leaf = dotted.rsplit(".", 1)[-1]
    # The same key in another section beats a similar-looking key in this one (training.lr -> optimizer.lr).
    near = [k for k in everywhere if k.rsplit(".", 1)[-1] == leaf][:1]
    near = near or difflib.get_close_matches(dotted, here, n=1, cutoff=0.6)
    near = near or difflib.get_close_matches(dotted, everywhere, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else f"; valid keys here: {', '.join(here)}"
    return f"unknown key '{dotted}'{hint}"


def all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += all_keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings: the string literal written right under each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def help_text(cls: type, prefix: str = "") -> str:
    """One line per key: flag, type, default and the field's docstring."""
    lines = []
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            lines.append(f"\n[{prefix}{f.name}]")
            lines.append(help_text(tp, prefix + f.name + "."))
            continue
        value = getattr(default, f.name)
        lines.append(f"  --{prefix}{f.name} {_type_name(tp)} (default: {value!r})")
        if f.name in docs:
            lines.append(f"      {docs[f.name]}")
    return "\n".join(lines)


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "{" + ",".join(map(str, args)) + "}"
    if origin in (typing.Union, types.UnionType):
        return "|".join(_type_name(a) for a in args if a is not type(None))
    if origin is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp)).upper()
