"""This process's host copies of CPU-backup pools (SUBLET_TMS_BACKUP=process, the default, and
retain_cpu_backup): pause() copies the pool's segments here before releasing them keeping
nothing, resume() copies them back, and get_cpu_backup() reads them, as the original's host
shadow. A copy lives until the resume of its tag unless retain_cpu_backup keeps it; a later
pause refreshes a kept copy in the same buffers, so zero_copy pointers stay valid.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class HostCopies:
    """The copies by pool key: a list of (segment offset in the arena, host uint8 buffer)."""

    def __init__(self) -> None:
        self._copies: dict[tuple, list[tuple[int, torch.Tensor]]] = {}

    def has(self, key: tuple) -> bool:
        return key in self._copies

    def snapshot(self, key: tuple, pool: Any, pinned: bool = True) -> None:
        """Copies the pool's segments to host buffers, reusing the buffers of the copy kept
        so far where the segments are the same. pinned (cpu_backup_backend "pinned", on
        CUDA): page-locked buffers, PyTorch's host cache keeps them after the resume;
        otherwise ("mmap") pageable ones, whose memory goes back to the system with them."""
        from sublet._memory import wrap
        old = {(off, buf.numel()): buf for off, buf in self._copies.get(key, [])}
        base, copies = pool.arena.addr, []
        for off, length in pool.segments().tolist():
            buf = old.get((off, length))
            if buf is None:
                buf = torch.empty(length, dtype=torch.uint8,
                                  pin_memory=pinned and pool.device.type == "cuda")
            buf.copy_(wrap(base + off, length, pool.device, None, (length,), torch.uint8))
            copies.append((off, buf))
        _sync(pool.device)
        self._copies[key] = copies

    def restore(self, key: tuple, pool: Any) -> None:
        """Copies the host buffers back into the resumed pool's pages."""
        from sublet._memory import wrap
        base = pool.arena.addr
        for off, buf in self._copies[key]:
            wrap(base + off, buf.numel(), pool.device, None, (buf.numel(),),
                 torch.uint8).copy_(buf)
        _sync(pool.device)

    def drop(self, keys: list[tuple]) -> None:
        for key in keys:
            self._copies.pop(key, None)

    def keys(self) -> list[tuple]:
        return list(self._copies)

    def find(self, key: tuple, start: int, nbytes: int) -> Optional[torch.Tensor]:
        """The host bytes [start, start + nbytes) of the pool's arena offsets, or None."""
        for off, buf in self._copies.get(key, []):
            if off <= start and start + nbytes <= off + buf.numel():
                return buf[start - off:start - off + nbytes]
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
