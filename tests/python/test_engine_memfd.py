"""A real engine's KV cache lent on the memfd backend (no GPU): transformers' Llama on the CPU,
its StaticCache and its continuous batching's paged cache in a sublet pool, lent with the live
part kept while the borrower writes random bytes over every page the loan has; after each loan
every kept bit is back and greedy generation goes on exactly (tokens and logits, bit for bit)
as a run that had no loan.

CPU allocations are not routed (no allocator hook exists for them), so the caches' tensors are
Pool.empty() tensors put in place of the ones transformers allocated, before any use, and the
borrower allocates with Loan.empty(); on a GPU, `with sublet.pool("kv")` does it for the
engine unchanged (test_gpu_engine.py). Skipped without transformers or the built daemon.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
import torch

import sublet

from conftest import CHILD_ENV, PAGE, REPO
import engine_workloads as ew  # noqa: E402  (skips the module, saying why, without transformers)

pytestmark = [pytest.mark.daemon, pytest.mark.usefixtures("memfd_daemon")]


@pytest.fixture(autouse=True)
def collect_after():
    """The engines' objects hold their pool tensors in reference cycles: collected after each
    test, so that no pool page outlives it (later modules count the daemon's free pages)."""
    yield
    gc.collect()


@pytest.fixture(scope="module")
def model():
    return ew.llama("tiny", "cpu", torch.float32, seed=0)


def fill_loan(loan: sublet.Loan, seed: int) -> int:
    """The borrower: Loan.empty() pages of random bytes until the loan is full (unkept pages,
    free memory, then the kept pages, whose kept bytes are saved first). Returns the bytes."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (8, PAGE), dtype=torch.uint8, generator=g)
    held = []
    while True:
        try:
            x = loan.empty(PAGE, dtype=torch.uint8)
        except sublet.SubletOutOfMemoryError:
            break
        held.append(x.copy_(noise[len(held) % len(noise)]))
    n = len(held) * PAGE
    del held, x
    gc.collect()
    return n


# --------------------------------------------------------------------------- StaticCache

B, P, N1, N2, MAX_LEN = 4, 24, 8, 8, 256  # 8 tensors of 4 x 2 x 256 x 32 float32: 2 MiB


def test_static_cache_prefix_kept_through_loans_then_generation_goes_on(model):
    pool = sublet.pool("engine-static", device="cpu")
    cache = ew.static_cache_from_pool(model, pool, B, MAX_LEN)
    kv = ew.kv_of(cache)
    assert pool.nbytes == sum(t.untyped_storage().nbytes() for t in kv) == 2 * 1024 ** 2
    ids = ew.prompts(model, B, P, seed=1)
    ref_cache = ew.static_cache(model, B, MAX_LEN)  # ordinary memory, never lent

    # Prefixes: the prompts only, part of what was generated, everything the cache holds.
    # Lent by tag, by Pool and as the list of the cache's tensors.
    for prefix, what in [(P, "engine-static"), (P + N1 // 2, pool), (P + N1 - 1, kv)]:
        cache.reset()
        seq1, _ = ew.greedy(model, ids, cache, N1)
        assert int(cache.get_seq_length()) == P + N1 - 1
        before = ew.snapshot(kv)

        keep = sublet.blocks(kv, torch.arange(prefix), dim=2)
        t = time.perf_counter()
        with sublet.lend(what, keep=keep) as loan:
            filled = fill_loan(loan, seed=prefix)
        seconds = time.perf_counter() - t

        kept = len(kv) * B * model.config.num_key_value_heads * prefix * ew.head_dim(model) * 4
        for now, then in zip(kv, before):
            assert ew.same_bits(now[:, :, :prefix], then[:, :, :prefix]), \
                ew.mismatch(now[:, :, :prefix], then[:, :, :prefix])
        assert any(not ew.same_bits(now[:, :, prefix:], then[:, :, prefix:])
                   for now, then in zip(kv, before)), "the borrower never reached the cache"
        # Every page of the cache holds kept bytes, and the loan was filled to its last page:
        # all kept bytes went to the host (and back), the pages of other tags' live tensors
        # in the arena too, if any.
        assert kept <= loan.copied_bytes <= kept + pool.arena.size - pool.nbytes
        assert filled >= pool.nbytes
        print(f"prefix {prefix}: filled {filled >> 20} MiB, kept {kept} B, copied "
              f"{loan.copied_bytes} B, moved {loan.moved_bytes} B, {seconds * 1e3:.1f} ms")

        # The owner: only [0, prefix) is its data again; generation re-feeds the rest.
        ew.assert_continues_as_reference(model, ids, seq1, cache, ref_cache, prefix, N1, N2)


def test_unkept_cache_positions_hold_the_borrowers_bits(model):
    """Why the owner zeroes what it did not keep: the borrower's random bits are in the
    unkept positions, and the static cache's masked attention turns NaN patterns there into
    NaN logits."""
    pool = sublet.pool("engine-static", device="cpu")
    cache = ew.static_cache_from_pool(model, pool, B, MAX_LEN)
    kv = ew.kv_of(cache)
    ids = ew.prompts(model, B, P, seed=2)
    seq1, _ = ew.greedy(model, ids, cache, N1)
    with sublet.lend(kv, keep=sublet.blocks(kv, torch.arange(P), dim=2)) as loan:
        fill_loan(loan, seed=3)
    for layer in cache.layers:
        layer.cumulative_length.fill_(P)  # no zeroing
    _, scores = ew.greedy(model, seq1, cache, 2)
    assert scores.isnan().any()


# --------------------------------------------------------------------------- paged cache

def test_paged_cache_live_blocks_kept_while_continuous_batching_is_paused(model, monkeypatch):
    """Continuous batching's PagedAttentionCache in a pool: paused mid-generation, the cache
    lent keeping the live requests' blocks (and the read-trash sector padding reads), filled
    to the last page by the borrower, then resumed: every request's tokens equal those of a
    run with no pause and no loan."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    pool = sublet.pool("engine-paged", device="cpu")
    made = []

    class PooledPagedAttentionCache(PagedAttentionCache):
        """The paged cache, its one flat tensor moved into the pool before any request
        (on a GPU: `with sublet.pool(tag): super().__init__(...)`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            moved = pool.empty(self.cache_tensor.numel(), dtype=torch.uint8)
            moved.copy_(self.cache_tensor)
            self.cache_tensor = moved
            for allocator in self.cache_allocators.values():
                allocator.register_cache_tensor(self.bytes_per_sector,
                                                self.num_sectors * self.bytes_per_sector,
                                                moved, self.pool)
            made.append(self)

    monkeypatch.setattr(continuous_api, "PagedAttentionCache", PooledPagedAttentionCache)
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()
              for n in (20, 33, 17, 40, 25, 60)]
    gen = GenerationConfig(max_new_tokens=48, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=128,
                                  allow_block_sharing=False, use_cuda_graph=False,
                                  auto_switch_to_flash=False)

    def lend_paged(cache) -> dict:
        assert made and cache is made[-1]
        allocator = cache.cache_allocators["full_attention"]
        table = allocator._copy_view  # [blocks, bytes_per_block]: the whole flat tensor
        live = sorted({b for blocks in allocator.block_table.values() for b in blocks})
        assert live, "no request holds blocks: paused too late"
        keep_ids = sorted(set(live) | set(range(allocator.blocks_per_sector)))  # + read trash
        before = table.clone()
        with sublet.lend("engine-paged", keep=sublet.blocks([table], keep_ids)) as loan:
            fill_loan(loan, seed=5)
        assert ew.same_bits(table[keep_ids], before[keep_ids])
        unkept = sorted(set(range(len(table))) - set(keep_ids))
        assert not ew.same_bits(table[unkept], before[unkept])
        assert loan.copied_bytes >= len(keep_ids) * table.shape[1]
        return {"live": len(live), "copied": loan.copied_bytes}

    reference, _ = ew.continuous_batching(model, gen, cb, inputs, max_new_tokens=48)
    got, report = ew.continuous_batching(model, gen, cb, inputs, max_new_tokens=48,
                                         lend=lend_paged, lend_at_step=10)
    print(f"paged: {report['live']} live blocks kept, {report['copied']} B copied")
    assert got == reference


def test_rl_colocate_example_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("with a GPU the example runs for real (the GPU command runs it)")
    r = subprocess.run([sys.executable, str(REPO / "examples" / "rl_colocate.py")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, **CHILD_ENV})
    assert r.returncode == 0, r.stderr
    assert "no CUDA GPU" in r.stdout
