"""Which policy version inference serves, and whether new requests may start (closed while weights load, held
while inference is away: see heal.py)."""

from __future__ import annotations

import asyncio


class PolicyState:
    """The served policy version, plus a gate that holds new requests back during a weight update."""

    def __init__(self, version: int = 0) -> None:
        self.version = version
        self._open = True
        self._held = False
        """Inference is away (restarting): no request may start, whatever the weight updater does with the gate."""
        self._changed = asyncio.Condition()

    @property
    def is_open(self) -> bool:
        return self._open and not self._held

    async def hold(self) -> None:
        async with self._changed:
            self._held = True

    async def release(self) -> None:
        async with self._changed:
            self._held = False
            self._changed.notify_all()

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
            await self._changed.wait_for(lambda: self.is_open and self.version >= min_version)
            return self.version
