"""The vLLMs sublet's sleep mode is tested with, and the check that refuses any other.

TESTED is the one list: CI installs each of these vLLMs (tests/vllm-env) and runs the plug-in
tests and vLLM's own Worker and backend code against sublet with each
(tests/python/test_compat_vllm_versions.py), and docs/compat-vllm.md's support table must name
the same versions (a test reads it). A vLLM outside the list is refused where sublet would
take over its memory (the switch, the backend, the worker), never run silently.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# Which framework pins which: docs/compat-vllm.md's support table (kept equal to this list by
# test_compat_vllm_switch.py).
TESTED: tuple[str, ...] = (
    "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
    "0.31.0", "0.32.0", "0.33.0", "0.34.0",
)
ALLOW_ENV = "SUBLET_VLLM_ALLOW_UNTESTED"


class UntestedVLLMError(RuntimeError):
    """The installed vLLM is not one sublet's sleep mode was tested with."""


def installed() -> str | None:
    """The installed vLLM's version (its local part, +cu130 and the like, left out), or None
    when vLLM is not installed."""
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown")).split("+", 1)[0]


def check(version: str | None = None, what: str = "sublet's sleep mode") -> str:
    """Returns the version (default: the installed vLLM's) if it is tested; else raises
    UntestedVLLMError naming the tested ones, unless SUBLET_VLLM_ALLOW_UNTESTED=1 is set, when
    it logs a warning and returns it."""
    version = installed() if version is None else version
    if version is None:
        raise UntestedVLLMError(f"{what} needs vLLM, which is not installed: pip install one "
                                f"of vllm=={', =='.join(TESTED)}")
    if version in TESTED:
        return version
    message = (f"{what} is tested with vLLM {', '.join(TESTED)}, not with the installed "
               f"{version}: install one of those (pip install vllm=={_nearest(version)})")
    if os.environ.get(ALLOW_ENV) == "1":
        logger.warning("sublet: %s; running anyway, as %s=1 asks: check every level's sleep "
                       "and wake with your engine before you rely on it", message, ALLOW_ENV)
        return version
    raise UntestedVLLMError(f"{message}, or set {ALLOW_ENV}=1 to run it untested at your own "
                            f"risk; or leave sublet out of vLLM's sleep (SUBLET_VLLM=0)")


def _nearest(version: str) -> str:
    """The tested version closest below `version` (the oldest if none is), for the message."""
    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) if p.isdigit() else -1 for p in v.split(".")[:3])
    below = [v for v in TESTED if key(v) <= key(version)]
    return max(below, key=key) if below else min(TESTED, key=key)
