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

Pools: a release of a tag gives the driver the tag's pages, read from the pools' segments, so
no tensor may take one of them between that reading and subletd's answer (a page the tag freed
just before, taken by another tag's new tensor, would be given away under it). As a loan does,
the release holds the device's pools first (libsublet refuses every pool allocation:
BusyError, or torch.OutOfMemoryError inside `with sublet.pool(...)`), reads its pages under the
hold, and lets go once the release is made; a release offer once it has ended (it is made
when taken). While a release is live, pool allocations of any tag are served again, never from
a page of its set: neither a released one nor one that stayed (kept bytes may have moved
into it), until the resume.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Iterator

import torch

from . import _keep, _lent, _pool
from ._lib import (ERROR_CODES, STAY_ANY, BorrowerDiedError, BusyError, Client, DaemonDiedError,
                   ReleaseStats, SubletError, SubletTimeoutError, error_for)
from ._units import check_need as _check_need, human
from ._wait import in_slices

_EDAEMONDIED = ERROR_CODES["EDAEMONDIED"]
_EBORROWERDIED = ERROR_CODES["EBORROWERDIED"]
_ECANCELED = ERROR_CODES["ECANCELED"]
_ETIMEDOUT = ERROR_CODES["ETIMEDOUT"]


class _Hold:
    """A hold of the pools of the region `what` is in, for a release of it (nothing for a
    sublet.empty() region): libsublet refuses every pool allocation from take() to let_go(),
    so that the pages read in between are those the release gives away. let_go() acts once."""

    def __init__(self, what: _lent.Lendable):
        self.region = _lent.resolve(what, free=False).region  # errors in what: before it
        self.held = False
        self._lock = threading.Lock()

    def take(self) -> None:
        """Under sublet._pool._lock (the lock order: it, then libsublet's). BusyError while a
        loan or another release offer holds the pools."""
        if isinstance(self.region, _pool.Arena):
            self.region.client.pool_hold()
            self.held = True

    def let_go(self) -> None:
        with self._lock:
            if not self.held:
                return
            self.held = False
        try:
            self.region.client.pool_unhold()
        except SubletError:
            pass  # the client went, and the arena with it

    @contextlib.contextmanager
    def making(self, keep: bool = False) -> Iterator[None]:
        """The body reads the pages and sends the release under sublet._pool._lock and the
        hold, so that no pool allocation takes a page meanwhile (nor another thread's loan or
        release is made). The hold goes at the body's end, or (keep: a release offer, made
        when taken) only if the body fails: then let_go() once the offer has ended."""
        with _pool._lock:
            self.take()
            try:
                yield
            except BaseException:
                self.let_go()
                raise
            if not keep:
                self.let_go()


class Release:
    """A live release (sublet.release): resume() ends it; as a context manager, leaving the
    block resumes."""

    def __init__(self, what: _lent.Lendable, keep: _keep.Keep = None,
                 stay: int | None = None, need: int | None = None):
        _check_need(need)
        with _Hold(what).making():
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
                                                stay_pages, need)
            self._released = self._stats
            self.need_bytes = need
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

    def need(self, nbytes: int) -> ReleaseStats:
        """More of a release made by need (sublet.release(..., need=N)): the taker now needs
        `nbytes` of device memory in all, not in addition. Not more than the release's need
        (need_bytes): nothing happens. Else subletd counts the device's free bytes again and
        releases only the pages the increase takes beyond them, of those that stayed, the
        cheapest to give (few bytes, theirs and those moved into them, in few runs); they move
        into holes of the pages that still stay, only the rest goes to the host. Nothing
        released before comes back: resume() brings everything back at once. Returns the
        release's stats in all (released_bytes and the others say the same).
        NeedTooLargeError, the release as it was, when the pages that stay cannot give it;
        DaemonDiedError when subletd went first (nothing more released: resume() puts every
        kept byte back by itself)."""
        _check_need(nbytes)
        if not self._active:
            raise BusyError(f"the release of {self.what} was resumed already")
        if self.need_bytes is None:
            raise ValueError(f"the release of {self.what} was not made by need: it gave back "
                             f"every page it could already")
        if nbytes <= self.need_bytes:
            return self._stats
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self._stats = self._region.client.release_more(self._handle, self._released.release_id,
                                                       nbytes)
        self._released = self._stats
        self.need_bytes = nbytes
        return self._stats

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


def release(what: _lent.Lendable, keep: _keep.Keep = None, stay: int | None = None,
            need: int | None = None) -> Release:
    """Gives memory back to the CUDA driver until Release.resume(); returns the Release once
    the memory is the driver's.

    what: as for sublet.lend(): a pool's tag or Pool, a tensor of a pool or of sublet.empty(),
    or a list of those (one region). Releases of different tags may be live at once.
    keep: as for sublet.lend() (default: all of it; [] nothing; views; sublet.blocks(...)).
    stay: the most bytes of GPU memory the kept bytes may keep (whole pages): None (default)
    as many pages as they fill, so nothing crosses the host link; 0 sends every kept byte to
    the host (torch_memory_saver's CPU backup). Kept pages beyond `stay` are saved and released.
    need: bytes of device memory the taker needs, or None (default) to release every
    page that `stay` allows. subletd counts the device's free bytes first and releases only the
    pages the rest of the need takes, ceil((need - free) / page) of them (at least those beyond
    `stay`; a region made again by a resume gives back whole page groups, so up to a group
    more), the cheapest to give (few kept bytes in few runs); their kept bytes move on the device
    into the unkept bytes of the pages that stay, and only what those cannot hold goes to the
    host. A need beyond the free bytes and every page of `what` raises NeedTooLargeError
    (a SubletOutOfMemoryError) with the figures, before anything moves. Release.need_bytes
    says what was asked; stats.released_pages what went. Release.need(N) asks for more later
    (N the taker's need in all), without resuming anything.
    """
    return Release(what, keep, stay, need)


