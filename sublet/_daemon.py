"""Finding subletd for a device, or starting the user's own (the tmux model).

Order: $SUBLET_SOCKET when set (used as is); else a system daemon under /run/sublet/ serving
this GPU (cuda backend); else the user's own daemon for this GPU, in the user's directory:

    $XDG_RUNTIME_DIR/sublet/    or, without XDG_RUNTIME_DIR,    /tmp/sublet-UID/

a directory of the user's with mode 0700 (checked: another owner or wider mode is refused),
holding per GPU GPU-<uuid>.sock, .lock, .log and .pid (written and removed by the daemon: there
while it runs). The first sublet process of the user starts the daemon there; later ones find
it. Two processes starting at once take the .lock (flock) in turn, and the second finds the
first's daemon. The daemon is started in a session
of its own, not as our child (it outlives us; Ctrl-C in our terminal does not reach it), with
its output in the .log, and leaves by itself after $SUBLET_IDLE_EXIT seconds (default 600)
without a client or a region (subletd --idle-exit).

A system daemon's socket is named by the daemon's device number (gpuN.sock), which is not ours
when CUDA_VISIBLE_DEVICES differs: the daemon's GPU UUID decides, gpuN.sock being tried first.
The user's sockets are named by UUID, so they need no such check.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from . import _lib
from ._lib import DaemonPermissionError, DaemonUnavailableError, format_uuid

SYSTEM_SOCKET_DIR = Path("/run/sublet")
START_TIMEOUT_S = float(os.environ.get("SUBLET_DAEMON_START_TIMEOUT", "30"))
DEFAULT_IDLE_EXIT_S = 600


def requested_backend() -> str:
    """'memfd' when $SUBLET_BACKEND says so or there is no usable GPU, else 'cuda'."""
    backend = os.environ.get("SUBLET_BACKEND")
    if backend:
        if backend not in ("cuda", "memfd"):
            raise ValueError(f"SUBLET_BACKEND={backend!r}: use 'cuda' or 'memfd'")
        return backend
    import torch
    return "cuda" if torch.cuda.is_available() else "memfd"


def connect(device: int, backend: str) -> _lib.Client:
    """A connection to the daemon of this device index."""
    explicit = os.environ.get("SUBLET_SOCKET")
    if explicit:
        return _lib.Client.open(explicit)
    if backend == "cuda":
        client = _system_daemon(device)
        if client is not None:
            return client
    return _user_daemon(device, backend)


def _system_daemon(device: int) -> _lib.Client | None:
    """A connection to the system daemon serving this process's CUDA device `device`; None
    when none does. A system socket we may not open may be this GPU's daemon: its denial is
    raised rather than a daemon of ours started beside it (two daemons lending one GPU)."""
    ours = SYSTEM_SOCKET_DIR / f"gpu{device}.sock"
    uuid = _cuda_uuid(device)
    # Without our GPU's UUID only gpuN.sock can be trusted to be it.
    others = sorted(SYSTEM_SOCKET_DIR.glob("gpu*.sock")) if uuid is not None else []
    denied: DaemonPermissionError | None = None
    for path in [ours] + [p for p in others if p != ours]:
        if not path.exists():
            continue
        try:
            client = _open_live(path)
        except DaemonPermissionError as e:
            denied = denied or e
            continue
        if client is None:
            continue
        if uuid is None or client.info.device_uuid == format_uuid(uuid):
            return client
        client.close()
    if denied is not None:
        raise DaemonPermissionError(
            f"{denied}; sublet starts no daemon of yours while a system one may serve this "
            f"GPU", denied.code) from None
    return None


def _open_live(path: Path) -> _lib.Client | None:
    """A connection to the daemon at path; None when nobody answers there (no socket, or a
    stale one). A denied socket (DaemonPermissionError) is raised: a daemon lives there."""
    try:
        return _lib.Client.open(str(path))
    except DaemonPermissionError:
        raise
    except DaemonUnavailableError:
        return None


def _cuda_uuid(device: int) -> bytes | None:
    """The 16-byte UUID of this process's CUDA device, or None when torch cannot say."""
    try:
        import torch
        return bytes(torch.cuda.get_device_properties(device).uuid.bytes)
    except (AttributeError, RuntimeError, TypeError, ValueError, AssertionError):
        return None


# --------------------------------------------------------------------------- the user's daemon

