"""sublet.take(): the scheduler's side of a release offer (sublet.offer(..., release=True)).

A scheduler (an RL orchestrator, a job runner) decides when an inference engine's paused memory
goes back to the CUDA driver, for a trainer that calls nothing of sublet, and when it must come
back. It takes the engine's release offer: the engine's own library releases the memory (the
scheduler maps nothing), and giving it back makes the engine's library resume it. Nothing here
imports torch: on the memfd backend (and with a device index) a scheduler needs only this
package; a CUDA device given as None or "cuda" asks torch which one is meant.
"""

from __future__ import annotations

import os
import time

from ._client import client_for
from ._lib import Client, NoOfferError, ReleaseStats, SubletError, SubletTimeoutError
from ._units import human
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
                 timeout: float | None = None, give_back_timeout: float | None = None):
        self.name = name
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
        self.offer_id = in_slices(lambda ms: client.take(self.name, ms), self._timeout,
                                  f"no release offer {what} was on offer within "
                                  f"{self._timeout} s", NoOfferError)
        self._holding = True
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            _, self.stats = in_slices(lambda ms: client.take_wait(self.offer_id, ms), left,
                                      f"the owner of release offer {self.offer_id} did not "
                                      f"release within {self._timeout} s")
        except BaseException:
            self._abandon()
            raise
        return self

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
        return (f"<sublet.Taken{name} offer {self.offer_id}: {state}, "
                f"{human(self.released_bytes)} released>")


def take(name: str | None = None, device: object = None,
         timeout: float | None = None, give_back_timeout: float | None = None) -> Taken:
    """Takes, in a `with` block, a release offer (sublet.offer(..., release=True)) of another
    process on `device` (default: the current CUDA device): the one named `name`, or the
    oldest this user may take (the owner's own user, root, or the daemon's --allow-group).
    Entering waits up to `timeout` seconds (None: forever) for the offer and its release
    (NoOfferError, SubletTimeoutError); inside, the memory is the CUDA driver's, for any
    process; leaving gives it back and waits (give_back_timeout) until the owner has it back.
    Taken.released_bytes and .stats say what the owner released. name: as for
    sublet.offer() (None: any; `""` is refused, EINVAL)."""
    return Taken(name, device, timeout, give_back_timeout)
