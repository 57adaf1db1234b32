"""Config loading: ``CMD @ a.toml @ b.toml --section.key-name value``.

Sources are applied in order: the pydantic defaults, then each ``@ file.toml`` deep-merged left to
right, then dotted kebab-case flags. pydantic does all validation; this module only turns argv and
TOML files into one nested dict while remembering which source set each key, so that an error can
name the key *and* the file it came from.

Why not a CLI library: the contract (DESIGN.md) fixes the syntax and asks for one-line errors with
exit code 2 that name the source file. prime-pydantic-config implements the syntax but renders boxed
multi-line errors, exits 1 and does not say which TOML file a bad key came from; wrapping it would
mean re-implementing its error path. The parsing here is a few hundred lines over pydantic + tomllib
(``--help`` is ``cli_help.py``; layout checks that need the GPU count are ``layout.py``).

Conventions:
- ``--flag`` / ``--no-flag`` set booleans; a bare ``--sub`` enables an optional sub-config with its
  defaults and ``--no-sub`` (or ``--sub None``) disables it.
- The string ``"None"`` means null, in TOML (which has no null) and on the command line.
- Discriminated unions switch on ``type``; a later source that changes ``type`` replaces the earlier
  table instead of merging into it (the old variant's keys would not be valid for the new one). The
  type in effect is the one set earlier or, if none was, the default variant's: a base that sets
  ``[deployment] num_train_gpus`` and an overlay with ``type = "multi_node"`` give a clean multi-node table.
- A table that accepts any key (``extra="allow"``, e.g. ``[vllm]``) accepts any flag under it too; the
  value is read as TOML would read it (``8`` -> int, ``true`` -> bool, anything else a string).
- Errors name the key as users write it (no union tags) and the file or ``--flag`` that set it; checks
  that run after loading (``parse_config(check=...)``) raise ``ConfigError(keys=...)`` to get the same.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import sys
import tomllib
import types
import typing
import warnings
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import tomli_w
from pydantic import BaseModel, ConfigDict
from pydantic.fields import PydanticUndefined

from prime_rl.common.help_cache import asks_for_help, help_section, help_width, store_help

CLI = "command line"
MAX_PORT = 65535
"""The highest TCP port: every port field's bound, and the limit the derived-port checks hold ports to."""
T = TypeVar("T", bound=BaseModel)


class BaseConfig(BaseModel):
    """Base of every prime-rl config: unknown keys are errors; attribute docstrings are help texts.

    The docstrings are read from the source by ``--help`` only (``cli_help.field_doc``), not by pydantic's
    ``use_attribute_docstrings``: that parses every class's source at import, 80 ms of `rl --help`'s 0.35 s
    and of every process start, for text nothing but ``--help`` shows. ``defer_build``: a class's
    validator is built when first used, not at import (the ~70 config classes, ~20 ms of ``--help``).
    """

    model_config = ConfigDict(extra="forbid", validate_default=True, defer_build=True)


