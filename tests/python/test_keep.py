"""keep -> byte ranges (sublet._keep), checked against a brute-force reference. No daemon, no GPU.

The reference marks the bytes of each view by writing through the view with PyTorch itself
(every byte of every element set to 0xFF in a zeroed storage), so it shares no stride
arithmetic with the code under test.
"""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest
import torch

from sublet import _keep
from sublet._keep import keep_ranges, kept_bytes_in_pages, kept_pages, merge_ranges

DTYPES = [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64,
          torch.complex64]
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_mask(base: torch.Tensor, views: list[torch.Tensor]) -> np.ndarray:
    """One bool per byte of base's storage: True where some view has an element."""
    storage = base.untyped_storage()
    torch.tensor([], dtype=torch.uint8).set_(storage).zero_()
    for v in views:
        ones = torch.full(v.shape, -1, dtype=_SAME_SIZE_INT[v.element_size()]).view(v.dtype)
        try:
            v.copy_(ones)
        except RuntimeError:  # elements overlap (expand, unfold): write them one at a time
            for index in itertools.product(*(range(n) for n in v.shape)):
                v[index].copy_(ones[index])
    return torch.tensor([], dtype=torch.uint8).set_(storage).numpy() != 0


def ranges_mask(ranges: np.ndarray, size: int) -> np.ndarray:
    mask = np.zeros(size, dtype=bool)
    for off, length in ranges.tolist():
        mask[off:off + length] = True
    return mask


def assert_well_formed(ranges: np.ndarray) -> None:
    assert ranges.dtype == np.uint64 and ranges.ndim == 2 and ranges.shape[1] == 2
    if len(ranges):
        assert (ranges[:, 1] > 0).all()
        ends = ranges[:-1, 0] + ranges[:-1, 1]
        assert (ranges[1:, 0] > ends).all(), "ranges must be sorted, disjoint and not touching"


def ranges_of(base: torch.Tensor, keep) -> np.ndarray:
    return keep_ranges(keep, base.untyped_storage().data_ptr(), base.untyped_storage().nbytes())


# --------------------------------------------------------------------------- random views

def random_view(base: torch.Tensor, rng: random.Random) -> torch.Tensor:
    """base after up to four random view operations (each one that does not apply is skipped)."""
    v = base
    for _ in range(rng.randint(0, 4)):
        op = rng.choice([_slice, _transpose, _narrow, _select, _unfold, _as_strided, _expand,
                         _dtype_view])
        try:
            v = op(v, rng)
        except (RuntimeError, ValueError, IndexError):
            pass
    return v


def _slice(v, rng):
    d = rng.randrange(v.dim())
    n = v.shape[d]
    start, stop = sorted(rng.randint(0, n) for _ in range(2))
    index = [slice(None)] * v.dim()
    index[d] = slice(start, stop, rng.randint(1, 4))
    return v[tuple(index)]


def _transpose(v, rng):
    return v.transpose(rng.randrange(v.dim()), rng.randrange(v.dim()))


def _narrow(v, rng):
    d = rng.randrange(v.dim())
    start = rng.randint(0, v.shape[d])
    return v.narrow(d, start, rng.randint(0, v.shape[d] - start))


def _select(v, rng):
    if v.dim() < 2:
        return v
    d = rng.randrange(v.dim())
    return v.select(d, rng.randrange(v.shape[d]))


def _unfold(v, rng):
    d = rng.randrange(v.dim())
    return v.unfold(d, rng.randint(1, max(1, v.shape[d])), rng.randint(1, 3))


def _as_strided(v, rng):
    """A fresh layout over the whole storage, possibly with overlapping elements."""
    numel = v.untyped_storage().nbytes() // v.element_size()
    sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 3))]
    strides = [rng.randint(0, 40) for _ in sizes]
    reach = sum((n - 1) * s for n, s in zip(sizes, strides))
    if reach >= numel:
        return v
    return v.as_strided(sizes, strides, rng.randint(0, numel - 1 - reach))


