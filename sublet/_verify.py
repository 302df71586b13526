"""verify: proof, in the owner's own job, that the kept bytes came back.

Before the loan the owner takes a 64-bit checksum of every kept range on the device (one GPU
kernel over all ranges, sublet_region_checksum); after the loan, once the kept bytes are
restored, it takes them again and compares. The checksums are of bits, not values (a NaN that
came back as the same NaN is unchanged), and of where each byte lies. A difference raises
VerifyError naming the ranges that changed.

On with verify=True, or for every loan of the process with SUBLET_VERIFY=1.

Floor: above _errors and _memory, the modules of sublet it imports; below _loan, which calls
it (tests/python/test_import_floors.py keeps it so).
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ._errors import VerifyError
from ._memory import Region

_SHOWN = 10  # changed ranges spelled out in the message


def enabled(verify: bool | None) -> bool:
    """verify as given, else $SUBLET_VERIFY (1 turns it on)."""
    if verify is not None:
        return bool(verify)
    return os.environ.get("SUBLET_VERIFY", "").strip() not in ("", "0")


class Snapshot:
    """The checksums of a tensor's kept ranges, taken before a loan."""

    def __init__(self, region: Region, tensor: torch.Tensor | None, ranges: np.ndarray | None):
        self.region, self.tensor = region, tensor
        self.ranges = (np.array([[0, region.size]], np.uint64) if ranges is None
                       else np.ascontiguousarray(ranges, np.uint64))
        self.sums = self._checksums()

    def _checksums(self) -> np.ndarray:
        sums = np.empty(len(self.ranges), np.uint64)
        self.region.client.checksum(self.region.handle, self.ranges, sums)
        return sums

    def check(self) -> None:
        """Raises VerifyError when a kept range's checksum is not what it was."""
        now = self._checksums()
        changed = np.flatnonzero(now != self.sums)
        if len(changed) == 0:
            return
        ranges = [(int(o), int(n)) for o, n in self.ranges[changed]]
        # describe() speaks of the tensor's storage, which lies anywhere in a pool's arena.
        base = 0 if self.tensor is None else \
            self.tensor.untyped_storage().data_ptr() - self.region.addr
        described = [describe(self.tensor, o - base, n) for o, n in ranges[:_SHOWN]]
        more = f"\n  ... and {len(ranges) - _SHOWN} more" if len(ranges) > _SHOWN else ""
        raise VerifyError(
            f"verify: {len(ranges)} of {len(self.ranges)} kept ranges did not come back as "
            f"they were ({sum(n for _, n in ranges)} bytes in them):\n"
            + "\n".join(f"  - {d}" for d in described) + more
            + "\nThis is a bug in sublet or the driver, or the owner wrote to the tensor during "
              "the loan: report it with the daemon's log.", ranges, described)


def describe(tensor: torch.Tensor | None, offset: int, length: int) -> str:
    """A byte range of the tensor's storage in the tensor's terms, where that is easy (one
    tensor lent); the offset alone otherwise."""
    text = f"bytes [{offset}, {offset + length})"
    if tensor is None:
        return text
    size = tensor.element_size()
    first = offset // size - tensor.storage_offset()
    if tensor.is_contiguous() and 0 <= first < tensor.numel():
        index = tuple(int(i) for i in np.unravel_index(first, tuple(tensor.shape)))
        text += f": {-(-(offset + length) // size) - offset // size} elements from index " \
                f"{list(index)}"
    return text