class ConfigError(Exception):
    """A bad config input: the message is one line naming the key and where it came from.

    Checks that run after loading (``parse_config(check=...)``) pass the dotted ``keys`` the message is
    about; ``parse_config`` then appends where each of them was set (file, flag or default).
    """

    def __init__(self, message: str, keys: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


class ConfigWarning(UserWarning):
    """A setting that is valid but has no effect here (``ep`` on a dense model, ...): printed as one line."""


# --------------------------------------------------------------------------- annotations


def _strip(annotation: Any) -> Any:
    """Unwrap Annotated[...] to its base type."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _union_args(annotation: Any) -> list[Any]:
    annotation = _strip(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [_strip(a) for a in typing.get_args(annotation)]
    return [annotation]


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    return [a for a in _union_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]


def _bool_words(annotation: Any) -> set[str] | None:
    """The words a boolean option takes as its value: "true", "false", "none", and the choices of a Literal beside
    the bool (`reshard_after_forward: bool | Literal["auto"]` takes "auto" too). None: not a boolean option, so no
    bare `--flag` / `--no-flag` form."""
    args = [a for a in _union_args(annotation) if a is not type(None)]
    if bool not in args:
        return None
    words = {"true", "false", "none"}
    for a in args:
        if typing.get_origin(a) is typing.Literal:
            words |= {str(v).lower() for v in typing.get_args(a)}
        elif a is not bool:
            return None
    return words


def _is_optional_model(annotation: Any) -> bool:
    args = _union_args(annotation)
    return type(None) in args and bool(_models_in(annotation))


def _is_list(annotation: Any) -> bool:
    return any(typing.get_origin(a) in (list, tuple, set) for a in _union_args(annotation))


class _Extra:
    """Annotation of a key under a table that accepts any key (``extra="allow"``, e.g. ``[vllm]``)."""


def _lookup(cls: type[BaseModel], path: list[str]) -> Any | None:
    """The annotation of a dotted field path, searching every variant of a union; None if unknown."""
    annotation: Any = cls
    for part in path:
        found = None
        models = _models_in(annotation)
        for model in models:
            field = model.model_fields.get(part)
            if field is not None:
                found = field.annotation
                break
        if found is None:
            return _Extra if any(m.model_config.get("extra") == "allow" for m in models) else None
        annotation = found
    return annotation


def _all_paths(cls: type[BaseModel], prefix: str = "") -> list[str]:
    out = []
    for name, field in cls.model_fields.items():
        path = f"{prefix}{name}"
        out.append(path)
        for model in _models_in(field.annotation):
            out.extend(_all_paths(model, f"{path}."))
    return sorted(set(out))


# --------------------------------------------------------------------------- merging


def _null_strings(value: Any) -> Any:
    """Turn the string "None" into None throughout (TOML has no null)."""
    if isinstance(value, dict):
        return {k: _null_strings(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_null_strings(v) for v in value]
    return None if value == "None" else value


def _variants(annotation: Any) -> dict[str, type[BaseModel]]:
    """``{type tag: model}`` of a discriminated union on ``type``; empty for anything else."""
    out = {}
    for model in _models_in(annotation):
        tag = model.model_fields.get("type")
        if tag is None or not isinstance(tag.default, str):
            return {}
        out[tag.default] = model
    return out if len(out) > 1 else {}


def _field_default(models: list[type[BaseModel]], default: Any, name: str) -> Any:
    """The default of field ``name``: from the enclosing default object if there is one, else the field's."""
    if isinstance(default, BaseModel) and name in type(default).model_fields:
        return getattr(default, name)
    for model in models:
        field = model.model_fields.get(name)
        if field is not None:
            value = field.get_default(call_default_factory=True)
            return None if value is PydanticUndefined else value
    return None


def _merge(
    base: dict,
    override: dict,
    sources: dict[str, str],
    source: str,
    prefix: str = "",
    models: list[type[BaseModel]] | None = None,
    default: Any = None,
) -> dict:
    """Deep-merge ``override`` into ``base`` (in place), recording the source of every leaf.

    ``models`` (the schema at this level) makes the merge union-aware: when ``override`` names a
    ``type`` other than the one in effect (set earlier, or the default variant), the earlier table is
    dropped instead of merged, since its keys belong to another variant.
    """
    models = models or []
    for key, value in override.items():
        path = f"{prefix}{key}"
        old = base.get(key)
        field = next((m.model_fields[key] for m in models if key in m.model_fields), None)
        child_default = _field_default(models, default, key)
        child_models = _models_in(field.annotation) if field is not None else []
        variants = _variants(field.annotation) if field is not None else {}
        if isinstance(value, dict) and isinstance(old, dict):
            if variants:
                current = old.get("type", getattr(child_default, "type", None))
                new = value.get("type", current)
                if current is not None and new != current:
                    base[key] = {}
                if new in variants:
                    child_models = [variants[new]]
            elif field is None and "type" in value and "type" in old and value["type"] != old["type"]:
                base[key] = {}  # no schema to go by: a changed `type` still means another variant
            if base[key] is not old:
                for stale in [k for k in sources if k.startswith(f"{path}.")]:
                    del sources[stale]
            if not any(isinstance(child_default, m) for m in child_models):
                child_default = None
            _merge(base[key], value, sources, source, f"{path}.", child_models, child_default)
        else:
            base[key] = value
            _record(value, sources, source, path)
    return base


def _record(value: Any, sources: dict[str, str], source: str, path: str) -> None:
    sources[path] = source
    if isinstance(value, dict):
        for k, v in value.items():
            _record(v, sources, source, f"{path}.{k}")


def _set(data: dict, path: list[str], value: Any) -> None:
    node = data
    for part in path[:-1]:
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = node[part] = {}
        node = nxt
    node[path[-1]] = value


def _load_toml(path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(file.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"bad TOML in {path}: {e}") from None


# --------------------------------------------------------------------------- argv


def _parse_value(raw: str, annotation: Any) -> Any:
    if raw == "None":
        return None
    if annotation is _Extra:  # no schema: read the value as TOML would (8 -> int, true -> bool, "x" -> str)
        try:
            return tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            return json.loads(raw) if raw[:1] in "[{" and _is_json(raw) else raw
    if raw[:1] in "[{" or (_is_list(annotation) and raw[:1] == "["):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw  # pydantic's lax mode coerces "3" -> 3, "true" -> True, "1e-4" -> 1e-4


def _is_json(raw: str) -> bool:
    try:
        json.loads(raw)
    except json.JSONDecodeError:
        return False
    return True


def _split_argv(cls: type[BaseModel], argv: list[str]) -> tuple[list[str], dict, dict[str, str]]:
    """Return (toml files, nested flag dict, sources) from argv."""
    files: list[str] = []
    flags: dict = {}
    sources: dict[str, str] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "@":
            if i + 1 >= len(argv):
                raise ConfigError("'@' must be followed by a TOML file path")
            files.append(argv[i + 1])
            i += 2
            continue
        if tok.startswith("@") and len(tok) > 1:
            files.append(tok[1:])
            i += 1
            continue
        if not tok.startswith("--"):
            raise ConfigError(
                f"unexpected argument {tok!r}: options look like --section.key value, files like @ a.toml"
            )
        key, eq, inline = tok[2:].partition("=")
        negated = False
        dotted = key.replace("-", "_")
        annotation = _lookup(cls, dotted.split("."))
        if annotation is None:  # --no-a.b or --a.no-b
            candidates = [dotted[3:]] if dotted.startswith("no_") else []
            head, _, last = dotted.rpartition(".")
            if last.startswith("no_"):
                candidates.append(f"{head}.{last[3:]}" if head else last[3:])
            for candidate in candidates:
                if _lookup(cls, candidate.split(".")) is not None:
                    dotted, negated, annotation = candidate, True, _lookup(cls, candidate.split("."))
                    break
        if annotation is None:
            near = difflib.get_close_matches(dotted, _all_paths(cls), n=1)
            hint = f"; did you mean --{near[0].replace('_', '-')}?" if near else ""
            raise ConfigError(f"unknown option --{key} (command line){hint}")
        path = dotted.split(".")
        has_value = bool(eq) or (i + 1 < len(argv) and not argv[i + 1].startswith("--") and argv[i + 1] != "@")
        if negated:
            if not (_bool_words(annotation) or _is_optional_model(annotation) or annotation is _Extra):
                raise ConfigError(f"--no-{path[-1]} only applies to booleans and optional sections (command line)")
            value: Any = None if _is_optional_model(annotation) else False
            i += 1
        elif annotation is _Extra and not has_value:
            value = True
            i += 1
        elif (words := _bool_words(annotation)) and not eq and not (has_value and argv[i + 1].lower() in words):
            value = True
            i += 1
        elif _is_optional_model(annotation) and not has_value:
            value = {}
            i += 1
        elif eq:
            value = _parse_value(inline, annotation)
            i += 1
        elif has_value and _is_list(annotation):
            j = i + 1
            items = []
            while j < len(argv) and not argv[j].startswith("--") and argv[j] != "@":
                items.append(argv[j])
                j += 1
            value = _parse_value(items[0], annotation) if len(items) == 1 and items[0][:1] == "[" else items
            i = j
        elif has_value:
            value = _parse_value(argv[i + 1], annotation)
            i += 2
        else:
            raise ConfigError(f"option --{key} needs a value (command line)")
        _set(flags, path, value)
        _record(value, sources, f"--{key}", dotted)
    return files, flags, sources


# --------------------------------------------------------------------------- errors


def display_key(cls: type[BaseModel], loc: tuple | list) -> str:
    """A pydantic error location as the dotted key users write: union tags (``multi_node``) dropped."""
    parts: list[str] = []
    annotation: Any = cls
    for part in (str(p) for p in loc):
        variants = _variants(annotation)
        if part in variants:
            annotation = variants[part]
            continue
        parts.append(part)
        annotation = _lookup_one(annotation, part)
    return ".".join(parts)


def _lookup_one(annotation: Any, name: str) -> Any:
    for model in _models_in(annotation):
        if name in model.model_fields:
            return model.model_fields[name].annotation
    return None


def _variant_owning(cls: type[BaseModel], loc: tuple | list) -> str | None:
    """For an unknown key inside one variant of a union: the fix, when another variant has that key."""
    annotation: Any = cls
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts):
        variants = _variants(annotation)
        if part in variants:
            rest = parts[i + 1 :]
            table = display_key(cls, parts[:i])
            for tag, model in variants.items():
                if tag != part and _lookup(model, rest) not in (None, _Extra):
                    return (
                        f'{".".join(rest)} belongs to {table}.type = "{tag}", not "{part}"; set {table}.type = "{tag}"'
                    )
            return None
        annotation = _lookup_one(annotation, part)
    return None


def source_of(key: str, sources: dict[str, str]) -> str | None:
    """Who set ``key`` (a file path or ``--flag``): the key itself, a table above it, or a shared top-level
    key it was copied from (``trainer.max_steps`` <- ``max_steps``); None if it kept its default."""
    parts = key.split(".")
    # Only the key itself or a suffix of it: a table above it was maybe set as a whole by one file, but a key
    # inside that no source names kept its default (or was copied from a shared top-level key).
    for start in range(len(parts)):
        src = sources.get(".".join(parts[start:]))
        if src is not None:
            return src
    return None


def where(src: str | None) -> str:
    """``in a.toml`` / ``from --x.y on the command line`` / ``default``."""
    if src is None:
        return "default"
    return f"from {src} on the command line" if src.startswith("--") else f"in {src}"


def explain(message: str, keys: tuple[str, ...] | list[str], sources: dict[str, str]) -> str:
    """``message`` + where each key got its value: ``(cp from --trainer.model.cp on the command line, ...)``."""
    found = [(key, source_of(key, sources)) for key in keys if key]
    set_somewhere = [(k, s) for k, s in found if s is not None]
    if not found:
        return message
    if len({s for _, s in found}) == 1:
        return f"{message} ({where(found[0][1])})"
    shown = set_somewhere or found
    return f"{message} ({', '.join(f'{k} {where(s)}' for k, s in shown)})"


_MENTION = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)=")
_DOTTED = re.compile(r"(?<![\w.\-/])([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w\-/])")