def _expand(v, rng):
    return v.unsqueeze(0).expand(rng.randint(1, 3), *v.shape)


def _dtype_view(v, rng):
    return v.view(rng.choice(DTYPES))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_views_match_reference(dtype):
    rng = random.Random(hash(str(dtype)) & 0xFFFF)
    for trial in range(200):
        shape = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
        base = torch.zeros(shape, dtype=dtype)
        views = [random_view(base, rng) for _ in range(rng.randint(1, 6))]
        keep = views[0] if len(views) == 1 and trial % 2 else views
        ranges = ranges_of(base, keep)
        assert_well_formed(ranges)
        size = base.untyped_storage().nbytes()
        expected = reference_mask(base, views)
        assert (ranges_mask(ranges, size) == expected).all(), (shape, [v.stride() for v in views])


def test_one_view_alone_matches_reference():
    """One view (the usual keep: a slice, rows with a step) takes a path of its own; it must
    give what the reference says for every layout, overlapping ones (expand, unfold) too."""
    rng = random.Random(11)
    merged = 0
    for trial in range(600):
        dtype = rng.choice(DTYPES)
        base = torch.zeros([rng.randint(1, 9) for _ in range(rng.randint(1, 3))], dtype=dtype)
        view = random_view(base, rng)
        ranges = ranges_of(base, view if trial % 2 else [view])
        assert_well_formed(ranges)
        expected = reference_mask(base, [view])
        assert (ranges_mask(ranges, base.untyped_storage().nbytes()) == expected).all(), \
            (tuple(base.shape), tuple(view.shape), view.stride(), view.storage_offset())
        merged += len(ranges) < view.numel() and not view.is_contiguous()
    assert merged > 50, "the trials must cover views whose runs join into fewer ranges"


def test_many_views_of_mixed_layouts():
    rng = random.Random(7)
    base = torch.zeros(24, 20, dtype=torch.float16)
    views = [random_view(base, rng) for _ in range(400)]
    ranges = ranges_of(base, views)
    assert_well_formed(ranges)
    assert (ranges_mask(ranges, base.nbytes) == reference_mask(base, views)).all()


@pytest.mark.parametrize("make_keep, expected", [
    (lambda c: c[1::2], [(o, 16) for o in range(16, 128, 32)]),
    (lambda c: c[:, 2:5], [(o + 2, 3) for o in range(0, 128, 16)]),
    (lambda c: c, [(0, 128)]),
    (lambda c: [c[0], c[1]], [(0, 32)]),
    (lambda c: (c[3], c[0]), [(0, 16), (48, 16)]),
    (lambda c: [], []),
    (lambda c: [c[2:2]], []),
    # runs at 0, 2, 3, 5: the second and third touch, so they are one range
    (lambda c: c.as_strided((2, 2), (3, 2)), [(0, 1), (2, 2), (5, 1)]),
    (lambda c: c[0].expand(2, 16), [(0, 16)]),
])
def test_documented_examples(make_keep, expected):
    cache = torch.zeros(8, 16, dtype=torch.uint8)
    assert [tuple(r) for r in ranges_of(cache, make_keep(cache)).tolist()] == expected


def test_view_of_another_tensor_is_refused():
    cache, other = torch.zeros(4, 4), torch.zeros(4, 4)
    with pytest.raises(ValueError, match="not a view of the lent tensor"):
        ranges_of(cache, [cache[0], other[1]])


@pytest.mark.parametrize("keep", ["cache", 3, [1, 2], [None]])
def test_non_views_are_refused(keep):
    with pytest.raises(TypeError, match="keep"):
        ranges_of(torch.zeros(4), keep)


def test_widening_keeps_a_superset(monkeypatch):
    monkeypatch.setattr(_keep, "MAX_RUNS_PER_GROUP", 64)
    base = torch.zeros(32, 64, dtype=torch.uint8)
    view = base[:, ::2]
    ranges = ranges_of(base, view)
    assert_well_formed(ranges)
    mask, exact = ranges_mask(ranges, base.nbytes), reference_mask(base, [view])
    assert (mask | exact == mask).all(), "widened ranges must still cover every kept byte"
    assert len(ranges) <= 64


