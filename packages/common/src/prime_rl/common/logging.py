"""Rank-aware logging: every process logs to its own file; only some ranks also log to the console.

``setup_logger("trainer", log_file=run_dir.trainer_log_path(rank), rank=rank)`` gives lines like

    2026-11-30 13:40:02 INFO [trainer rank=1] step 3 | loss 0.41

Design decisions:
- Plain stdlib ``logging`` (no extra dependency); the logger does not propagate to the root logger,
  so a library that configures the root logger cannot double every line.
- Console output only on ``console_ranks`` (rank 0 by default): with 64 ranks one readable stream,
  while every rank's file keeps the full story.
- Calling ``setup_logger`` again for the same name replaces its handlers (tests and re-launches
  within one process would otherwise duplicate lines).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection

FORMAT = "%(asctime)s %(levelname)s [%(component)s rank=%(rank)d] %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _ContextFilter(logging.Filter):
    """Stamps the component name and rank on every record (also for child loggers' records)."""

    def __init__(self, component: str, rank: int) -> None:
        super().__init__()
        self.component = component
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        record.rank = self.rank
        return True


def setup_logger(
    name: str,
    log_file: str | os.PathLike[str] | None = None,
    rank: int = 0,
    console_ranks: Collection[int] = frozenset({0}),
    level: int | str = logging.INFO,
) -> logging.Logger:
    """Configure and return ``logging.getLogger(name)``.

    ``log_file``: append every record of this rank here (parent directories are created).
    ``console_ranks``: ranks that also write to stderr.
    ``level``: a logging level or its name ("DEBUG", "info", ...).
    """
    logger = logging.getLogger(name)
    for handler in [h for h in logger.handlers if getattr(h, "_prime_rl", False)]:
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False

    formatter = logging.Formatter(FORMAT, DATE_FORMAT)
    context = _ContextFilter(name, rank)
    handlers: list[logging.Handler] = []
    if rank in console_ranks:
        handlers.append(logging.StreamHandler(sys.stderr))
    if log_file is not None:
        path = os.fspath(log_file)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        handlers.append(logging.FileHandler(path, mode="a", encoding="utf-8"))
    for handler in handlers:
        handler._prime_rl = True  # type: ignore[attr-defined]  # marks handlers we own and may replace
        handler.setFormatter(formatter)
        handler.addFilter(context)
        logger.addHandler(handler)
    if not handlers:
        logger.addHandler(_null_handler())
    return logger


def _null_handler() -> logging.Handler:
    handler = logging.NullHandler()
    handler._prime_rl = True  # type: ignore[attr-defined]
    return handler
