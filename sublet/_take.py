"""sublet.take(): the scheduler's side of a release offer (sublet.offer(..., release=True)).

A scheduler (an RL orchestrator, a job runner) decides when an inference engine's paused memory
goes back to the CUDA driver, for a trainer that calls nothing of sublet, and when it must come
back. It takes the engine's release offer: the engine's own library releases the memory (the
scheduler maps nothing), and giving it back makes the engine's library resume it. Nothing here
imports torch: on the memfd backend (and with a device index) a scheduler needs only this
package; a CUDA device given as None or "cuda" asks torch which one is meant.

By need (issue 42): take(need=N) makes the owner release only what N takes beyond the device's
free memory (as sublet.release(need=N) would); Taken.need(M) asks for more later, M the
taker's need in all, without anything resumed; giving back resumes everything at once.
"""

from __future__ import annotations

import os
import time

from ._client import client_for
from ._lib import (Client, DaemonUnavailableError, NeedTooLargeError, NoOfferError,
                   OwnerGoneError, ReleaseStats, SubletError, SubletTimeoutError)
from ._units import check_need, human
from ._wait import in_slices


def _client_of(device: object) -> Client:
    """The connection to the daemon of `device` (as sublet.info takes it); the memfd
    backend's without torch."""
    if os.environ.get("SUBLET_BACKEND") == "memfd" and device in (None, "cpu"):
        return client_for("memfd", 0)
    from ._memory import resolve_device
    return resolve_device(device)[1]  # type: ignore[arg-type]


