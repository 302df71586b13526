"""sublet.release(): memory given back to the CUDA driver, for anyone to allocate, until
resume() (docs/design/release.md).

A loan (sublet.lend) serves its borrower's allocations from the lent memory, so the borrower
must route them through sublet. A release serves nobody in particular: its pages go back to
the driver, and any process can allocate them (a plain PyTorch job, NCCL, a cudaMalloc). What
the owner keeps is compacted first: the kept bytes of the released pages move, on the GPU,
into the unkept bytes of the kept pages that stay, so nothing crosses the host link unless
`stay` allows fewer pages than the kept bytes fill. The tensors keep their addresses (their
data_ptr and any CUDA graph over them stay valid); touching released memory before resume() is
a GPU fault, as after torch_memory_saver's pause.
"""

from __future__ import annotations

import warnings

import torch

from . import _keep, _lent
from ._lib import STAY_ANY, BusyError, ReleaseStats, error_for
from ._units import human

_EDAEMONDIED = -4007


class Release:
    """A live release (sublet.release): resume() ends it; as a context manager, leaving the
    block resumes."""

    def __init__(self, what: _lent.Lendable, keep: _keep.Keep = None,
                 stay: int | None = None):
        lent = _lent.resolve(what, free=False)
        region = lent.region
        page = region.client.info.page_size
        if stay is not None and stay < 0:
            raise ValueError(f"stay is bytes of GPU memory the kept bytes may keep (0: all of "
                             f"them go to the host; None: as many pages as they need), not "
                             f"{stay}")
        self.what = lent.what
        self._region = region
        self._device = lent.device
        ranges = _lent.keep_ranges(lent, keep)
        stay_pages = STAY_ANY if stay is None else stay // page
        self._handle = region.handle  # the region as it is now (an arena's may go and come)
        self._stats = region.client.release(self._handle, _lent.touched_pages(lent), ranges,
                                            stay_pages)
        self._released = self._stats
        self._active = True

    @property
    def active(self) -> bool:
        """True until resume() has put the memory back."""
        return self._active

    @property
    def stats(self) -> ReleaseStats:
        """The release's stats; after resume(), the resume's (copied_in_bytes, seconds)."""
        return self._stats

    @property
    def released_bytes(self) -> int:
        """Bytes given back to the driver."""
        return self._released.released_pages * self._region.client.info.page_size

    @property
    def stayed_bytes(self) -> int:
        """Bytes of the kept pages that stayed on the GPU, holding the kept bytes."""
        return self._released.stayed_pages * self._region.client.info.page_size

    @property
    def copied_bytes(self) -> int:
        """Kept bytes that crossed the host link (each way)."""
        return self._released.copied_out_bytes

    @property
    def moved_bytes(self) -> int:
        """Kept bytes moved on the GPU into the pages that stay (and back at the resume)."""
        return self._released.moved_bytes

    def resume(self, groups: bool = True) -> ReleaseStats:
        """Makes the released memory again at the same addresses and puts the kept bytes back.
        SubletOutOfMemoryError while the device lacks the memory (whoever took it must free
        it; the release goes on: call again).

        Each run of released pages comes back as a few allocations of up to 128 pages
        (groups: one import per 256 MiB, not per 2 MiB), which later releases give back whole;
        a region with groups cannot be lent (BusyError) until they are resumed with
        groups=False, one allocation per page, as a region is made."""
        if not self._active:
            raise BusyError(f"the release of {self.what} was resumed already")
        if self._region_gone():
            self._active = False  # every tensor of it died: the release went with the region
            return self._stats
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        rc, message, stats = self._region.client.resume(self._handle, self._released.release_id,
                                                        groups)
        if rc < 0 and rc != _EDAEMONDIED:
            raise error_for(rc, message)
        if rc == _EDAEMONDIED:  # the data is back all the same: say so, do not fail
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        self._active = False
        self._stats = stats
        return stats

    def _region_gone(self) -> bool:
        """Has the released region gone (a pool whose every tensor died gives its region
        back, and a later pool allocation makes another)?"""
        try:
            return self._region.handle.id != self._handle.id
        except ValueError:  # an arena with no region now
            return True

    def __enter__(self) -> "Release":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._active:
            self.resume()

    def __repr__(self) -> str:
        state = "released" if self._active else "resumed"
        return (f"<sublet.Release of {self.what}: {state}, {human(self.released_bytes)} to the "
                f"driver, {human(self.stayed_bytes)} stayed on the device, "
                f"{human(self.copied_bytes)} to the host>")


def release(what: _lent.Lendable, keep: _keep.Keep = None, stay: int | None = None) -> Release:
    """Gives memory back to the CUDA driver until Release.resume(); returns the Release once
    the memory is the driver's.

    what: as for sublet.lend(): a pool's tag or Pool, a tensor of a pool or of sublet.empty(),
    or a list of those (one region). Releases of different tags may be live at once.
    keep: as for sublet.lend() (default: all of it; [] nothing; views; sublet.blocks(...)).
    stay: the most bytes of GPU memory the kept bytes may keep (whole pages): None (default)
    as many pages as they fill, so nothing crosses the host link; 0 sends every kept byte to
    the host (torch_memory_saver's CPU backup). Kept pages beyond `stay` are saved and released.
    """
    return Release(what, keep, stay)
