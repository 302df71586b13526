"""GPU tests (issue 3): the CUDA backend through the Python API, on a real device.

Skipped without CUDA. They start a private subletd (cuda backend) unless $SUBLET_SOCKET points
at one. To make a borrower spill into kept pages without filling a whole H200, a "hog" takes
all but a few GiB of free memory before the loan: the loan's fresh memory is what is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import sublet
from sublet._keep import kept_bytes_in_pages, kept_pages

from conftest import CHILD_ENV, kept_ranges_of

GiB = 1024 ** 3
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


@pytest.fixture(scope="module", autouse=True)
def cuda_daemon(native):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SUBLET_BACKEND", raising=False)
        info = sublet.info()
        assert info.backend == "cuda"
        yield info


@pytest.fixture
def page(cuda_daemon) -> int:
    return cuda_daemon.page_size


def settled_free_memory() -> int:
    """The device's free memory once it has stopped growing: a process or daemon of an
    earlier test may still be giving its memory back (test_gpu_survive once found 15 GiB more
    free at the borrow than when it measured, and the loan never reached its kept pages)."""
    torch.cuda.empty_cache()
    free, steady = torch.cuda.mem_get_info()[0], 0
    for _ in range(50):  # until it has not changed for 0.6 s, 10 s at most
        time.sleep(0.2)
        now = torch.cuda.mem_get_info()[0]
        steady = steady + 1 if now == free else 0
        free = now
        if steady == 3:
            break
    return free


@contextlib.contextmanager
def free_memory_left(nbytes: int):
    """Takes all but about nbytes of the device's free memory for the duration."""
    free = settled_free_memory()
    hog = torch.empty(max(0, free - nbytes), dtype=torch.uint8, device="cuda")
    try:
        yield
    finally:
        del hog
        torch.cuda.empty_cache()


def random_fill(t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    raw = t.view(-1).view(torch.uint8)
    g = torch.Generator(device=t.device).manual_seed(seed)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, device=t.device, generator=g))
    return t


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return torch.tensor([], dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def kept_equal(t: torch.Tensor, before: torch.Tensor, ranges: np.ndarray) -> bool:
    """Every kept byte of t equals the same byte of `before` (a clone of t)."""
    now, then = bytes_of(t), bytes_of(before)
    return all(torch.equal(now[o:o + n], then[o:o + n]) for o, n in ranges.tolist())


def fill_with_torch(chunk: int) -> list[torch.Tensor]:
    """Plain PyTorch allocations, each written, until the loan is full: `chunk`-sized ones
    first, then smaller ones (1 MiB ones share 2 MiB segments) for what is left."""
    tensors = []
    for size in (chunk, 64 * 1024 ** 2, 16 * 1024 ** 2, 1024 ** 2):
        while True:
            try:
                x = torch.empty(size, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                break
            tensors.append(x.fill_(len(tensors) % 251 + 1))
    torch.cuda.synchronize()
    return tensors


def expected_copied(loan: sublet.Loan, ranges: np.ndarray, page: int) -> int:
    """Kept bytes that could not stay on the GPU: with `used` of the K kept pages handed out,
    the others hold what they can in their unkept bytes (moved there on the GPU), so only
    max(0, kept - (K - used) x page) go to the host."""
    used = loan.stats.served_kept_bytes // page
    room = (len(kept_pages(ranges, page)) - used) * page
    return max(0, kept_bytes_in_pages(ranges, page) - room)


# --------------------------------------------------------------------------- the README

def test_readme_example(capsys):
    cache = random_fill(sublet.empty(16, 64 * 1024 ** 2, dtype=torch.uint8))
    before = cache[1::2].clone()
    with sublet.lend(cache, keep=cache[1::2]) as loan:
        a = torch.randn(4096, 4096, device="cuda")
        (a @ a).sum().item()
        del a
    print(f"copied {loan.copied_bytes} bytes")
    print("data intact:", torch.equal(cache[1::2], before))
    out = capsys.readouterr().out
    assert "data intact: True" in out


# --------------------------------------------------------------------------- keep variants

KEEPS = {
    "default": lambda c: None,
    "nothing": lambda c: [],
    "one view": lambda c: c[3],
    "list": lambda c: [c[0], c[5], c[6]],
    "odd rows": lambda c: c[1::2],
    "columns": lambda c: c[:, 2 * 1024 ** 2:5 * 1024 ** 2],
}


@pytest.mark.parametrize("keep_name", list(KEEPS))
def test_keep_variants_spill_and_restore(keep_name, page):
    cache = random_fill(sublet.empty(8, 64 * 1024 ** 2, dtype=torch.uint8), seed=2)
    before = cache.clone()
    keep = KEEPS[keep_name](cache)
    ranges = kept_ranges_of(cache, keep)
    with free_memory_left(3 * GiB):
        with sublet.lend(cache, keep=keep) as loan:
            tensors = fill_with_torch(64 * 1024 ** 2)
            expected = expected_copied(loan, ranges, page)
            del tensors
    assert kept_equal(cache, before, ranges)
    assert loan.copied_bytes == loan.copied_in_bytes == expected
    if keep_name not in ("nothing",):
        assert loan.stats.served_kept_bytes > 0, "the borrower should have spilled"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64,
                                   torch.complex64])
