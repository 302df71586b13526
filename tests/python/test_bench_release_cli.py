"""bench/bench_release.py without a GPU: its command line, its planning (sizes, kept blocks
and rows, the bytes that must move, which cases run and which are skipped for host memory or
a missing torch_memory_saver), and its report and PASS/MISS targets from synthetic results,
so that what the H200 run prints is checked in CI, where no GPU runs it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from test_bench_cli import GiB, run_script

BENCH = Path(__file__).resolve().parents[2] / "bench"
MiB = 1 << 20


@pytest.fixture(scope="module")
def br():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_release
    finally:
        sys.path.remove(str(BENCH))
    return bench_release


def test_quick_without_a_gpu_says_it_needs_one():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run for real")
    done = run_script("bench_release.py", "--quick")
    assert done.returncode == 2
    assert "needs a CUDA GPU" in done.stderr


def test_kept_fractions_and_sizes(br):
    assert br.parse_kept("0.3,1.0") == [0.3, 1.0]
    for bad in ("0", "1.5", "-0.2"):
        with pytest.raises(Exception, match="fraction"):
            br.parse_kept(bad)
    assert br.plan_size("64", 139 * GiB) == 64 * GiB
    biggest = br.plan_size("max", 139 * GiB)
    assert biggest == 135 * GiB and biggest % (br.LAYERS * br.ROW) == 0
    with pytest.raises(SystemExit, match="does not fit"):
        br.plan_size("138", 139 * GiB)


def test_rows_are_whole_pages_and_need_no_move(br):
    per_layer = 1024                                   # 64 MiB a layer: 8 rows of 8 MiB
    ids = br.row_ids(per_layer, 0.3)
    per_page = br.PAGE // br.BLOCK
    assert len(ids) % per_page == 0 and np.all(np.diff(ids[::per_page]) >= per_page)
    assert 0.2 <= len(ids) / per_layer <= 0.4
    assert br.must_move(ids, per_layer) == 0
    assert br.must_move(None, per_layer) == 0          # everything kept: nothing moves


def test_scattered_blocks_must_move_what_the_released_pages_held(br):
    # One layer of two pages, one kept block in each: one page stays, the other's block moves.
    assert br.must_move(np.array([0, 32]), 64, layers=1) == br.BLOCK
    # 30% random blocks: nearly every page holds some, so about 70% of the kept bytes move.
    per_layer = 16384
    ids = br.block_ids(per_layer, 0.3)
    kept = len(ids) * br.BLOCK * br.LAYERS
    assert 0.6 * kept < br.must_move(ids, per_layer) < 0.75 * kept


def test_cases_run_tms_first_and_skip_what_does_not_fit(br):
    cases, notes = br.plan_cases([0.3, 1.0], list(br.CONTENDERS), 64 * GiB, 118 * GiB,
                                 tms_ok=True, cycles=4, tms_cycles=2)
    labels = [c["label"] for c in cases]
    assert labels[0].startswith("tms all") and labels[1].startswith("tms best")
    assert "sublet blocks 30% stay=None" in labels and "sublet rows 30% stay=0" in labels
    assert "sublet all 100% stay=0" in labels
    assert any("nothing is released" in n for n in notes)
    # At 130 GiB the host holds neither tms's copy of everything nor stay=0 at 100%.
    cases, notes = br.plan_cases([0.3, 1.0], list(br.CONTENDERS), 130 * GiB, 118 * GiB,
                                 tms_ok=True, cycles=4, tms_cycles=2)
    labels = [c["label"] for c in cases]
    assert not any(x.startswith("tms all") for x in labels)
    assert "sublet all 100% stay=0" not in labels and "sublet blocks 30% stay=0" in labels
    assert sum("do not fit" in n for n in notes) == 2
    cases, notes = br.plan_cases([0.3], list(br.CONTENDERS), 64 * GiB, 118 * GiB,
                                 tms_ok=False, cycles=4, tms_cycles=2)
    assert all(c["mode"] == "sublet" for c in cases)
    assert any("torch_memory_saver: skipped" in n for n in notes)


def _cycle(seconds: float, out: int = 0, moved: int = 0, stats: dict | None = None) -> dict:
    c: dict = {"pause_s": seconds / 2, "resume_s": seconds / 2, "seconds": seconds,
         "freed_bytes": 40 * GiB, "taken_bytes": 39 * GiB, "out_bytes": out, "in_bytes": out,
         "moved_bytes": moved}
    if stats is not None:
        c["stats"] = stats
    return c


def synthetic(br, sublet_later: float, sublet_out: int, tms_later: float) -> dict:
    cases, _ = br.plan_cases([0.3, 1.0], list(br.CONTENDERS), 64 * GiB, 118 * GiB,
                             tms_ok=True, cycles=2, tms_cycles=1)
    stats = {"released_bytes": 44 * GiB, "stayed_bytes": 20 * GiB, "kept_bytes": 19 * GiB,
             "moved_bytes": 13 * GiB, "copied_bytes": sublet_out, "copied_in_bytes": sublet_out,
             "release_seconds": 0.05, "resume_seconds": 0.08, "move_seconds": 0.01}
    results = []
    for spec in cases:
        if spec["mode"] == "tms":
            seconds = tms_later if spec["split"] is None else 1.0
            results.append({**spec, "cycles": [_cycle(30.0, 64 * GiB), _cycle(seconds, 64 * GiB)],
                            "handle_sets": [[64, GiB]], "kept_bytes": 64 * GiB})
        else:
            out = sublet_out if spec["stay"] is None else spec["fraction"] * 64 * GiB
            results.append({**spec, "kept_bytes": 19 * GiB, "must_move_bytes": 13 * GiB,
                            "handles": 22528, "cycles": [
                                _cycle(0.9, int(out), 13 * GiB, stats),
                                _cycle(sublet_later, int(out), 13 * GiB, stats)]})
    bw = {"d2h": 5.4e10, "h2d": 5.4e10, "d2d": 2.0e12}
    return {"size": 64 * GiB, "bandwidth": bw, "notes": ["a note"], "results": results,
            "probe": {"gpu": "NVIDIA H200 (synthetic)", "torch": "2.11.0"},
            "floors": {r["label"]: 0.05 for r in results},
            "floor_detail": {"sublet blocks 30% stay=None": {
                "handles": 22528, "create_s": 0.1, "map_s": 0.01, "access_s": 0.02,
                "release_s": 0.03}}}


def test_report_prints_figures_limits_and_passes(br, capsys):
    assert br.report(synthetic(br, sublet_later=0.2, sublet_out=0, tms_later=3.0)) == 0
    out = capsys.readouterr().out
    assert "kept 30%:" in out and "kept 100%:" in out and "note: a note" in out
    assert "tms all (backup of everything)" in out and "tms best (kept 30% split off)" in out
    assert "limit" in out and "driver floor" in out and "must move" in out
    assert "stats: released 44.00 GiB" in out
    assert "PASS sublet blocks 30% stay=None: 5 x faster" in out
    assert "PASS nothing over the host link" in out
    assert "MISS" not in out


def test_report_misses_and_fails(br, capsys):
    doc = synthetic(br, sublet_later=1.0, sublet_out=GiB, tms_later=3.0)
    doc["results"][-1] = {**doc["results"][-1], "error": "exit status 1: kept bits changed"}
    assert br.report(doc) == 1
    out = capsys.readouterr().out
    assert "MISS sublet blocks 30% stay=None: 5 x faster" in out
    assert "MISS nothing over the host link" in out
    assert "FAILED: exit status 1: kept bits changed" in out


def test_main_runs_probe_cases_and_floor_in_order(br, monkeypatch, tmp_path, capsys):
    """The parent's glue, with the children faked: the probe sizes the run, tms runs before
    subletd starts, the floor child gets every case's handles, the JSON is written."""
    import torch
    calls = []

    def fake_child(mode: str, spec: dict, env: dict) -> dict:
        calls.append((mode, spec.get("label"), "SUBLET_SOCKET" in env))
        if mode == "probe":
            return {"free_bytes": 139 * GiB, "total_bytes": 140 * GiB, "host_bytes": 118 * GiB,
                    "bandwidth": {"d2h": 5.4e10, "h2d": 5.4e10, "d2d": 2e12},
                    "gpu": "fake", "torch": torch.__version__}
        if mode == "floor":
            return {"floors": {label: {"handles": n, "create_s": 0.1, "map_s": 0.01,
                                       "access_s": 0.01, "release_s": 0.02,
                                       "export_import_s": 0.3, "resume_s": 0.12,
                                       "floor_s": 0.14}
                               for label, [[n, _]] in ((k, v[:1]) for k, v in
                                                       spec["floors"].items())}}
        cycles = [_cycle(1.0, 0, GiB, {"released_bytes": 2 * GiB}) for _ in range(2)]
        return {"cycles": cycles, "kept_bytes": GiB, "must_move_bytes": 0, "handles": 1024,
                "handle_sets": [[64, 64 * MiB]]}

    class Daemon:
        env = {"SUBLET_SOCKET": "/nonexistent.sock"}

    class Benchmark:
        @staticmethod
        def stop_daemon(daemon):
            calls.append(("stop", None, False))

    monkeypatch.setattr(br, "run_child", fake_child)
    monkeypatch.setattr(br, "start_daemon", lambda pin, log=None: (Benchmark, Daemon()))
    monkeypatch.setattr(br, "tms_available", lambda: (True, "0.0.10"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("SUBLET_SOCKET", raising=False)
    out_json = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["bench_release.py", "--quick", "--json", str(out_json)])
    assert br.main() == 0
    modes = [c[0] for c in calls]
    assert modes[0] == "probe" and modes[-1] == "floor" and modes[-2] == "stop"
    tms_done = max(i for i, c in enumerate(calls) if c[0] == "tms")
    assert all(c[2] for c in calls if c[0] == "sublet"), "sublet children use the daemon"
    assert tms_done < min(i for i, c in enumerate(calls) if c[0] == "sublet")
    import json
    doc = json.loads(out_json.read_text())
    assert doc["size"] == 4 * GiB and len(doc["floors"]) == len(doc["results"])
    assert "targets:" in capsys.readouterr().out