def test_merge_ranges_touching_and_overlapping():
    starts = np.array([10, 0, 5, 30, 12], dtype=np.int64)
    lengths = np.array([5, 5, 3, 1, 10], dtype=np.int64)
    assert merge_ranges(starts, lengths).tolist() == [[0, 8], [10, 12], [30, 1]]


def test_page_helpers():
    ranges = np.array([[100, 50], [4000, 200], [9000, 10]], dtype=np.uint64)
    assert kept_pages(ranges, 4096).tolist() == [0, 1, 2]
    assert kept_bytes_in_pages(ranges, 4096) == 260
    assert kept_bytes_in_pages(ranges, 4096, [0]) == 50 + 96
    assert kept_bytes_in_pages(ranges, 4096, [1, 2]) == 104 + 10


# --------------------------------------------------------------------------- speed

def _time(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_100k_scattered_64k_views_under_a_second():
    # 8 GiB of address space that is never touched, so it costs no memory.
    cache = torch.empty(1 << 17, 65536, dtype=torch.uint8)
    idx = np.random.default_rng(0).choice(cache.shape[0], 100_000, replace=False)
    views = [cache[i] for i in idx.tolist()]
    ptr = cache.untyped_storage().data_ptr()
    ranges = None

    def convert():
        nonlocal ranges
        ranges = keep_ranges(views, ptr, cache.nbytes)

    seconds = _time(convert)
    assert ranges is not None and int(ranges[:, 1].sum()) == 100_000 * 65536
    assert seconds < 1.0, f"100,000 views took {seconds:.3f} s"


def test_100k_scattered_2d_block_views_under_a_second():
    # A KV cache laid out (K/V, blocks, 32 KiB): one live block is the view cache[:, i].
    cache = torch.empty(2, 1 << 17, 32768, dtype=torch.uint8)
    idx = np.random.default_rng(1).choice(cache.shape[1], 100_000, replace=False)
    views = [cache[:, i] for i in idx.tolist()]
    ptr = cache.untyped_storage().data_ptr()
    seconds = _time(lambda: keep_ranges(views, ptr, cache.nbytes))
    assert seconds < 1.0, f"100,000 2-D views took {seconds:.3f} s"


# --------------------------------------------------------------------------- indices and masks

def _bases(rng: random.Random) -> list[torch.Tensor]:
    """Lent tensors whose rows are dense, strided, or a view inside a larger storage."""
    full = torch.zeros(24, 6, 4, dtype=torch.float16)
    return [full, full[:, 1:4], full.transpose(0, 1), full[3:20:2], full.view(24, 24)[:, ::3],
            full.flatten()[5:]]


@pytest.mark.parametrize("as_numpy", [False, True])
def test_indices_and_masks_match_the_views_they_name(as_numpy):
    rng = random.Random(7)
    for base in _bases(rng):
        ptr, size = base.untyped_storage().data_ptr(), base.untyped_storage().nbytes()
        n = base.shape[0]
        for _ in range(20):
            idx = [rng.randrange(-n, n) for _ in range(rng.randint(0, 2 * n))]
            mask = torch.tensor([rng.random() < 0.4 for _ in range(n)], dtype=torch.bool)
            want_idx = keep_ranges([base[i] for i in idx], ptr, size)
            want_mask = keep_ranges([base[i] for i in mask.nonzero().flatten().tolist()], ptr,
                                    size)
            keep_idx = torch.tensor(idx, dtype=torch.int64 if rng.random() < 0.5 else torch.int32)
            keep_mask = mask
            if as_numpy:
                keep_idx, keep_mask = keep_idx.numpy(), mask.numpy()
            got_idx = keep_ranges(keep_idx, ptr, size, base)
            got_mask = keep_ranges(keep_mask, ptr, size, base)
            assert_well_formed(got_idx)
            assert got_idx.tolist() == want_idx.tolist(), (base.shape, base.stride(), idx)
            assert got_mask.tolist() == want_mask.tolist(), (base.shape, base.stride())


def test_a_view_of_an_integer_tensor_stays_a_view():
    cache = torch.zeros(16, 8, dtype=torch.int64)
    ptr, size = cache.untyped_storage().data_ptr(), cache.untyped_storage().nbytes()
    assert keep_ranges(cache[3], ptr, size, cache).tolist() == [[3 * 64, 64]]
    assert keep_ranges(torch.tensor([3]), ptr, size, cache).tolist() == [[3 * 64, 64]]


@pytest.mark.parametrize("keep, error, words", [
    (torch.tensor([16]), IndexError, "out of range"),
    (torch.tensor([-17]), IndexError, "out of range"),
    (torch.zeros(15, dtype=torch.bool), ValueError, "one bool per row"),
    (np.array([1.5]), TypeError, "integer indices"),
])
def test_bad_indices_and_masks_say_what_is_wrong(keep, error, words):
    cache = torch.zeros(16, 8)
    ptr, size = cache.untyped_storage().data_ptr(), cache.untyped_storage().nbytes()
    with pytest.raises(error, match=words):
        keep_ranges(keep, ptr, size, cache)


def test_300k_scattered_rows_as_indices_and_as_a_mask():
    # 2**20 rows as in a 64 GiB cache of 64 KiB blocks, 30% kept. The rows are 8 KiB here, so
    # that the address space (8 GiB, never touched) is allowed on a small machine: the work
    # depends on the number of rows, not their size.
    cache = torch.empty(1 << 20, 8192, dtype=torch.uint8)
    ptr, size = cache.untyped_storage().data_ptr(), cache.untyped_storage().nbytes()
    idx = torch.from_numpy(np.random.default_rng(3).choice(cache.shape[0], 314_573,
                                                           replace=False))
    mask = torch.zeros(cache.shape[0], dtype=torch.bool)
    mask[idx] = True
    want = keep_ranges([cache[i] for i in idx.tolist()], ptr, size)
    timings = {}
    for name, keep in (("indices", idx), ("mask", mask)):
        best = min(_time(lambda: keep_ranges(keep, ptr, size, cache)) for _ in range(5))
        timings[name] = best
        assert keep_ranges(keep, ptr, size, cache).tolist() == want.tolist()
    print(f"\n314,573 of 2**20 rows: indices {timings['indices'] * 1e3:.2f} ms, "
          f"mask {timings['mask'] * 1e3:.2f} ms (target 5 ms)")


def test_libsublet_turns_rows_into_ranges_and_refuses_rows_out_of_order():
    # sublet_rows_ranges, the C pass behind indices over rows that tile memory: runs of
    # consecutive rows become one range; rows must ascend without repeats and lie below nrows.
    from sublet import _lib

    def ranges(rows, nrows=10, base=100, row_bytes=8):
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((max(1, len(rows)), 2), dtype=np.uint64)
        n = _lib.rows_ranges(rows.ctypes.data, len(rows), nrows, base, row_bytes,
                             out.ctypes.data)
        return out[:n].tolist()

    assert ranges([]) == []
    assert ranges([0]) == [[100, 8]]
    assert ranges([0, 1, 2, 5, 7, 8, 9]) == [[100, 24], [140, 8], [156, 24]]
    for rows, words in (([3, 2], "row 2 .index 1. is out of order"),
                        ([1, 1], "row 1 .index 1. is out of order"),
                        ([-1], "row -1 .index 0. is out of range"),
                        ([0, 10], "row 10 .index 1. is out of range")):
        with pytest.raises(_lib.SubletError, match=words):
            ranges(rows)
    with pytest.raises(_lib.SubletError, match="do not fit in 64 bits"):
        ranges([0], nrows=1 << 40, row_bytes=1 << 30)
