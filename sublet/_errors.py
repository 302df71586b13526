"""sublet's exception types and the SUBLET_E* codes they stand for: what every layer of the
package raises and catches, apart from the ctypes binding that turns a C library's negative
return code into one of them (_lib.check, with error_for here).

Floor: the lowest, beside _units and _torch: imports nothing of sublet (errno only), so that
any module may import it (tests/python/test_import_floors.py keeps it so). The names are
served as sublet.X (the public ones) and as sublet._lib.X too, for the modules that read
them there.
"""

from __future__ import annotations

import errno

# Mirrors SUBLET_ERRNO_MAP in include/sublet.h (tests/python/test_api_errors.py checks they
# agree).
ERROR_CODES: dict[str, int] = {
    "EINVAL": -errno.EINVAL,
    "ENOENT": -errno.ENOENT,
    "EPERM": -errno.EPERM,
    "EBUSY": -errno.EBUSY,
    "ENOMEM": -errno.ENOMEM,
    "ETIMEDOUT": -errno.ETIMEDOUT,
    "ECANCELED": -errno.ECANCELED,
    "ECONNREFUSED": -errno.ECONNREFUSED,
    "EACCES": -errno.EACCES,
    "EPIPE": -errno.EPIPE,
    "EIO": -errno.EIO,
    "E2BIG": -errno.E2BIG,
    "EPROTO": -errno.EPROTO,
    "ELEAK": -4001,
    "EVERSION": -4002,
    "EDEVICE": -4003,
    "EOWNERGONE": -4004,
    "EBORROWERDIED": -4005,
    "ENOOFFER": -4006,
    "EDAEMONDIED": -4007,
    "ENOHOSTMEM": -4008,
    "ENEED": -4009,
    "ENOTSUP": -errno.EOPNOTSUPP,
}
CODE_NAMES: dict[int, str] = {v: k for k, v in ERROR_CODES.items()}


class SubletError(RuntimeError):
    """An error reported by subletd or the client library. ``code`` is the SUBLET_E* code."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code

    @property
    def code_name(self) -> str | None:
        return CODE_NAMES.get(self.code) if self.code is not None else None


class LeakError(SubletError):
    """The borrower left allocations alive at the end of a loan. The kept data was restored
    all the same; ``leaks`` describes what was alive (see sublet.LeakedBlock)."""

    def __init__(self, message: str, code: int | None = None, leaks: list | None = None,
                 stats: object | None = None):
        super().__init__(message, code)
        self.leaks = leaks or []
        self.stats = stats


class InvalidArgumentError(SubletError, ValueError):
    """An argument subletd or libsublet refused (EINVAL): a size, a range, a name, an id of the
    wrong kind. A ValueError too, as PyTorch's own argument checks raise."""


class NoOfferError(SubletError):
    """No loan is on offer (by that name) on this device."""


class OwnerGoneError(SubletError):
    """The owner of the lent region went away during the loan."""


class BorrowerDiedError(SubletError):
    """The borrower died mid-loan. The owner's kept data was restored; ``stats`` has the loan."""

    def __init__(self, message: str, code: int | None = None, stats: object | None = None):
        super().__init__(message, code)
        self.stats = stats


class DaemonUnavailableError(SubletError):
    """subletd cannot be reached, or the connection to it was lost."""


class DaemonPermissionError(DaemonUnavailableError):
    """A subletd listens on the socket but this user may not open it (code EACCES): the
    message names the group to join. Never a stale socket: nothing starts a daemon beside it."""


class DaemonDiedError(DaemonUnavailableError):
    """subletd died during the loan. The owner's library restored the kept bytes itself from
    the host save area (the message says how many); ``stats`` has them (copied_in_bytes) when
    known. A restarted subletd serves new work: the package reconnects for it."""

    def __init__(self, message: str, code: int | None = None, stats: object | None = None):
        super().__init__(message, code)
        self.stats = stats


class ProtocolError(SubletError):
    """subletd and this library do not understand each other (protocol error or version)."""


class BusyError(SubletError):
    """The device or region is busy: one loan per device runs at a time."""


class VerifyError(SubletError):
    """verify found kept bytes that did not come back as they were before the loan.

    ``changed``: the (offset, length) byte ranges, relative to the start of the tensor's
    storage, whose checksum differs; ``described``: the same in the tensor's terms."""

    def __init__(self, message: str, changed: list[tuple[int, int]],
                 described: list[str] | None = None):
        super().__init__(message, None)
        self.changed = changed
        self.described = described or []


class SubletOutOfMemoryError(SubletError, MemoryError):
    """The loan (or the device) has no room for the allocation (code ENOMEM), or host memory
    ran out in subletd or this process (ENOHOSTMEM); also a builtin MemoryError, and, once
    sublet's torch side has loaded, a torch.OutOfMemoryError (join_torch_out_of_memory)."""


def join_torch_out_of_memory(torch_oom: type[BaseException]) -> None:
    """Makes SubletOutOfMemoryError a subclass of torch's out-of-memory error too, so that
    `except torch.OutOfMemoryError` catches sublet running out as it catches PyTorch. This
    module loads without torch (`sublet status`), so the class cannot name torch's at its
    definition; the modules that import torch call this before anything of sublet can run out.
    The class stays the one object (sublet.SubletOutOfMemoryError): only its bases grow."""
    if not issubclass(SubletOutOfMemoryError, torch_oom):
        SubletOutOfMemoryError.__bases__ = (*SubletOutOfMemoryError.__bases__, torch_oom)


class NeedTooLargeError(SubletOutOfMemoryError):
    """A release by need (sublet.release(..., need=N)) asked for more than the device's free
    memory and every page the release could give (code ENEED): refused before anything moved.
    The message gives the figures (the need, the free bytes, what the release could give, how
    much is short) and the fix: ask for less, release more with it, or free device memory."""


class SubletTimeoutError(SubletError, TimeoutError):
    """A wait timed out; it is also a builtin TimeoutError."""


_EXCEPTION_FOR_CODE: dict[int, type[SubletError]] = {
    ERROR_CODES["ELEAK"]: LeakError,
    ERROR_CODES["ENOOFFER"]: NoOfferError,
    ERROR_CODES["EOWNERGONE"]: OwnerGoneError,
    ERROR_CODES["EBORROWERDIED"]: BorrowerDiedError,
    ERROR_CODES["ECONNREFUSED"]: DaemonUnavailableError,
    ERROR_CODES["EACCES"]: DaemonPermissionError,
    ERROR_CODES["EPIPE"]: DaemonUnavailableError,
    ERROR_CODES["EDAEMONDIED"]: DaemonDiedError,
    ERROR_CODES["EPROTO"]: ProtocolError,
    ERROR_CODES["EVERSION"]: ProtocolError,
    ERROR_CODES["EBUSY"]: BusyError,
    ERROR_CODES["ETIMEDOUT"]: SubletTimeoutError,
    ERROR_CODES["ENOMEM"]: SubletOutOfMemoryError,
    ERROR_CODES["ENOHOSTMEM"]: SubletOutOfMemoryError,
    ERROR_CODES["ENEED"]: NeedTooLargeError,
    ERROR_CODES["EINVAL"]: InvalidArgumentError,
}


def error_for(code: int, message: str) -> SubletError:
    """The exception for a negative SUBLET_E* code (SubletError for codes without a subclass)."""
    cls = _EXCEPTION_FOR_CODE.get(code, SubletError)
    name = CODE_NAMES.get(code, str(code))
    return cls(f"{message} [{name}]" if message else f"sublet error {name}", code)