def device_uuid(device: int, backend: str) -> bytes | None:
    """The UUID the daemon of this device will report: the GPU's, or the memfd backend's fixed
    one ("sublet-memfd" and the device number, common/device_memfd.c)."""
    if backend == "memfd":
        return b"sublet-memfd" + device.to_bytes(4, "big")
    return _cuda_uuid(device)


def user_dir_path() -> Path:
    """Where the user's daemons live (whether the directory exists or not)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime, "sublet") if runtime else Path("/tmp", f"sublet-{os.getuid()}")


def user_sockets() -> list[Path]:
    """The sockets of the user's daemons, running or stale (for `sublet status`)."""
    try:
        return sorted(user_dir().glob("*.sock")) if user_dir_path().is_dir() else []
    except DaemonUnavailableError:
        return []


def user_dir() -> Path:
    """The user's directory for their daemons, made on first use, checked every time."""
    path = user_dir_path()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise DaemonUnavailableError(
            f"cannot make {path} for your subletd: {e.strerror} (is $XDG_RUNTIME_DIR "
            f"right? unset it to use /tmp, or set $SUBLET_SOCKET)") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise DaemonUnavailableError(
            f"{path} must be a directory of uid {os.getuid()} with mode 0700 (it is "
            f"{'a directory' if stat.S_ISDIR(st.st_mode) else 'not a directory'} of uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}): someone else may be able to "
            f"reach your daemon through it. Remove it, or set $XDG_RUNTIME_DIR or "
            f"$SUBLET_SOCKET")
    return path


def user_socket(device: int, backend: str) -> Path:
    """Where the user's daemon for this device listens (whether it runs or not)."""
    uuid = device_uuid(device, backend)
    name = format_uuid(uuid) if uuid is not None else f"cuda{device}"
    return user_dir() / f"{name}.sock"


def _user_daemon(device: int, backend: str) -> _lib.Client:
    sock = user_socket(device, backend)
    client = _open_live(sock)
    if client is not None:
        return client
    with _locked(sock.with_suffix(".lock")):
        # Whoever held the lock before us may have started it.
        client = _open_live(sock)
        return client if client is not None else _start(device, backend, sock)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, even if we are killed
        yield
    finally:
        os.close(fd)


def idle_exit_seconds() -> float:
    value = os.environ.get("SUBLET_IDLE_EXIT", str(DEFAULT_IDLE_EXIT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1
    if not seconds > 0:
        raise ValueError(f"SUBLET_IDLE_EXIT={value!r}: give the seconds the daemon stays "
                         f"without a client, such as 600")
    return seconds


def _start(device: int, backend: str, sock: Path) -> _lib.Client:
    """Starts the user's daemon at sock (the caller holds its lock); returns a connection."""
    binary = _lib.find_native("subletd", "SUBLETD")
    # The daemon writes the .pid once it holds the socket, and removes it when it leaves (an
    # idle exit, SIGTERM): a .pid we wrote would outlive it and name a pid reused by another.
    argv = [str(binary), "--device", str(device), "--backend", backend, "--socket", str(sock),
            "--pid-file", str(sock.with_suffix(".pid")), "--idle-exit", f"{idle_exit_seconds():g}"]
    log = sock.with_suffix(".log")
    with open(log, "wb") as out:
        # sh starts it in the background and exits: the daemon is nobody's child but init's.
        shell = subprocess.run(["/bin/sh", "-c", '"$@" >&2 & echo $!', "sublet", *argv],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out,
                               start_new_session=True, check=True)
    pid = int(shell.stdout)
    return _wait_until_answering(sock, pid, log, " ".join(argv))


def _alive(pid: int) -> bool:
    """Is pid running (not exited, not a zombie that nobody has reaped yet)?"""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _log_tail(log: Path, limit: int = 4000) -> str:
    try:
        return log.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _wait_until_answering(sock: Path, pid: int, log: Path, command: str) -> _lib.Client:
    """Waits for the new daemon to answer (its socket exists a moment before it listens)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        with contextlib.suppress(DaemonUnavailableError):
            return _lib.Client.open(str(sock))
        if not _alive(pid):
            raise DaemonUnavailableError(
                f"subletd exited at start ({command}). Its log, {log}:\n{_log_tail(log)}")
        if time.monotonic() > deadline:
            raise DaemonUnavailableError(
                f"subletd (pid {pid}) did not answer on {sock} within {START_TIMEOUT_S:.0f} s "
                f"({command}; $SUBLET_DAEMON_START_TIMEOUT sets the limit). Its log, {log}:\n"
                f"{_log_tail(log)}")
        time.sleep(0.01)
