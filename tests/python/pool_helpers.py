"""Helpers of the pool tests on the memfd backend (test_pool_memfd.py and
test_pool_pinned_memfd.py): tensors of random bytes, their bits, and a borrower that fills a
loan to its last page."""

from __future__ import annotations

import gc

import numpy as np
import torch

import sublet

from conftest import PAGE


def random_bytes(t: torch.Tensor, seed: int) -> torch.Tensor:
    """Fills t with random bytes (a generator seeded with `seed`); returns t."""
    g = torch.Generator().manual_seed(seed)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return t


def layers(pool: sublet.Pool, n: int, shape: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """n per-layer tensors of a pool, each filled with its own random bytes."""
    return [random_bytes(pool.empty(*shape, dtype=torch.bfloat16), seed + i) for i in range(n)]


def bits(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (bits, not values: a NaN the borrower left is not equal to itself)."""
    return t.contiguous().view(-1).view(torch.uint8).numpy().copy()


def fill_loan(loan: sublet.Loan, seed: int) -> int:
    """Loan.empty() pages until the loan is full, each written with noise; returns the bytes.
    The tensors die before the block ends."""
    noise = torch.randint(0, 256, (PAGE,), dtype=torch.uint8,
                          generator=torch.Generator().manual_seed(seed))
    held = []
    while True:
        try:
            held.append(loan.empty(PAGE, dtype=torch.uint8).copy_(noise))
        except sublet.SubletOutOfMemoryError:
            break
    n = len(held) * PAGE
    del held
    gc.collect()
    return n
