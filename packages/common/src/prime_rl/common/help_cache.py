"""``CMD --help`` without pydantic: the text a console script printed last time, reused while nothing it was
rendered from has changed.

Rendering the help (``prime_rl.common.config.cli_help.format_help``) needs pydantic and every config
module: ~0.2 s of the 0.25-0.6 s that ``rl --help`` took on the 2-core dev machine, although the text only
changes when code changes. So ``parse_config`` stores each text it prints (``store_help``) and a console
script asks ``exit_with_cached_help`` before it imports its command: a hit prints the text and exits 0
having imported nothing but this module.

Validity follows the bytecode's rules (the text is derived from code, as a .pyc is): the cache lies beside
this module's bytecode (``__pycache__``, or under ``PYTHONPYCACHEPREFIX``), is not written under ``-B`` /
``PYTHONDONTWRITEBYTECODE``, and is used only while every module file the rendering process had loaded
(config modules, ``cli_help``, pydantic, the stdlib; 220-240 files) has the [mtime_ns, size] it had then, and
the interpreter, its prefix and ``sys.path`` are the same. The key is the command, its config class, the
section asked for and the terminal width the text was wrapped to. Only a bare ``CMD --help [SECTION]`` is
cached: other arguments beside ``--help`` may pick another schema first (``sft @ job.toml --help`` with a
``[slurm]`` table goes to the SLURM launcher).

This module sits outside ``prime_rl.common.config`` because that package's ``__init__`` imports pydantic;
it imports nothing but ``marshal``, ``os`` and ``sys``, which every interpreter has loaded already.
"""

import marshal
import os
import sys

HELP_FLAGS = ("-h", "--help")
MAX_TEXTS = 16
"""texts kept per command (one per section and width asked for); the oldest go first"""


def asks_for_help(argv: list[str]) -> bool:
    """Whether ``parse_config`` would print the help and exit: an entrypoint that imports a heavy runtime
    (torch, the orchestrator) checks this first, so that ``--help`` needs the config schema only."""
    return any(flag in argv for flag in HELP_FLAGS)


def help_section(argv: list[str]) -> str | None:
    """The table asked for by ``--help SECTION`` (the word after the flag), or None for the whole help."""
    at = argv.index("-h" if "-h" in argv else "--help")
    return argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("-") else None


def help_width() -> int:
    """Columns the help is wrapped to: the terminal's, kept within 80-140. The columns are those of
    ``shutil.get_terminal_size((120, 24))`` ($COLUMNS, else stdout's terminal, else 120), computed here
    because importing shutil (fnmatch, re, enum) was a third of a cached ``--help``."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns or 120
        except (AttributeError, ValueError, OSError):  # no stdout, or not a terminal
            columns = 120
    return max(80, min(columns, 140))


def _bare_help(argv: list[str]) -> bool:
    """``--help`` or ``--help SECTION`` and nothing else: the only requests whose text is cached."""
    return len(argv) in (1, 2) and argv[0] in HELP_FLAGS and (len(argv) == 1 or not argv[1].startswith("-"))


def _cache_path(prog: str) -> str | None:
    cached = globals().get("__cached__")  # this module's .pyc path, PYTHONPYCACHEPREFIX applied
    if not cached or os.sep in prog:
        return None
    return cached.removesuffix(".pyc") + f".{prog}.help"


def _environment() -> tuple:
    return (sys.version, sys.prefix, tuple(sys.path))


def _stat(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def _loaded_files() -> dict[str, tuple[int, int]]:
    """[mtime_ns, size] of every module file this process has loaded: what the text was rendered from."""
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str) and os.path.isabs(path) and (stamp := _stat(path)) is not None:
            files[path] = stamp
    return files


def _read(prog: str, config: str) -> dict | None:
    """The cache entry of ``prog`` if it was rendered from ``config`` by this environment and every file it
    was rendered from is unchanged; None otherwise (missing, unreadable, or stale)."""
    path = _cache_path(prog)
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            entry = marshal.load(f)
        if entry["config"] != config or entry["environment"] != _environment():
            return None
        if any(_stat(file) != tuple(stamp) for file, stamp in entry["files"].items()):
            return None
    except (OSError, ValueError, EOFError, TypeError, KeyError, AttributeError):
        return None
    return entry


def cached_help(prog: str, config: str, section: str | None, width: int) -> str | None:
    """The text ``parse_config`` printed for ``prog --help [section]`` at ``width`` columns, if still valid.
    ``config`` is the config class's ``module.qualname``, so another schema printed under the same name
    (a test's, a SLURM job's) is never served."""
    entry = _read(prog, config)
    return None if entry is None else entry["texts"].get((section or "", width))


def store_help(prog: str, config: str, argv: list[str], width: int, text: str) -> None:
    """Keep ``text``, just printed for ``prog`` with ``argv``, for ``cached_help``. Best effort: a read-only
    install, ``-B`` or a non-bare request stores nothing."""
    path = _cache_path(prog)
    if path is None or sys.dont_write_bytecode or not _bare_help(argv):
        return
    entry = _read(prog, config)
    files, texts = _loaded_files(), {}
    if entry is not None:  # still valid: its texts stay, and its files stay watched
        files = {**entry["files"], **files}
        texts = dict(list(entry["texts"].items())[-(MAX_TEXTS - 1) :])
    texts[(help_section(argv) or "", width)] = text
    new = {"config": config, "environment": _environment(), "files": files, "texts": texts}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            marshal.dump(new, f)
        os.replace(tmp, path)
    except OSError:
        pass


def exit_with_cached_help(prog: str, config: str, argv: list[str]) -> None:
    """For a console script, before it imports its command: print the cached text of a bare
    ``prog --help [SECTION]`` and exit 0 if it is valid; return otherwise (the command renders and stores it)."""
    if not _bare_help(argv):
        return
    text = cached_help(prog, config, help_section(argv), help_width())
    if text is not None:
        sys.stdout.write(text)
        raise SystemExit(0)
