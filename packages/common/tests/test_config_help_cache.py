"""`--help` keeps the parsed field docstrings beside the module's bytecode: the help text must be the same
whether they come from the cache or the source, and an edited source must never be shown stale."""

import importlib
import sys

import pytest

from prime_rl.common.config import cli_help

SOURCE = '''
from prime_rl.common.config import BaseConfig


class Thing(BaseConfig):
    size: int = 1
    """{doc}"""
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    path = tmp_path / "docs_cache_probe.py"
    path.write_text(SOURCE.format(doc="how big"))
    mod = importlib.import_module("docs_cache_probe")
    yield path, mod
    sys.modules.pop("docs_cache_probe", None)
    cli_help._module_docstrings.cache_clear()


def docs(name: str = "docs_cache_probe") -> dict:
    cli_help._module_docstrings.cache_clear()  # the in-process memo: read the disk cache or source again
    return cli_help._module_docstrings(name)


def test_docstrings_are_cached_and_reread_when_the_source_changes(module, monkeypatch):
    path, mod = module
    parse = cli_help._parse_docstrings
    assert docs() == {"Thing": {"size": "how big"}}
    cache, _ = cli_help._docstring_cache(mod)
    assert cache.is_file() and cache.name == f"docs_cache_probe.{sys.implementation.cache_tag}.fielddocs.json"

    def no_parse(source):
        raise AssertionError("parsed the source although the cache is valid")

    monkeypatch.setattr(cli_help, "_parse_docstrings", no_parse)
    assert docs() == {"Thing": {"size": "how big"}}

    monkeypatch.setattr(cli_help, "_parse_docstrings", parse)
    path.write_text(SOURCE.format(doc="how big, in bytes"))
    assert docs() == {"Thing": {"size": "how big, in bytes"}}


def test_a_broken_cache_is_ignored_and_rewritten(module):
    _, mod = module
    docs()
    cache, _ = cli_help._docstring_cache(mod)
    cache.write_text("{not json")
    assert docs() == {"Thing": {"size": "how big"}}
    assert '"how big"' in cache.read_text()


def test_no_cache_is_written_under_dont_write_bytecode(module, monkeypatch):
    _, mod = module
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert docs() == {"Thing": {"size": "how big"}}
    assert not cli_help._docstring_cache(mod)[0].exists()
