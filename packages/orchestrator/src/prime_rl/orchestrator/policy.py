"""Which policy version inference serves, and whether new requests may start (closed while weights load)."""

from __future__ import annotations

import asyncio


class PolicyState:
    """The served policy version, plus a gate that holds new requests back during a weight update."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._open = True
        self._changed = asyncio.Condition()

    @property
    def is_open(self) -> bool:
        return self._open

    async def close(self) -> None:
        async with self._changed:
            self._open = False

    async def open(self, version: int | None = None) -> None:
        async with self._changed:
            if version is not None:
                self.version = version
            self._open = True
            self._changed.notify_all()

    async def wait_for(self, min_version: int) -> int:
        """Wait until the gate is open and `version >= min_version`; return the version to tag with."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._open and self.version >= min_version)
            return self.version