def test_dtypes_and_non_contiguous_views(dtype, page):
    cache = random_fill(sublet.empty(4, 64, 1024 ** 2 // dtype.itemsize, dtype=dtype), seed=3)
    before = cache.clone()
    keep = [cache[1::2, :, 7:50000], cache[0, 3]]
    ranges = kept_ranges_of(cache, keep)
    with free_memory_left(3 * GiB):
        with sublet.lend(cache, keep=keep) as loan:
            tensors = fill_with_torch(32 * 1024 ** 2)
            expected = expected_copied(loan, ranges, page)
            del tensors
    assert kept_equal(cache, before, ranges)
    assert loan.copied_bytes == expected > 0


def test_100k_scattered_64k_views_copy_only_kept_bytes(page):
    block = 64 * 1024
    cache = random_fill(sublet.empty(3 * 65536, block, dtype=torch.uint8), seed=4)  # 12 GiB
    idx = torch.from_numpy(np.random.default_rng(4).choice(cache.shape[0], 100_000,
                                                          replace=False)).cuda()
    before = cache[idx].clone()
    keep = [cache[i] for i in idx.tolist()]
    ranges = kept_ranges_of(cache, keep)
    assert len(kept_pages(ranges, page)) * page > 1.5 * 100_000 * block  # pages >> kept bytes
    with free_memory_left(3 * GiB):
        with sublet.lend(cache, keep=keep) as loan:
            tensors = fill_with_torch(256 * 1024 ** 2)
            expected = expected_copied(loan, ranges, page)
            del tensors
    assert torch.equal(cache[idx], before)
    assert loan.copied_bytes == expected
    assert loan.stats.served_kept_bytes // page == len(kept_pages(ranges, page))  # all used
    assert loan.copied_bytes == 100_000 * block  # the kept bytes, not their whole pages


# --------------------------------------------------------------------------- routing

def _loan_allocations(loan: sublet.Loan) -> int:
    return loan.stats.allocations


def test_training_step_with_autograd():
    cache = random_fill(sublet.empty(4, 256 * 1024 ** 2, dtype=torch.uint8), seed=5)
    before = cache.clone()
    with sublet.lend(cache) as loan:
        def step() -> tuple[float, int, int]:
            model = torch.nn.Sequential(torch.nn.Linear(4096, 8192), torch.nn.GELU(),
                                        torch.nn.Linear(8192, 4096)).cuda()
            opt = torch.optim.AdamW(model.parameters())
            x = torch.randn(512, 4096, device="cuda")
            loss = model(x).square().mean()
            allocs_before_backward = _loan_allocations(loan)
            loss.backward()  # gradients are made on autograd's device thread
            allocs_after_backward = _loan_allocations(loan)
            opt.step()
            return loss.item(), allocs_before_backward, allocs_after_backward
        loss, before_bw, after_bw = step()
    assert np.isfinite(loss)
    assert after_bw > before_bw, "backward's allocations did not reach the loan"
    assert loan.stats.served_unkept_bytes + loan.stats.served_fresh_bytes > 0
    assert torch.equal(cache, before)


def test_work_on_several_streams_and_a_second_thread():
    cache = random_fill(sublet.empty(2, 256 * 1024 ** 2, dtype=torch.uint8), seed=6)
    before = cache.clone()
    results = {}
    with sublet.lend(cache) as loan:
        streams = [torch.cuda.Stream() for _ in range(3)]
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                a = torch.full((1024, 1024 + i), float(i + 1), device="cuda")
                results[f"stream{i}"] = (a @ a.T).sum().item()
                del a
        torch.cuda.synchronize()
        seen = _loan_allocations(loan)

        def worker():
            big = torch.ones(96 * 1024 ** 2 + 3, device="cuda")  # a new segment
            results["thread"] = big.sum(dtype=torch.float64).item()
            results["thread_allocs"] = _loan_allocations(loan)
            del big
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    for i in range(3):
        assert results[f"stream{i}"] == pytest.approx((i + 1) ** 2 * (1024 + i) * 1024 * 1024)
    assert results["thread"] == 96 * 1024 ** 2 + 3
    assert results["thread_allocs"] > seen, "the thread's allocation did not reach the loan"
    assert torch.equal(cache, before)


def test_torch_compile():
    pytest.importorskip("triton")
    cache = random_fill(sublet.empty(2, 128 * 1024 ** 2, dtype=torch.uint8), seed=7)
    before = cache.clone()

    @torch.compile
    def f(x):
        return torch.nn.functional.gelu(x * 2 + 1).sum(dim=1)

    try:
        f(torch.randn(64, 64, device="cuda"))  # compile outside: its caches outlive the loan
    except Exception as e:  # noqa: BLE001 - any inductor/triton setup failure skips
        pytest.skip(f"torch.compile is unavailable here: {type(e).__name__}: {e}")
    with sublet.lend(cache) as loan:
        x = torch.randn(4096, 4096, device="cuda")
        value = f(x).sum().item()
        del x
    assert np.isfinite(value)
    assert loan.stats.allocations > 0
    assert torch.equal(cache, before)


# --------------------------------------------------------------------------- leaks

def test_leak_error_restores_the_kept_data():
    cache = random_fill(sublet.empty(4, 64 * 1024 ** 2, dtype=torch.uint8), seed=8)
    before = cache.clone()
    torch.cuda.memory._record_memory_history(max_entries=10000)
    try:
        with pytest.raises(sublet.LeakError) as caught:
            with sublet.lend(cache):
                leaked = torch.empty(40 * 1024 ** 2, dtype=torch.uint8, device="cuda")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    assert torch.equal(cache, before)
    message = str(caught.value)
    assert str(40 * 1024 ** 2) in message and "test_gpu.py" in message
    del leaked
    with sublet.lend(cache, keep=[]):  # the device can lend again
        torch.ones(10, device="cuda").sum().item()


def test_fifty_loans_in_a_row_do_not_grow():
    cache = random_fill(sublet.empty(8, 128 * 1024 ** 2, dtype=torch.uint8), seed=9)
    before = cache.clone()
    samples, mapped = [], []
    for i in range(50):
        with sublet.lend(cache, keep=cache[::2]) as loan:
            x = torch.empty(3 * GiB, dtype=torch.uint8, device="cuda").fill_(i)
            del x
        mapped.append(loan.stats.mapped_pages)
        if i in (1, 49):
            torch.cuda.empty_cache()
            samples.append((torch.cuda.mem_get_info()[0], _rss(), _fds()))
    (free0, rss0, fds0), (free1, rss1, fds1) = samples
    assert abs(free1 - free0) < 64 * 1024 ** 2, "GPU memory grew across loans"
    assert rss1 - rss0 < 64 * 1024 ** 2, "host memory grew across loans"
    assert fds1 == fds0, "open files grew across loans"
    assert len(set(mapped[1:])) == 1, mapped     # each loan maps as much as the one before
    assert torch.equal(cache[::2], before[::2])


def test_owner_process_maps_once_though_torch_caches_between_loans():
    """No loan of a region maps a page of it, the first included (a loan in order is served
    on the region's own mapping, whatever its keep: books.h), and PyTorch caching memory
    between loans (the checksum below, any work a server runs) changes nothing of that: only
    the fresh chunk (one handle) is mapped each loan (issues 10 and 23)."""
    cache = random_fill(sublet.empty(6 * GiB, dtype=torch.uint8), seed=5)
    keep = cache.view(24, GiB // 4)[::3]          # 2 GiB in 8 rows: unkept runs of 512 MiB
    before = keep.clone()
    maps = []
    with free_memory_left(2 * GiB):
        for i in range(3):
            with sublet.lend(cache, keep=keep) as loan:
                x = torch.empty(5 * GiB, dtype=torch.uint8, device="cuda").fill_(i)  # U + F
                torch.cuda.synchronize()
                del x
            maps.append(loan.stats.map_seconds)
            assert loan.stats.mapped_pages == 0, loan.stats
            assert loan.stats.served_fresh_bytes > 0
            assert torch.equal(keep, before)       # uint8: equal values, equal bits
            torch.empty(300 * 1024 ** 2, dtype=torch.uint8, device="cuda").fill_(1)  # cached
    print(f"\nmap seconds per loan: {maps}")
    # 6 GiB of 2 MiB pages would take about 0.1 s; a fresh chunk, one handle, well under 0.01
    assert max(maps) < 0.01, maps


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- processes

BORROWER = textwrap.dedent("""
    import sys, time, torch, sublet
    with sublet.borrow(name=sys.argv[1], timeout=30) as loan:
        x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda").fill_(7)
        torch.cuda.synchronize()
        print("borrowing", flush=True)
        if sys.argv[2] == "hang":
            time.sleep(120)
        del x
""")


def _start_borrower(name: str, mode: str) -> subprocess.Popen:
    from sublet import _client
    socket = _client.client_for("cuda", torch.cuda.current_device()).path
    env = dict(os.environ, SUBLET_SOCKET=socket, **CHILD_ENV)
    return subprocess.Popen([sys.executable, "-c", BORROWER, name, mode], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_borrower_in_another_process_and_killed_mid_loan():
    cache = random_fill(sublet.empty(8, 128 * 1024 ** 2, dtype=torch.uint8), seed=10)
    before = cache.clone()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]

    with sublet.offer(cache, keep=cache[::2], name="gpu-kv") as offer:
        child = _start_borrower("gpu-kv", "normal")
        offer.wait(timeout=120)
    assert child.wait(timeout=60) == 0, child.stderr.read()
    assert torch.equal(cache[::2], before[::2])
    before = cache.clone()  # the borrower was free to overwrite the other rows

    offer = sublet.offer(cache, name="gpu-kill")
    child = _start_borrower("gpu-kill", "hang")
    assert child.stdout.readline().strip() == "borrowing", child.stderr.read()
    child.send_signal(signal.SIGKILL)
    child.wait()
    with pytest.raises(sublet.BorrowerDiedError):
        offer.wait(timeout=120)
    assert torch.equal(cache, before)
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] >= free_before - 256 * 1024 ** 2, \
        "the dead borrower's memory did not come back to the device"
