"""``--help``: every option of a config, grouped by TOML table, with its type, default and full help text.

Each table is one section headed by its TOML name (``[trainer.model]``) and the field's docstring, so a
flag and the TOML key it sets read the same. A discriminated union lists its ``type`` choices and then
each variant's options under ``type = "...":``. Required fields say ``(required)``; help texts are the
fields' whole docstrings, wrapped, never cut. ``CMD --help trainer.model`` prints one subtree only.

The attribute docstrings are read here, from the source (one parse per module, when help is asked
for, kept beside the bytecode until the source changes), rather than by pydantic at class creation,
which would cost every process start.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import json
import os
import sys
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from prime_rl.common.config.base import _bool_words, _is_optional_model, _models_in, _union_args, _variants
from prime_rl.common.help_cache import help_width

OPTION_COLUMN = 34


@dataclass
class _Section:
    path: str
    """dotted path of the table ("" for the top level)"""
    title: str
    lines: list[str] = field(default_factory=list)


def _flag(path: str) -> str:
    return f"--{path.replace('_', '-')}"


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


@functools.cache
def _module_docstrings(module_name: str) -> dict[str, dict[str, str]]:
    """Attribute docstrings of every class in a module: {class __qualname__: {attribute: docstring}}.

    Parsing the config modules (~2,600 lines) is 30-60 ms of ``rl --help`` on the loaded 2-core dev machine,
    so the result is kept beside the module's bytecode and follows its rules: reused while the source's
    mtime and size match, written unless ``sys.dont_write_bytecode`` (``-B``), never required.
    """
    module = sys.modules.get(module_name)
    cache, stamp = _docstring_cache(module)
    if cache is not None:
        try:
            cached = json.loads(cache.read_text())
            if cached["source"] == stamp:
                return cached["docs"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    try:
        docs = _parse_docstrings(inspect.getsource(module))
    except (OSError, TypeError, SyntaxError):
        return {}
    if cache is not None and not sys.dont_write_bytecode:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"source": stamp, "docs": docs}))
            tmp.replace(cache)
        except OSError:
            pass
    return docs


def _docstring_cache(module: Any) -> tuple[Path | None, list[int]]:
    """``__pycache__/<name>.<tag>.fielddocs.json`` beside the module's .pyc (``sys.pycache_prefix`` too), and
    the source's [mtime_ns, size] it is valid for; (None, []) for a module without a source file."""
    try:
        source = inspect.getsourcefile(module)
        stat = os.stat(source)
        pyc = Path(importlib.util.cache_from_source(source))
    except (TypeError, OSError, NotImplementedError):
        return None, []
    return pyc.with_name(pyc.name.removesuffix(".pyc") + ".fielddocs.json"), [stat.st_mtime_ns, stat.st_size]


