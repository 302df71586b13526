"""Lending that waits its turn for the device, with Ctrl-C still working.

One loan per device: while another runs, the daemon keeps a line of waiting Lends and serves
them in the order they came. Asking again in slices would lose the place in that line, so the
Lend is sent once, with the whole timeout. It waits in a thread, the caller's thread waiting
for it in short slices; on Ctrl-C (or any exception there) the Lend is cancelled in the daemon
(sublet_cancel), and if it was lent all the same (it won the race) the loan is given back,
before the exception goes on: after Ctrl-C nothing is lent.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

from ._client import Client
from ._lib import (ERROR_CODES, BusyError, NoOfferError, RegionHandle, SubletError,
                   SubletTimeoutError)

_SLICE_S = 0.2
_SLICE_MS = 200

T = TypeVar("T")


def in_slices(call: Callable[[int], T], timeout: float | None, timeout_message: str,
              timeout_error: type[SubletError] | None = None) -> T:
    """Calls call(timeout_ms) with timeouts of at most 0.2 s until it stops timing out or
    `timeout` seconds (None: forever) have passed, then raises timeout_error (default
    SubletTimeoutError; NoOfferError takes code ENOOFFER) with timeout_message: Ctrl-C lands
    between slices. For waits that lose nothing by being asked again (TakeWait, a release
    offer's end); a Lend, which holds a place in line, waits with _waiting instead."""
    error = timeout_error or SubletTimeoutError
    code = ERROR_CODES["ENOOFFER" if error is NoOfferError else "ETIMEDOUT"]
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    while True:
        left = _SLICE_MS if deadline is None else int(max(0.0, deadline - time.monotonic()) * 1000)
        if deadline is not None and timeout is not None and timeout > 0:
            left = max(1, left)  # a positive timeout's last slice asks 1 ms, not "at once"
        try:
            return call(min(left, _SLICE_MS))
        except SubletTimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise error(timeout_message, code) from None


def timeout_ms(timeout: float | None) -> int:
    """A timeout in seconds (None: forever) as the daemon takes it (-1: forever)."""
    if timeout is None:
        return -1
    if timeout < 0:
        raise ValueError(f"a timeout is seconds from 0 (at once), or None (forever), not "
                         f"{timeout}")
    return max(1, int(timeout * 1000)) if timeout > 0 else 0


def lend(client: Client, region: RegionHandle, ranges: Any, name: str | None,
         timeout: float | None, pinned: Any = None) -> tuple[int, bytes]:
    """Offers the region, waiting up to timeout seconds for the device: (loan id, token).
    pinned: byte ranges of pages the loan never touches (Client.lend), or None."""
    return _lend(lambda ms: client.lend(region, ranges, name, ms, pinned), client, timeout,
                 lambda lent: _withdraw(client, lent[0]))


def lend_local(client: Client, region: RegionHandle, ranges: Any,
               timeout: float | None, pinned: Any = None) -> int:
    """Lends the region to this client, waiting up to timeout seconds: the loan id."""
    return _lend(lambda ms: client.lend_local(region, ranges, ms, pinned), client, timeout,
                 lambda loan: _give_back(client, loan))


def _lend(call: Callable[[int], T], client: Client, timeout: float | None,
          undo: Callable[[T], None]) -> T:
    ms = timeout_ms(timeout)
    try:
        return call(0)  # the device is free most often: no thread, no wait
    except BusyError:
        if ms == 0:
            raise
    return _waiting(lambda: call(ms), client, undo)


def _waiting(call: Callable[[], T], client: Client, undo: Callable[[T], None]) -> T:
    done = threading.Event()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # handed to the caller's thread
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="sublet-lend-wait", daemon=True).start()
    try:
        while not done.wait(_SLICE_S):
            pass
    except BaseException:
        # Cancelled again each slice until the call is over: an interrupt that comes before
        # the thread has sent its request finds nothing waiting to cancel, and the request,
        # sent after it, would then wait with no end.
        _cancel(client)
        while not done.wait(_SLICE_S):
            _cancel(client)
        if "value" in box:
            undo(box["value"])
        raise
    if "error" in box:
        raise box["error"]
    return box["value"]


def _cancel(client: Client) -> None:
    try:
        client.cancel()
    except SubletError:
        pass  # a daemon too old to cancel: the Lend ends by its timeout


def _withdraw(client: Client, loan_id: int) -> None:
    try:
        client.withdraw(loan_id)
    except SubletError:  # a waiting borrower took it at once: it must come back first
        client.reclaim(loan_id, -1)


def _give_back(client: Client, loan_id: int) -> None:
    client.return_loan(force=True)
    client.reclaim(loan_id, -1)
