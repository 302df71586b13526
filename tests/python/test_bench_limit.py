"""bench/benchmark.py's physical limit and keep patterns without a GPU, and bench_empty.py end
to end on the memfd backend.

The limit (least_displaced) is checked on hand-made pages; the patterns on CPU tensors: the
runs leave about half the pages without a kept byte, a changing live set is new every cycle
and the same on every run, and its bit-exact check sees one flipped bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_bench_cli import BENCH, GiB, _benchmark_module

MiB = 1 << 20
P = 2 * MiB


@pytest.fixture(scope="module")
def bm():
    return _benchmark_module()


def test_least_displaced_takes_the_emptiest_pages(bm):
    K = 64 << 10
    pages = [[0, 2], [K, 3], [4 * K, 1], [P, 2]]       # 8 pages: 2 empty, 3 light, 1, 2 full
    # Nothing beyond free memory: nothing displaced.
    assert bm.least_displaced(pages, P, 4 * MiB, 8 * MiB) == (0, 0)
    # 2 pages: the empty ones.
    assert bm.least_displaced(pages, P, 4 * MiB, 0) == (0, 0)
    # 3 pages (the job's 5 MiB rounds up): the two empty and one light.
    assert bm.least_displaced(pages, P, 5 * MiB, 0) == (K, 0)
    # 6 MiB beyond 2 MiB free: 2 pages.
    assert bm.least_displaced(pages, P, 6 * MiB, 2 * MiB) == (0, 0)
    # 5 pages: the light ones' 3 K displaced, into the hole of the page of 4 K left.
    assert bm.least_displaced(pages, P, 10 * MiB, 0) == (3 * K, 0)
    # 6 pages: 3 K + 4 K displaced; the two full pages left have no hole: to the host.
    assert bm.least_displaced(pages, P, 12 * MiB, 0) == (0, 7 * K)
    # 7 pages: 7K + P displaced; one full page left, no hole: all of it to the host.
    assert bm.least_displaced(pages, P, 14 * MiB, 0) == (0, 7 * K + P)
    # All 8 (and a job larger than the region): every kept byte to the host.
    total = 3 * K + 4 * K + 2 * P
    assert bm.least_displaced(pages, P, 40 * MiB, 0) == (0, total)


def test_least_displaced_splits_between_the_gpu_and_the_host(bm):
    # 4 pages each half kept: a job of 3 pages displaces 3 halves, one fits in the last page.
    assert bm.least_displaced([[P // 2, 4]], P, 3 * P, 0) == (P // 2, P)
    # The host part is the old rule's: max(0, kept + job - (S + F)).
    kept, job, size, free = 2 * P, 3 * P, 4 * P, 0
    assert bm.least_displaced([[P // 2, 4]], P, job, free)[1] == kept + job - (size + free)


def test_the_limit_adds_the_moves_and_the_link(bm):
    bw = {"d2h_bytes_per_s": 1e9, "h2d_bytes_per_s": 2e9, "d2d": {"bytes_per_s": 4e9}}
    cycle = {"seconds": 1.0, "out_bytes": 0, "in_bytes": 0, "phases": {}}
    assert bm.physical_limit(0.5, 1e9, 2e9, bw) == pytest.approx(0.5 + 1 + 0.5 + 1)
    result = {"free_bytes": 0, "size_bytes": 4 * P, "kept_bytes_limit": 2 * P,
              "job_bytes": 3 * P, "method": "sublet", "job": "fill",
              "cycles": [{**cycle, "page_kept": [[P // 2, 4]], "page_bytes": P},
                         cycle]}                 # a cycle of an older run: no pages
    bm.add_limits(result, bw, {"median_s": 0.5})
    first, old = result["cycles"]
    assert (first["limit_moved_bytes"], first["limit_host_bytes"]) == (P // 2, P)
    assert (old["limit_moved_bytes"], old["limit_host_bytes"]) == (0, P)
    assert first["limit_s"] > old["limit_s"]


def test_pages_kept_bytes_from_ranges(bm):
    K = 64 << 10
    hist = bm.page_kept_hist([0, 5 * MiB], [3 * MiB, K], 8 * MiB, P)  # spans pages 0-1
    assert hist == [[0, 1], [K, 1], [MiB, 1], [P, 1]]
    ids = np.array([0, 1, 40])
    assert bm.page_kept_hist(ids * K, K, 2 * P, P) == [[K, 1], [2 * K, 1]]


def test_runs_leave_half_the_pages_free(bm):
    nblocks = (16 * GiB) // bm.BLOCK
    for seed in (0, 1):
        ids = bm.run_ids(nblocks, 0.3, np.random.default_rng(seed))
        hist = bm.page_kept_hist(ids * bm.BLOCK, bm.BLOCK, 16 * GiB, P)
        empty = sum(n for k, n in hist if k == 0) / sum(n for _, n in hist)
        assert 0.27 < len(ids) / nblocks < 0.33
        assert 0.4 < empty < 0.65, empty
    uniform = bm.uniform_ids(nblocks, 0.3, np.random.default_rng(0))
    hist = bm.page_kept_hist(uniform * bm.BLOCK, bm.BLOCK, 16 * GiB, P)
    assert all(k > 0 for k, _ in hist)  # uniform blocks: every page holds some


@pytest.mark.parametrize("name", ["blocks-new", "runs-new"])
def test_a_changing_live_set_is_new_each_cycle_reproducible_and_checked_bit_for_bit(bm, name):
    tensor = torch.zeros(32 * MiB, dtype=torch.uint8)
    pattern = bm.keep_pattern(tensor, name, 0.3, seed=5)
    again = bm.keep_pattern(torch.zeros_like(tensor), name, 0.3, seed=5)
    sets = []
    for i in range(3):
        pattern.begin(i)
        again.begin(i)
        assert torch.equal(pattern.keep, again.keep)       # seeded by (seed, cycle)
        assert torch.equal(pattern.lent[pattern.keep], again.lent[again.keep])
        pattern.check(i)
        sets.append(pattern.keep.clone())
        hist = pattern.page_kept(P)
        assert sum(k * n for k, n in hist) == pattern.kept_bytes == len(pattern.keep) * bm.BLOCK
    assert not torch.equal(sets[0], sets[1]) or not torch.equal(sets[1], sets[2])
    # Stale data from the cycle before fails the check, and so does one flipped bit.
    block = int(pattern.keep[len(pattern.keep) // 2])
    pattern.lent[block, 12345] ^= 4
    with pytest.raises(bm.KeptDataChanged, match="1 words"):
        pattern.check(2)


def test_new_patterns_run_as_sublet_cases_and_the_daemon_pins_nothing_by_default(bm):
    s = bm.settings_from(bm.build_parser().parse_args(["--quick"]))
    assert s.daemon_pin_gib == 0 and set(s.patterns) >= {"runs", "blocks-new", "runs-new"}
    plan = {"free_bytes": 8 * GiB, "copy_all_sizes": [64 * GiB], "sublet_sizes": [64 * GiB]}
    patterns = {c["pattern"] for c in bm.plan_cases(s, plan) if c["method"] == "sublet"}
    assert patterns == set(bm.PATTERNS)
    ahead = bm.settings_from(bm.build_parser().parse_args(["--daemon-pin", "ahead"]))
    assert ahead.daemon_pin_gib == "ahead"
    assert not any(c.get("pin_ahead") for c in bm.plan_cases(ahead, plan))


def test_daemon_pin_owner_has_every_sublet_owner_pin_ahead_itself(bm):
    s = bm.settings_from(bm.build_parser().parse_args(["--quick", "--daemon-pin", "owner"]))
    plan = {"free_bytes": 8 * GiB, "copy_all_sizes": [64 * GiB], "sublet_sizes": [64 * GiB]}
    cases = bm.plan_cases(s, plan)
    assert s.daemon_pin_gib == "owner"
    assert all(c.get("pin_ahead") for c in cases if c["method"] == "sublet")
    assert not any(c.get("pin_ahead") for c in cases if c["method"] != "sublet")
    line = bm._case_lines({"method": "sublet", "pattern": "rows", "size_bytes": 64 * GiB,
                           "kept_fraction": 0.3, "pin_ahead_s": 4.5}, phases=False)
    assert any("pinned ahead in 4.500 s" in x for x in line)


def test_bench_empty_runs_on_memfd_beside_its_floor(native, tmp_path, monkeypatch):
    sys.path.insert(0, str(BENCH))
    try:
        import bench_empty
    finally:
        sys.path.remove(str(BENCH))
    monkeypatch.setenv("SUBLETD", str(native.subletd))  # as the run below sees it
    try:  # an installed wheel does not carry the floor's tool: tests/run builds it
        bench_empty.floor_binary()
    except FileNotFoundError as e:
        pytest.skip(f"the floor's tool is not built here: {e}")
    out = tmp_path / "empty.json"
    env = {**os.environ, "SUBLET_BACKEND": "memfd", "SUBLET_MEMFD_TOTAL": "256M",
           "SUBLET_MEMFD_PAGE_SIZE": "2M", "SUBLETD": str(native.subletd),
           "SUBLET_LIB": str(native.libsublet)}
    env.pop("SUBLET_SOCKET", None)
    done = subprocess.run([sys.executable, str(BENCH / "bench_empty.py"), "--size", "0.125",
                           "--reps", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "64 handles of 2 MiB" in done.stdout
    for figure in ("empty", "free", "release", "resume"):
        assert any(line.split()[:1] == [figure] for line in done.stdout.splitlines())
    assert "targets:" in done.stdout and ("PASS" in done.stdout or "MISS" in done.stdout)
    doc = json.loads(out.read_text())
    assert doc["floor"][0]["handles"] == doc["sublet"]["handles"] == 64
    assert [f["figure"] for f in doc["figures"]] == ["empty", "free", "release", "resume"]