def _parse_docstrings(source: str) -> dict[str, dict[str, str]]:
    tree = ast.parse(source)
    out: dict[str, dict[str, str]] = {}

    def visit(body: list[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(node.body, f"{prefix}{node.name}.<locals>.")
            elif isinstance(node, ast.ClassDef):
                docs, previous = out.setdefault(f"{prefix}{node.name}", {}), None
                for stmt in node.body:
                    if (
                        isinstance(previous, ast.AnnAssign)
                        and isinstance(previous.target, ast.Name)
                        and isinstance(stmt, ast.Expr)
                        and isinstance(stmt.value, ast.Constant)
                        and isinstance(stmt.value.value, str)
                    ):
                        docs[previous.target.id] = inspect.cleandoc(stmt.value.value)
                    previous = stmt
                visit(node.body, f"{prefix}{node.name}.")

    visit(tree.body, "")
    return out


def field_doc(model: type[BaseModel], name: str) -> str:
    """The help text of field ``name``: its ``Field(description=...)``, else the docstring under it in the
    class that declares it (a subclass inherits its base's)."""
    info = model.model_fields[name]
    if info.description:
        return info.description
    for cls in model.__mro__:
        if name in cls.__dict__.get("__annotations__", {}):
            return _module_docstrings(cls.__module__).get(cls.__qualname__, {}).get(name, "")
    return ""


def _metavar(annotation: Any) -> str:
    names = []
    for arg in _union_args(annotation):
        origin = typing.get_origin(arg)
        if arg is type(None):
            continue
        if origin is typing.Literal:
            names.append("{" + ",".join(str(a) for a in typing.get_args(arg)) + "}")
        elif origin in (list, tuple, set):
            names.append("LIST")
        elif origin is dict or arg is dict:
            names.append("TABLE")
        elif isinstance(arg, type) and issubclass(arg, Path):
            names.append("PATH")
        elif isinstance(arg, type):
            names.append({int: "INT", float: "FLOAT", str: "STR", bool: "BOOL"}.get(arg, arg.__name__.upper()))
        else:
            names.append(str(arg).upper())
    return "|".join(dict.fromkeys(names))


def _shown(value: Any) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _option(path: str, info: FieldInfo, doc: str, default: Any, indent: int, width: int) -> list[str]:
    annotation = info.annotation
    if words := _bool_words(annotation):
        choices = sorted(words - {"true", "false", "none"})  # a Literal beside the bool: `--flag auto`
        value = f" [{'|'.join(choices)}]" if choices else ""
        head = f"{_flag(path)}{value}, --no-{_flag(path)[2:]}"
    else:
        head = f"{_flag(path)} {_metavar(annotation)}"
    state = "(required)" if info.is_required() else f"(default: {_shown(default)})"
    text = f"{state} {_one_line(doc)}".strip()
    pad = " " * indent
    column = indent + OPTION_COLUMN
    if len(pad + head) + 2 <= column:
        first = f"{pad}{head}".ljust(column)
        return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=" " * column) or [first]
    return [f"{pad}{head}", *textwrap.wrap(text, width, initial_indent=" " * column, subsequent_indent=" " * column)]


def _default_of(info: FieldInfo, parent_default: Any, name: str) -> Any:
    if isinstance(parent_default, BaseModel) and name in type(parent_default).model_fields:
        return getattr(parent_default, name)
    return None if info.is_required() else info.get_default(call_default_factory=True)


def _walk(
    model: type[BaseModel], prefix: str, default: Any, section: _Section, out: list[_Section], indent: int, width: int
) -> None:
    """Add ``model``'s leaf options to ``section`` and one new section per sub-table to ``out``."""
    subtables = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        value = _default_of(info, default, name)
        if name == "type" and prefix and typing.get_origin(info.annotation) is typing.Literal:
            continue  # the variant's tag: shown once, on the union's section
        if _models_in(info.annotation):
            subtables.append((path, info, field_doc(model, name), value))
        else:
            section.lines.extend(_option(path, info, field_doc(model, name), value, indent, width))
    for path, info, doc, value in subtables:
        _table(path, info, doc, value, out, width)


def _table(path: str, info: FieldInfo, doc: str, default: Any, out: list[_Section], width: int) -> None:
    annotation = info.annotation
    title = f"[{path}]  {_one_line(doc)}".rstrip()
    if info.is_required():
        title += " (required)"
    section = _Section(path, title)
    out.append(section)
    if _is_optional_model(annotation):
        state = "off" if default is None else (f'"{default}"' if isinstance(default, str) else "on")
        section.lines.append(f"  {_flag(path)} / --no-{_flag(path)[2:]}  turns the table on / off (default: {state})")
    variants = _variants(annotation)
    if not variants:
        model = _models_in(annotation)[0]
        _walk(model, f"{path}.", default, section, out, 2, width)
        return
    current = getattr(default, "type", None)
    choices = " | ".join(f'"{tag}"' for tag in variants)
    state = "(required)" if current is None else f'(default: "{current}")'
    section.lines.append(f"  {_flag(path)}.type {{{','.join(variants)}}}  {state}  one of {choices}")
    for tag, model in variants.items():
        section.lines.append(f'  type = "{tag}": {_one_line(model.__doc__)}'.rstrip())
        _walk(model, f"{path}.", default if isinstance(default, model) else None, section, out, 4, width)


def sections(cls: type[BaseModel], width: int) -> list[_Section]:
    top = _Section("", "top level")
    out = [top]
    _walk(cls, "", None, top, out, 2, width)
    return [s for s in out if s.lines]


def _union_note(all_sections: list[_Section]) -> str:
    """How switching a union's type works, with this config's first union as the example."""
    unions = [s.path for s in all_sections if any(ln.startswith(f"  {_flag(s.path)}.type ") for ln in s.lines)]
    if not unions:
        return ""
    example = min(unions, key=lambda path: path.count("."))
    return f" Setting a table's type ({_flag(example)}.type) switches variant: the earlier variant's keys are dropped."


def format_help(cls: type[BaseModel], prog: str, section: str | None = None, width: int | None = None) -> str:
    """The whole ``prog --help [section]`` text, wrapped to ``width`` columns (default: the terminal's)."""
    width = help_width() if width is None else width
    doc = _one_line((cls.__doc__ or "").strip().split("\n\n")[0])
    all_sections = sections(cls, width)  # walked once: the head, the union note and the body share it
    head = [
        f"usage: {prog} [@ config.toml ...] [--section.key-name value ...]",
        f"       {prog} --help [SECTION]   only the options of one table, e.g. {prog} --help "
        + next((s.path for s in all_sections if "." in s.path), "SECTION"),
        "",
        *textwrap.wrap(doc, width),
        "",
        *textwrap.wrap(
            "Defaults, then each @ file.toml deep-merged left to right, then flags. The flag --a.b.key-name v "
            "sets key_name = v under the TOML table [a.b]. Booleans: --x / --no-x. Null: None. Lists: --x 1 2 "
            "or JSON." + _union_note(all_sections),
            width,
        ),
    ]
    picked = all_sections
    if section is not None:
        key = section.replace("-", "_").strip("[]")
        picked = [s for s in picked if s.path == key or s.path.startswith(f"{key}.")]
        if not picked:
            names = ", ".join(s.path for s in all_sections if s.path)
            return "\n".join(head + ["", f"no table {section!r}; tables: {names}"]) + "\n"
    body = []
    for s in picked:
        body += ["", s.title, *s.lines]
    return "\n".join(head + body) + "\n"
