"""The `subletd` console script of the wheel: runs the daemon that the package carries
(sublet/_native/subletd), with the arguments given, as the same process (exec).

`pip install sublet-*.whl` puts subletd inside the package, not on PATH; this command, which
pip installs beside `sublet` (the venv's bin/ or ~/.local/bin), makes `subletd --help` work by
name. It runs the package's own binary, never $SUBLETD (which may name this very command).
"""

from __future__ import annotations

import os
import sys

from ._lib import _PACKAGE_DIR, _REPO_ROOT


def binary() -> str:
    """The package's subletd: the wheel's, else a checkout's build/ (running from source)."""
    for path in (_PACKAGE_DIR / "_native" / "subletd", _REPO_ROOT / "build" / "subletd"):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise FileNotFoundError(
        f"subletd not found in {_PACKAGE_DIR / '_native'}: this sublet was not installed from "
        f"a wheel (pip install .) nor built (cmake -S . -B build -G Ninja && cmake --build build)")


def main() -> int:
    try:
        path = binary()
    except FileNotFoundError as e:
        print(f"subletd: {e}", file=sys.stderr)
        return 127
    os.execv(path, ["subletd", *sys.argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
