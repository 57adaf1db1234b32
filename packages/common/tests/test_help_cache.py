"""The stored `--help` texts: served only for the same command, config class, section and width, and never
once a module file the text was rendered from has changed (or the interpreter's environment has)."""

import shutil
import sys
import types

import pytest

from prime_rl.common import help_cache

CONFIG = "probe.ProbeConfig"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The cache under tmp_path (not beside the checkout's bytecode), writable, and one watched module file."""
    monkeypatch.setattr(help_cache, "__cached__", str(tmp_path / "__pycache__" / "help_cache.tag.pyc"))
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    source = tmp_path / "probe_config.py"
    source.write_text("X = 1\n")
    module = types.ModuleType("probe_config")
    module.__file__ = str(source)
    monkeypatch.setitem(sys.modules, "probe_config", module)
    return source


def test_a_stored_text_is_served_for_the_same_request_only(cache):
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "whole help\n")
    help_cache.store_help("probe", CONFIG, ["-h", "trainer.model"], 100, "one table\n")
    assert help_cache.cached_help("probe", CONFIG, None, 100) == "whole help\n"
    assert help_cache.cached_help("probe", CONFIG, "trainer.model", 100) == "one table\n"
    assert help_cache.cached_help("probe", CONFIG, None, 120) is None  # wrapped to another width
    assert help_cache.cached_help("probe", "other.Config", None, 100) is None  # another schema, same name
    assert help_cache.cached_help("other", CONFIG, None, 100) is None


def test_an_edited_module_makes_every_text_stale(cache):
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "old help\n")
    cache.write_text("X = 22\n")  # what an edited config module looks like to the cache
    assert help_cache.cached_help("probe", CONFIG, None, 100) is None


def test_another_interpreter_environment_is_a_miss(cache, monkeypatch):
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "help\n")
    monkeypatch.setattr(sys, "path", [*sys.path, "/elsewhere"])
    assert help_cache.cached_help("probe", CONFIG, None, 100) is None


@pytest.mark.parametrize("argv", [["@", "a.toml", "--help"], ["--help", "--x", "1"], ["--x", "1", "--help"]])
def test_only_a_bare_help_is_stored(cache, argv):
    """Other arguments may pick another schema before the help (`sft @ job.toml --help` with [slurm])."""
    help_cache.store_help("probe", CONFIG, argv, 100, "help\n")
    assert help_cache.cached_help("probe", CONFIG, help_cache.help_section(argv), 100) is None


def test_nothing_is_stored_under_dont_write_bytecode(cache, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "help\n")
    assert not (tmp_path / "__pycache__").exists()


def test_a_broken_cache_file_is_a_miss_and_is_rewritten(cache):
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "help\n")
    path = help_cache._cache_path("probe")
    with open(path, "wb") as f:
        f.write(b"\x00not marshal")
    assert help_cache.cached_help("probe", CONFIG, None, 100) is None
    help_cache.store_help("probe", CONFIG, ["--help"], 100, "help\n")
    assert help_cache.cached_help("probe", CONFIG, None, 100) == "help\n"


def test_exit_with_cached_help_prints_a_hit_and_returns_on_a_miss(cache, capsys):
    help_cache.exit_with_cached_help("probe", CONFIG, ["--help"])  # nothing stored yet: returns
    help_cache.store_help("probe", CONFIG, ["--help"], help_cache.help_width(), "cached\n")
    with pytest.raises(SystemExit) as exit_:
        help_cache.exit_with_cached_help("probe", CONFIG, ["--help"])
    assert exit_.value.code == 0 and capsys.readouterr().out == "cached\n"
    help_cache.exit_with_cached_help("probe", CONFIG, ["@", "a.toml", "--help"])  # not bare: returns


@pytest.mark.parametrize("columns", [None, "50", "100", "200", "abc", "-3", "0"])
def test_help_width_reads_the_columns_as_shutil_does(monkeypatch, columns):
    """help_width computes shutil.get_terminal_size's columns itself (importing shutil cost the fast path)."""
    if columns is None:
        monkeypatch.delenv("COLUMNS", raising=False)
    else:
        monkeypatch.setenv("COLUMNS", columns)
    assert help_cache.help_width() == max(80, min(shutil.get_terminal_size((120, 24)).columns, 140))


@pytest.mark.parametrize(
    ("argv", "section"),
    [(["--help"], None), (["-h", "trainer"], "trainer"), (["--help", "--x"], None), (["@", "a", "--help"], None)],
)
def test_help_section(argv, section):
    assert help_cache.asks_for_help(argv)
    assert help_cache.help_section(argv) == section