def _mentioned_keys(message: str, key: str, cls: type[BaseModel]) -> list[str]:
    """Dotted keys a validator's message names (``batch_size=10 must ...`` under ``orchestrator``, or a
    full path like ``trainer.data.fake is for ...``)."""
    out = []
    for name in _MENTION.findall(message) + _DOTTED.findall(message):
        for candidate in (f"{key}.{name}" if key else name, name):
            if _lookup(cls, candidate.split(".")) not in (None, _Extra):
                out.append(candidate)
                break
    return list(dict.fromkeys(out))


def _format_validation_error(err: pydantic.ValidationError, sources: dict[str, str], cls: type[BaseModel]) -> str:
    first = err.errors()[0]
    key = display_key(cls, first["loc"])
    if first["type"] == "extra_forbidden":
        other = _variant_owning(cls, first["loc"])
        near = difflib.get_close_matches(key, _all_paths(cls), n=1)
        hint = f"; {other}" if other else (f"; did you mean {near[0]}?" if near and near[0] != key else "")
        msg = f"unknown key {key!r} ({where(source_of(key, sources))}){hint}"
    elif first["type"] == "value_error" and isinstance(first.get("input"), dict):
        # a model validator: its message names the keys it is about; find who set each of them
        text = first["msg"].removeprefix("Value error, ")
        keys = _mentioned_keys(text, key, cls) or [key]
        msg = explain(f"{key}: {text}" if key else text, keys, sources)
    else:
        value = first.get("input")
        shown = f", got {value!r}" if not isinstance(value, dict) else ""
        msg = f"{key or '<root>'}: {first['msg']}{shown} ({where(source_of(key, sources))})"
    more = err.error_count() - 1
    return msg + (f" [+{more} more error{'s' if more > 1 else ''}]" if more else "")


