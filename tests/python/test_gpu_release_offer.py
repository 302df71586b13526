"""GPU tests of release offers (docs/design/release.md, "Release offers"): an engine process
offers its pool's memory (sublet.offer(tag, keep=..., release=True)), a scheduler process
takes it (sublet.take), and while taken a third process that calls nothing of sublet (plain
PyTorch, or cudaMalloc through the CUDA runtime as NCCL allocates) allocates the memory that
was released; given back, every kept bit is back in the engine. Skipped without CUDA.

What each test would catch: memory that is not really the driver's while taken (the plain
process's allocation fails during the take as it did before it), a kept bit lost or put back
in the wrong place after someone else wrote over the released memory (bits compared in the
engine after every loan, with a new keep each time), an engine that does not resume when its
scheduler is SIGKILLed.

    python3 -m pytest tests/python/test_gpu_release_offer.py -m gpu -s    # -s: the figures
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import sublet

from conftest import CHILD_ENV
from test_gpu import cuda_daemon, page, settled_free_memory  # noqa: F401 (fixtures)
from test_gpu_release import Consumer
from gpu_memory import free_now

GiB, MiB = 1024 ** 3, 1024 ** 2
LAYERS, BLOCKS = 64, 1024            # (2, 1024, 16, 8, 128) bf16 each: 64 KiB blocks, 4 GiB
BLOCK = 64 * 1024
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]

# The engine: a pool tag of LAYERS per-layer caches filled with noise; `rounds` loans, each
# offering the tag for release with a new live set of `live` blocks and writing one of them
# first (the engine's work between loans). Says "offered <round>", then after each loan
# "round <i> <outcome> <every kept bit back>" (outcome: ok, or the error's class name).
ENGINE = textwrap.dedent("""
    import sys, torch, sublet
    tag, rounds, live, layers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    with sublet.pool(tag):
        caches = [torch.empty(2, 1024, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
                  for _ in range(layers)]
    for c in caches:                       # filled outside the pool: the tag holds only these
        raw = c.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda"))
    g = torch.Generator().manual_seed(7)
    for round_ in range(rounds):
        ids = torch.randperm(1024, generator=g)[:live].sort().values
        for c in caches:
            raw = c[:, ids[0]].view(torch.int16)
            raw.copy_(torch.randint(-2**15, 2**15, raw.shape, dtype=torch.int16, device="cuda"))
        before = [c[:, ids].view(torch.int16).clone() for c in caches]
        torch.cuda.synchronize()
        off = sublet.offer(tag, keep=sublet.blocks(caches, ids, dim=1), name=tag, release=True)
        print("offered", round_, flush=True)
        try:
            off.wait(timeout=600)
            outcome = "ok"
        except sublet.SubletError as e:
            outcome = type(e).__name__
        same = all(torch.equal(c[:, ids].view(torch.int16), b) for c, b in zip(caches, before))
        print("round", round_, outcome, same, flush=True)
        del before
        torch.cuda.empty_cache()
""")

# A scheduler in a process of its own: takes the offer, says "taken <bytes>", sleeps (to be
# SIGKILLed).
SCHEDULER = textwrap.dedent("""
    import sys, time, sublet
    with sublet.take(name=sys.argv[1], timeout=600) as t:
        print("taken", t.released_bytes, flush=True)
        time.sleep(600)
""")


class Engine:
    def __init__(self, tag: str, rounds: int, live: int):
        self.proc = subprocess.Popen([sys.executable, "-c", ENGINE, tag, str(rounds), str(live),
                                      str(LAYERS)],
                                     stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, **CHILD_ENV))

    def line(self) -> str:
        out = self.proc.stdout.readline().strip()
        assert out, f"the engine died (exit {self.proc.wait()})"
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class Scene:
    """An engine, a plain consumer, and the GPU made nearly full beside them by this process
    (fill): all closed and given back at the end, whatever failed (a failed test's traceback
    holds its frame, so the filler is not left to it)."""

    def __init__(self, tag: str, rounds: int, live: int, kind: str):
        self.engine = Engine(tag, rounds, live)
        self.consumer = Consumer(kind)
        self._filler = None

    def fill(self, leave: int) -> None:
        self._filler = torch.empty(settled_free_memory() - leave, dtype=torch.uint8,
                                   device="cuda")
        torch.cuda.synchronize()

    def __enter__(self) -> "Scene":
        return self

    def __exit__(self, *exc) -> None:
        self._filler = None
        self.consumer.close()
        self.engine.close()
        torch.cuda.empty_cache()


def will_free(live: int, page: int) -> int:
    """What a release keeping `live` blocks of every layer gives back at least."""
    kept = LAYERS * live * BLOCK
    return LAYERS * BLOCKS * BLOCK - math.ceil(kept / page) * page


@pytest.mark.parametrize("kind", ["torch", "cudart"])
def test_a_plain_process_allocates_what_the_engine_released_for_the_scheduler(kind, page):
    """The GPU made nearly full first (by this test, the scheduler): the plain process's
    allocation of most of what the release frees fails before the take and succeeds during
    it; given back, the engine has every kept bit."""
    live = BLOCKS // 10
    want = int(will_free(live, page) * 0.75) // (2 * MiB) * (2 * MiB)
    with Scene(f"gpu-offer-{kind}", 1, live, kind) as scene:
        engine, consumer = scene.engine, scene.consumer
        assert engine.line() == "offered 0"
        scene.fill(leave=1 * GiB)
        assert free_now() < want - 1 * GiB, "the GPU is not full enough for the test to mean"
        assert consumer.ask(f"alloc {want}") == "oom", "it fits before the take"
        with sublet.take(name=f"gpu-offer-{kind}", timeout=300) as t:
            assert t.released_bytes >= will_free(live, page)
            assert consumer.ask(f"alloc {want}") == "ok", \
                f"{kind}: {want / GiB:.2f} GiB did not fit while taken (released " \
                f"{t.released_bytes / GiB:.2f} GiB, free {free_now() / GiB:.2f})"
            assert consumer.ask("free") == "freed"
        assert engine.line() == "round 0 ok True"
        print(f"\n{kind}: {want / GiB:.2f} GiB allocated by a process without sublet while "
              f"taken; released {t.released_bytes / GiB:.2f} GiB in {t.stats.seconds:.3f} s, "
              f"resumed in {t.resumed_stats.seconds:.3f} s")


def test_a_take_by_need_releases_the_need_then_more_when_asked(page):
    """A scheduler's take by need (issue 42): the GPU made nearly full, the scheduler takes
    the engine's offer needing an eighth of the tag beyond what is free; the engine's library
    releases about that, not the whole tag, and a cudaMalloc process allocates it; then
    Taken.need asks a quarter more, which does not fit before and fits after, nothing resumed
    meanwhile; given back, the engine has every kept bit."""
    live, total = BLOCKS // 10, LAYERS * BLOCKS * BLOCK
    with Scene("gpu-offer-need", 1, live, "cudart") as scene:
        engine, consumer = scene.engine, scene.consumer
        assert engine.line() == "offered 0"
        scene.fill(leave=512 * MiB)
        first, more = free_now() + total // 8, total // 4
        with sublet.take(name="gpu-offer-need", timeout=300, need=first) as t:
            released_first = t.released_bytes
            assert 0 < released_first < total // 2, "by need, not the whole tag"
            assert consumer.ask(f"alloc {first}") == "ok"
            assert consumer.ask(f"alloc {more}") == "oom", "the second need fits before asked"
            t.need(first + more)
            assert released_first < t.released_bytes < total
            assert consumer.ask(f"alloc {more}") == "ok", \
                f"released {t.released_bytes / GiB:.2f} GiB, free {free_now() / GiB:.2f}"
            assert consumer.ask("free") == "freed"
        assert engine.line() == "round 0 ok True"
        print(f"\ntake by need: {first / GiB:.2f} then {(first + more) / GiB:.2f} GiB; "
              f"released {released_first / GiB:.2f} then {t.released_bytes / GiB:.2f} GiB of "
              f"{total / GiB:.2f}")


def test_loans_in_sequence_with_changing_keeps_keep_every_bit(page):
    """Five loans, a new live set each, a plain process writing over the released memory
    during each: every kept bit back after each."""
    with Scene("gpu-offer-seq", 5, BLOCKS // 4, "torch") as scene:
        for round_ in range(5):
            assert scene.engine.line() == f"offered {round_}"
            with sublet.take(name="gpu-offer-seq", timeout=300) as t:
                want = t.released_bytes // (2 * MiB) * (2 * MiB) - 256 * MiB
                assert scene.consumer.ask(f"alloc {want}") == "ok"  # written with 0xAB
                assert scene.consumer.ask("free") == "freed"
            assert scene.engine.line() == f"round {round_} ok True"


def test_the_scheduler_killed_while_holding_and_the_engine_resumes(page):
    engine = Engine("gpu-offer-kill", 1, BLOCKS // 8)
    sched = None
    try:
        assert engine.line() == "offered 0"
        sched = subprocess.Popen([sys.executable, "-c", SCHEDULER, "gpu-offer-kill"],
                                 stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ, **CHILD_ENV))
        assert sched.stdout.readline().startswith("taken")
        sched.send_signal(signal.SIGKILL)
        sched.wait()
        assert engine.line() == "round 0 BorrowerDiedError True"
    finally:
        if sched is not None and sched.poll() is None:
            sched.kill()
            sched.wait()
        engine.close()