class Taken:
    """sublet.take(): a scheduler's hold on memory that another process released for it.
    Entering takes the offer and waits until its owner has released the memory (now the
    driver's: any process may allocate it, one that calls nothing of sublet included);
    leaving gives it back and waits until the owner has resumed it."""

    def __init__(self, name: str | None = None, device: object = None,
                 timeout: float | None = None, give_back_timeout: float | None = None,
                 need: int | None = None):
        check_need(need)
        self.name = name
        self.need_bytes = need                          # the taker's need in all (None: all)
        self._want_device = device
        self._timeout, self._give_back_timeout = timeout, give_back_timeout
        self._client: Client | None = None
        self.offer_id = 0
        self.stats: ReleaseStats | None = None          # the owner's release
        self.resumed_stats: ReleaseStats | None = None  # the owner's resume, at the end
        self._holding = False

    @property
    def released_bytes(self) -> int:
        """Bytes the owner gave back to the driver for this taker."""
        if self.stats is None or self._client is None:
            return 0
        return self.stats.released_pages * self._client.info.page_size

    @property
    def active(self) -> bool:
        return self._holding

    def __enter__(self) -> "Taken":
        if self._client is not None:
            raise RuntimeError("this take was already used in a `with` block: call "
                               "sublet.take() again for the next")
        client = self._client = _client_of(self._want_device)
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        what = f"named {self.name!r}" if self.name else "(any)"
        self.offer_id = in_slices(lambda ms: client.take(self.name, ms, self.need_bytes),
                                  self._timeout,
                                  f"no release offer {what} was on offer within "
                                  f"{self._timeout} s", NoOfferError)
        self._holding = True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            _, self.stats = in_slices(lambda ms: client.take_wait(self.offer_id, ms), left,
                                      f"the owner of release offer {self.offer_id} did not "
                                      f"release within {self._timeout} s")
        except NeedTooLargeError:  # nothing released: the offer is on offer again, not ours
            self._holding = False
            raise
        except BaseException:
            self._abandon()
            raise
        return self

    def need(self, nbytes: int, timeout: float | None = None) -> ReleaseStats:
        """More of an offer taken by need (sublet.take(..., need=N)): the taker now needs
        `nbytes` of device memory in all, not in addition. Not more than need_bytes: nothing
        happens. Else the owner's library releases more of its live release, as
        Release.need(nbytes) would (subletd counts the free bytes again; only the pages the
        increase takes beyond them go, of those that stayed, the cheapest to give), nothing
        resumed; giving back resumes everything at once. Waits up to `timeout`
        seconds (None: as long as it takes; SubletTimeoutError: it goes on, call again with
        the same need to wait for it). Returns the release's stats in all (as .stats).
        NeedTooLargeError with the figures when the pages that stay cannot give it, the
        release as it was and still held; OwnerGoneError: the owner went (nothing held)."""
        check_need(nbytes)
        if self.need_bytes is None:
            raise ValueError(f"release offer {self.offer_id} was taken without a need: its "
                             f"owner released every page it could already")
        if not self._holding:
            raise RuntimeError("nothing is held: take the offer first (in a `with` block)")
        assert self.stats is not None
        if nbytes <= self.need_bytes:
            return self.stats
        client = self._held_client()
        try:
            if client.take_more(self.offer_id, nbytes) == "more":
                _, self.stats = in_slices(lambda ms: client.take_wait(self.offer_id, ms),
                                          timeout, f"the owner of release offer "
                                          f"{self.offer_id} did not release more within "
                                          f"{timeout} s: call need({nbytes}) again to wait")
        except (OwnerGoneError, DaemonUnavailableError):
            self._holding = False  # the owner or subletd went: nothing is held
            raise
        self.need_bytes = nbytes
        return self.stats

    def _abandon(self) -> None:
        """Gives the offer back without waiting (entering failed): the owner resumes."""
        self._holding = False
        try:
            self._held_client().give_back(self.offer_id)
        except SubletError:
            pass  # the owner or the daemon went: nothing is held

    def _held_client(self) -> Client:
        if self._client is None:
            raise RuntimeError("nothing was taken: use sublet.take() in a `with` block")
        return self._client

    def give_back(self, timeout: float | None = None) -> ReleaseStats:
        """Gives the memory back and waits (timeout: seconds, None: as long as it takes)
        until the owner has resumed it; returns the resume's stats. SubletTimeoutError: it
        is not back yet (the owner's resume fails while the memory is still taken: free it;
        call again). OwnerGoneError: the owner went (its memory went with it)."""
        if not self._holding:
            if self.resumed_stats is None:
                raise RuntimeError("nothing is held: the offer was not taken, or was given back")
            return self.resumed_stats
        client = self._held_client()
        why = ["is the memory still taken?"]

        def wait(ms: int) -> tuple[str, ReleaseStats]:
            try:
                return client.take_wait(self.offer_id, ms)
            except SubletTimeoutError as error:  # the daemon says why: the owner's trouble
                why[0] = str(error)
                raise

        try:
            client.give_back(self.offer_id)
            _, stats = in_slices(wait, timeout, "")
        except SubletTimeoutError as error:
            raise SubletTimeoutError(f"the owner of release offer {self.offer_id} did not "
                                     f"resume within {timeout} s: {why[0]}",
                                     error.code) from None
        except SubletError:
            self._holding = False
            raise
        self._holding = False
        self.resumed_stats = stats
        return stats

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._holding:
            return
        try:
            self.give_back(self._give_back_timeout)
        except SubletError as error:
            if exc is None:
                raise
            if hasattr(exc, "add_note"):
                exc.add_note(f"giving the memory back: {error}")

    def __repr__(self) -> str:
        name = f" {self.name!r}" if self.name else ""
        state = "holding" if self._holding else "not holding"
        need = f" by need of {human(self.need_bytes)}" if self.need_bytes is not None else ""
        return (f"<sublet.Taken{name} offer {self.offer_id}: {state}, "
                f"{human(self.released_bytes)} released{need}>")


def take(name: str | None = None, device: object = None,
         timeout: float | None = None, give_back_timeout: float | None = None,
         need: int | None = None) -> Taken:
    """Takes, in a `with` block, a release offer (sublet.offer(..., release=True)) of another
    process on `device` (default: the current CUDA device): the one named `name`, or the
    oldest this user may take (the owner's own user, root, or the daemon's --allow-group).
    Entering waits up to `timeout` seconds (None: forever) for the offer and its release
    (NoOfferError, SubletTimeoutError); inside, the memory is the CUDA driver's, for any
    process; leaving gives it back and waits (give_back_timeout) until the owner has it back.
    Taken.released_bytes and .stats say what the owner released. name: as for
    sublet.offer() (None: any; `""` is refused, EINVAL).

    need: bytes of device memory the taker needs (None: the owner releases everything). The
    owner's library releases by it as sublet.release(..., need=need) would: only the pages
    the need takes beyond the device's free bytes, the cheapest to give.
    NeedTooLargeError (the figures in its message) when the offer cannot give it: nothing
    released, the offer on offer again. Taken.need(N) asks for more later (N in all). An owner
    or a subletd older than this: SubletError (ENOTSUP) naming which to upgrade."""
    return Taken(name, device, timeout, give_back_timeout, need)
