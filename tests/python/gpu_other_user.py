"""Helpers of the GPU tests whose borrower is another user (test_gpu_fresh.py,
test_gpu_fresh_full.py): a cuda subletd that uid MEMBER (in group GROUP) may reach, and the
start of that borrower's script; the owner and borrower processes of a test, and their end.

The borrower runs no torch (whose lazy imports another uid may not read): libsublet and the
driver through ctypes, loaded as root, then it becomes the member of the allowed group. Its
arguments: uid, gid, the daemon's page size, the loan's name. BORROWER_HEAD connects, borrows
by name, allocates the whole window a page at a time (ptrs), and makes the device's primary
context current (dev, ctx); a test appends what its borrower does next."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Iterator

from conftest import CHILD_ENV

MEMBER, GROUP = 3000, 4242

BORROWER_HEAD = textwrap.dedent("""
    import ctypes, os, sys
    from ctypes import byref, c_int, c_size_t, c_ubyte, c_uint64, c_ulonglong, c_void_p
    sl = ctypes.CDLL(os.environ["SUBLET_LIB"])
    cu = ctypes.CDLL("libcuda.so.1")
    os.setgroups([int(sys.argv[2])]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
    sl.sublet_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(c_void_p)]
    sl.sublet_borrow.argtypes = [c_void_p, c_uint64, c_void_p, ctypes.c_char_p, c_int]
    sl.sublet_alloc.argtypes = [c_void_p, c_uint64, ctypes.POINTER(c_void_p)]
    sl.sublet_free.argtypes = [c_void_p, c_void_p]
    sl.sublet_return.argtypes = [c_void_p, c_int, c_void_p, c_void_p, c_size_t, c_void_p]
    sl.sublet_disconnect.argtypes = [c_void_p]
    sl.sublet_last_error.restype = ctypes.c_char_p
    def ok(rc, what):
        if rc != 0:
            sys.exit(f"{what}: error {rc} ({sl.sublet_last_error().decode()})")
    page = int(sys.argv[3])                      # the daemon's page size
    c = c_void_p()
    ok(sl.sublet_connect(os.environ["SUBLET_SOCKET"].encode(), byref(c)), "sublet_connect")
    ok(sl.sublet_borrow(c, 0, None, sys.argv[4].encode(), 120000), "sublet_borrow")
    ptrs, p = [], c_void_p()
    while sl.sublet_alloc(c, page, byref(p)) == 0:    # the whole window, a page at a time
        ptrs.append(p.value)
    dev, ctx = c_int(), c_void_p()
    ok(cu.cuInit(0) or cu.cuDeviceGet(byref(dev), 0) or
       cu.cuDevicePrimaryCtxRetain(byref(ctx), dev) or cu.cuCtxSetCurrent(ctx), "context")
""")


def borrower_args(script: str, page: int, name: str) -> list[str]:
    """The borrower's command line (after the interpreter): BORROWER_HEAD + script."""
    return ["-c", BORROWER_HEAD + script, str(MEMBER), str(GROUP), str(page), name]


PIPES = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_owner(script: str, sock: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    """The owner process (`script`, on the daemon at sock, its stdio piped) and its
    environment."""
    env = dict(os.environ, **CHILD_ENV, SUBLET_SOCKET=str(sock))
    return subprocess.Popen([sys.executable, "-c", script], env=env, **PIPES), env


def offered(owner: subprocess.Popen) -> list[str]:
    """The words of the owner's first line, which says it offered."""
    line = owner.stdout.readline()
    assert line.startswith("offered"), owner.stderr.read()
    return line.split()


def start_borrower(script: str, page: int, name: str, env: dict[str, str],
                   libsublet: Path) -> subprocess.Popen:
    """The other user's borrower (BORROWER_HEAD + script), its stdio piped."""
    return subprocess.Popen([sys.executable, *borrower_args(script, page, name)],
                            env=dict(env, HOME="/tmp", SUBLET_LIB=str(libsublet)),
                            cwd="/", **PIPES)


def end(*processes: subprocess.Popen | None) -> None:
    """Kills those of the processes that still run."""
    for p in processes:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


@contextlib.contextmanager
def other_user_daemon(subletd: Path, *args: str) -> Iterator[tuple[Path, Path]]:
    """A cuda subletd on device 0 that GROUP may reach (--allow-group), with args; yields its
    socket (mode 0666, in a directory others may enter) and its log file."""
    directory = Path(tempfile.mkdtemp(prefix="sublet-other-user-"))
    directory.chmod(0o755)
    sock, log = directory / "gpu.sock", directory / "subletd.log"
    with open(log, "w") as err:
        daemon = subprocess.Popen([str(subletd), "--device", "0", "--socket", str(sock),
                                   "--allow-group", str(GROUP), *args], stderr=err, text=True)
    try:
        for _ in range(600):
            if sock.exists() or daemon.poll() is not None:
                break
            time.sleep(0.05)
        assert sock.exists(), log.read_text()
        sock.chmod(0o666)
        yield sock, log
    finally:
        daemon.terminate()
        daemon.wait(timeout=60)