# --------------------------------------------------------------------------- entry points


def _fill_union_tags(cls: type[BaseModel], data: dict, defaults: BaseModel | None) -> None:
    """A partial override of a union field keeps the default variant: inject its ``type``."""
    for name, field in cls.model_fields.items():
        value = data.get(name)
        if not isinstance(value, dict):
            continue
        models = _models_in(field.annotation)
        default = (
            getattr(defaults, name, None) if defaults is not None else field.get_default(call_default_factory=True)
        )
        if (
            len(models) > 1
            and "type" not in value
            and isinstance(default, BaseModel)
            and "type" in type(default).model_fields
        ):
            value["type"] = default.type
        chosen = next(
            (
                m
                for m in models
                if "type" not in value
                or m.model_fields.get("type") is None
                or m.model_fields["type"].default == value["type"]
            ),
            None,
        )
        if chosen is not None:
            _fill_union_tags(chosen, value, default if isinstance(default, chosen) else None)


def load_config_with_sources(cls: type[T], argv: list[str]) -> tuple[T, dict[str, str]]:
    """``load_config`` that also returns who set each dotted key (a file path or ``--flag``)."""
    files, flags, cli_sources = _split_argv(cls, argv)
    data: dict = {}
    sources: dict[str, str] = {}
    for file in files:
        _merge(data, _null_strings(_load_toml(file)), sources, file, models=[cls])
    _merge(data, flags, sources, CLI, models=[cls])
    sources.update(cli_sources)
    _fill_union_tags(cls, data, None)
    try:
        return cls.model_validate(data), sources
    except pydantic.ValidationError as e:
        raise ConfigError(_format_validation_error(e, sources, cls)) from None


