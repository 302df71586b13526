"""The need of a drop-in's pause or sleep (issue 42): the bytes of device memory the taker needs,
from the call's need= or, for stacks whose framework code makes the call and passes nothing
(SGLang, slime, verl, TRL, OpenRLHF), from $SUBLET_RELEASE_NEED, read at each call.

A pause (sleep) by need releases, tag by tag, only the pages the rest of the need takes beyond
the device's free memory (sublet.release(..., need=N): subletd counts the free bytes at each
release, so what an earlier tag gave counts for the next). A tag that cannot give that much
alone is released as without a need (all of it), and the next pause or tag goes on by the same
need: so SGLang's pause("kv_cache"), pause("weights"), pause("cuda_graph") under one need
release the KV cache first, then only what is still missing. docs/compat-torch-memory-saver.md
and docs/compat-vllm.md say it for users.
"""

from __future__ import annotations

import os

from .._units import parse_bytes

ENV = "SUBLET_RELEASE_NEED"


def need_for_call(need: int | str | None) -> int | None:
    """The need of this call: need= if given (an int of bytes, or a size as $SUBLET_RELEASE_NEED
    takes it), else $SUBLET_RELEASE_NEED's, else None (release everything, as the original)."""
    if need is not None:
        return check_need(need, "need=")
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise ValueError(f"${ENV}={os.environ[ENV]!r}: {exc}; it is the bytes of device memory "
                         f"the taker needs at each pause/sleep: set it to e.g. 24GiB, or unset "
                         f"it to release everything") from None


def check_need(need: int | str, what: str = "need=") -> int:
    """An int of bytes >= 0 (a str is parsed as a size); ValueError naming the fix."""
    if isinstance(need, str):
        try:
            return parse_bytes(need)
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
    if isinstance(need, bool) or not isinstance(need, int) or need < 0:
        raise ValueError(f"{what} is the bytes of device memory the taker needs (an int >= 0 "
                         f"or a size such as '24GiB'), or None to release everything; not "
                         f"{need!r}")
    return need
