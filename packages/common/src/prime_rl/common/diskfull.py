"""A full disk names itself: which write failed, where, and how much space is left there.

Checkpoint and state writers wrap their writes in ``naming_disk_full(path, what)``. ENOSPC (or EDQUOT)
anywhere in the exception chain -- torch DCP wraps each rank's error in a ``CheckpointException`` --
becomes one ``DiskFullError`` whose message states the path, the free and total space of its
filesystem, and the fixes, instead of a traceback deep inside a writer.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(OSError):
    """No space (or quota) left where a checkpoint or state file was being written."""


def _errors(error: BaseException, depth: int = 0) -> Iterator[BaseException]:
    if depth > 8:
        return
    yield error
    failures = getattr(error, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
    if isinstance(failures, dict):
        for inner in failures.values():
            if isinstance(inner, BaseException):
                yield from _errors(inner, depth + 1)
            elif isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):
                yield from _errors(inner[0], depth + 1)
    for inner in (error.__cause__, error.__context__):
        if inner is not None:
            yield from _errors(inner, depth + 1)


def is_disk_full(error: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in _FULL for e in _errors(error))


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def describe_space(path: str | os.PathLike[str]) -> str:
    """'<free> free of <total>' on the filesystem holding ``path`` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{_human(usage.free)} free of {_human(usage.total)} on the filesystem holding {probe}"


@contextmanager
def naming_disk_full(path: str | os.PathLike[str], what: str, fix: str = "") -> Iterator[None]:
    """Turn ENOSPC / EDQUOT raised inside the block into a ``DiskFullError`` naming ``what`` and ``path``."""
    try:
        yield
    except DiskFullError:
        raise
    except BaseException as e:
        if not is_disk_full(e):
            raise
        hint = fix or "free space there or point output_dir at a larger filesystem"
        raise DiskFullError(
            errno.ENOSPC, f"disk full while writing {what} to {path} ({describe_space(path)}); {hint}"
        ) from e