def load_config(cls: type[T], argv: list[str]) -> T:
    """Resolve ``argv`` into a validated config; raise ConfigError on bad input."""
    return load_config_with_sources(cls, argv)[0]


def parse_config(
    cls: type[T],
    argv: list[str] | None = None,
    prog: str | None = None,
    check: typing.Callable[[T], None] | None = None,
) -> T:
    """CLI front door: ``--help [section]`` prints options and exits 0; bad input prints one line, exits 2.

    ``check(cfg)`` runs further checks that need more than the schema (GPU count, the model's
    config.json): it raises ConfigError naming the keys, which is reported with where they were set.
    ConfigWarnings (from validators or ``check``) are printed as one ``prog: warning:`` line each.
    """
    argv = sys.argv[1:] if argv is None else argv
    prog = prog or Path(sys.argv[0]).name
    if asks_for_help(argv):
        from prime_rl.common.config.cli_help import format_help

        width = help_width()
        text = format_help(cls, prog, help_section(argv), width)
        sys.stdout.write(text)
        store_help(prog, f"{cls.__module__}.{cls.__qualname__}", argv, width, text)  # for the next `prog --help`
        raise SystemExit(0)
    sources: dict[str, str] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        try:
            cfg, sources = load_config_with_sources(cls, argv)
            if check is not None:
                check(cfg)
        except ConfigError as e:
            message = explain(str(e), e.keys, sources) if e.keys else str(e)
            sys.stderr.write(f"{prog}: error: {message}\n")
            raise SystemExit(2) from None
    for w in caught:
        if not issubclass(w.category, ConfigWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        elif os.environ.get("RANK", "0") == "0":  # once per run, not once per trainer rank
            sys.stderr.write(f"{prog}: warning: {w.message}\n")
    return cfg


def _toml_ready(value: Any) -> Any:
    if value is None:
        return "None"
    if isinstance(value, dict):
        return {k: _toml_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_toml_ready(v) for v in value]
    return value


def to_toml(cfg: BaseModel) -> str:
    """Serialize a resolved config so that ``CMD @ file`` reproduces it (None is written as "None")."""
    return tomli_w.dumps(_toml_ready(cfg.model_dump(mode="json")))


def write_toml(cfg: BaseModel, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_toml(cfg))
    tmp.replace(path)
    return path