# --------------------------------------------------------------------------- release offers

def _stay_pages(stay: int | None, page: int) -> int:
    if stay is not None and stay < 0:
        raise ValueError(f"stay is bytes of GPU memory the kept bytes may keep (0: all of them "
                         f"go to the host; None: as many pages as they need), not {stay}")
    return STAY_ANY if stay is None else stay // page


class ReleaseOffer:
    """sublet.offer(..., release=True): a release that another process (a scheduler) starts
    and ends. The offer is made at once; when a scheduler takes it (sublet.take), a thread of
    libsublet in this process releases the memory (as sublet.release would, with this keep and
    stay), and when the scheduler gives it back (or dies) resumes it. wait() blocks until
    then and returns the resume's stats.

    While offered, this process is paused as for a routed offer: it must not touch what it
    offered (nor free it) until wait() has returned; its other memory it may use.
    """

    def __init__(self, what: _lent.Lendable, keep: _keep.Keep = None, name: str | None = None,
                 stay: int | None = None):
        # An arena's pools are held from before its pages are read until the offer has ended:
        # the release is made when a scheduler takes it, from the pages read now.
        self._hold = hold = _Hold(what)
        with hold.making(keep=True):
            self._lent = _lent.resolve(what, free=False)  # held: its tensors keep the region
            region = self._lent.region
            stay_pages = _stay_pages(stay, region.client.info.page_size)
            self.what = self._lent.what
            self.name = name
            self._region = region
            ranges = _lent.keep_ranges(self._lent, keep)
            self._handle = region.handle
            self._offer = Client.offer_release(self._handle, _lent.touched_pages(self._lent),
                                               ranges, stay_pages, name)
        self.offer_id = Client.release_offer_id(self._offer)
        # The library's thread outlives nothing: freeing withdraws, or waits for the end; the
        # hold goes after it.
        self._finalizer = weakref.finalize(self, _offer_free, self._offer, hold)
        self._withdrawn = False
        self._outcome: tuple[int, str, ReleaseStats, ReleaseStats] | None = None

    @property
    def state(self) -> str:
        """"offered", "taken", "released", "returning" or "ended"."""
        return "ended" if self._outcome else Client.release_offer_state(self._offer)

    @property
    def done(self) -> bool:
        return self.state == "ended"

    @property
    def released_stats(self) -> ReleaseStats | None:
        """The release's stats once the memory was released (None before)."""
        if self._outcome is not None:
            return self._outcome[2] if self._outcome[2].release_id else None
        rc, _, released, _ = Client.release_offer_wait(self._offer, 0)
        return released if released.release_id else None

    @property
    def released_bytes(self) -> int:
        """Bytes given back to the driver by the release (0 before it)."""
        stats = self.released_stats
        return stats.released_pages * self._region.client.info.page_size if stats else 0

    def wait(self, timeout: float | None = None) -> ReleaseStats:
        """Blocks until the offer is over: taken, released, given back and resumed, the kept
        bytes back bit-identical; returns the resume's stats. SubletTimeoutError after
        `timeout` seconds (it goes on: wait again). BorrowerDiedError when the scheduler died
        holding it, DaemonDiedError when subletd died (the kept bytes are back all the same:
        stats in .stats); the release's own failure (nothing released) as its error."""
        rc, message, _, resumed = self._outcome or in_slices(
            self._wait_slice, timeout,
            f"release offer {self.name or self.offer_id} was not over within {timeout} s")
        if rc == _EBORROWERDIED:
            raise BorrowerDiedError(message, rc, resumed)
        if rc == _EDAEMONDIED:
            raise DaemonDiedError(message, rc, resumed)
        if rc == _ECANCELED and self._withdrawn:
            raise RuntimeError("the release offer was withdrawn: there is nothing to wait for")
        if rc < 0:
            raise error_for(rc, message)
        return resumed

    def _wait_slice(self, timeout_ms: int) -> tuple[int, str, ReleaseStats, ReleaseStats]:
        outcome = Client.release_offer_wait(self._offer, timeout_ms)
        if outcome[0] == _ETIMEDOUT and Client.release_offer_state(self._offer) != "ended":
            raise SubletTimeoutError(outcome[1], _ETIMEDOUT)
        self._outcome = outcome
        self._hold.let_go()  # ended: resumed, or never released
        return outcome

    def withdraw(self) -> None:
        """Ends the offer if nobody has taken it; BusyError once taken (wait for it)."""
        Client.release_offer_withdraw(self._offer)
        outcome = self._outcome or self._wait_slice(-1)  # over now
        self._withdrawn = outcome[0] == _ECANCELED

    def close(self) -> None:
        """Withdraws the offer, or (taken) waits until it is over."""
        if self.done:
            return
        try:
            self.withdraw()
        except BusyError:
            self.wait()

    def __enter__(self) -> "ReleaseOffer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        name = f"{self.name!r}, " if self.name else ""
        return (f"<sublet.ReleaseOffer {name}offer {self.offer_id} of {self.what}: "
                f"{self.state}, {human(self.released_bytes)} released>")


def _offer_free(offer, hold: _Hold) -> None:
    Client.release_offer_free(offer)  # withdraws, or waits for the end
    hold.let_go()
