"""The process's one connection to subletd per device and backend, made on first use.

A connection is shared by everything the process does on that device (its regions, its loans):
the daemon's books are per client. The connection itself (sublet._lib.Client) is the ctypes
wrapper; this module only decides which one serves a device.
"""

from __future__ import annotations

import os
import threading

from . import _daemon
from ._lib import Client, DaemonInfo, LoanStats, ReturnResult

__all__ = ["Client", "DaemonInfo", "LoanStats", "ReturnResult", "client_for"]

_clients: dict[tuple[str, int], Client] = {}
_clients_lock = threading.Lock()


def client_for(backend: str, device_index: int) -> Client:
    """The process's connection to the daemon of this device, made on first use, and made
    anew when the daemon died (or closed it): a restarted daemon serves new work. The dead
    connection stays with what still uses it (regions, a loan ending) and is never reused."""
    with _clients_lock:
        key = (backend, device_index)
        if key in _clients and not _clients[key].connected:
            del _clients[key]
        if key not in _clients:
            _clients[key] = _daemon.connect(device_index, backend)
        return _clients[key]


def _forget_after_fork() -> None:
    _clients.clear()  # the parent's connections are not the child's to use


os.register_at_fork(after_in_child=_forget_after_fork)
