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


# ------------------------------------------------------------------ by need (issue 42)

def test_need_and_size_arguments(br):
    assert br.parse_need("10,25,50,100") == [0.1, 0.25, 0.5, 1.0]
    assert br.parse_need("25%") == [0.25]
    for bad in ("0", "101", "x", "-5"):
        with pytest.raises(Exception, match="percent"):
            br.parse_need(bad)
    assert br.plan_size("64GiB", 139 * GiB) == br.plan_size("64", 139 * GiB) == 64 * GiB
    assert br.plan_size("16 GiB", 79 * GiB) == 16 * GiB
    with pytest.raises(Exception, match="GiB"):
        br.size_bytes("64 MB")
    a = br.build_parser().parse_args(["--need", "--size", "16GiB"])
    assert a.need == [0.1, 0.25, 0.5, 1.0] and a.size == "16GiB"
    assert br.build_parser().parse_args(["--need", "25"]).need == [0.25]
    assert br.build_parser().parse_args([]).need is None


def test_the_limit_of_a_need_is_what_the_released_pages_cannot_give(br):
    """Link bytes = max(0, need - free - (S - K)); moves: the kept bytes of the pages with the
    fewest, less those. At 100 % kept nothing moves and everything beyond free crosses; with
    whole-page rows the released pages are empty ones first."""
    bw = {"d2h": 50e9, "h2d": 50e9, "d2d": 2e12}
    per_layer = 1024                                          # 64 MiB a layer, 32 pages
    full = br.page_kept(None, per_layer)
    assert full == [[br.PAGE, 32 * br.LAYERS]]
    size = per_layer * br.BLOCK * br.LAYERS                   # 4 GiB
    lim = br.need_limit(full, size // 4 + GiB, GiB, bw)
    assert (lim["host_bytes"], lim["moved_bytes"]) == (size // 4, 0)
    assert lim["seconds"] == pytest.approx(2 * (size // 4) / 50e9)
    assert br.need_limit(full, GiB, 2 * GiB, bw)["host_bytes"] == 0   # free covers it
    rows = br.page_kept(br.row_ids(per_layer, 0.3), per_layer)
    kept = sum(k * n for k, n in rows)
    empty = sum(n for k, n in rows if k == 0)
    lim = br.need_limit(rows, empty * br.PAGE, 0, bw)          # only the empty pages go
    assert (lim["host_bytes"], lim["moved_bytes"]) == (0, 0)
    lim = br.need_limit(rows, size, 0, bw)                     # all of it: every kept byte out
    assert (lim["host_bytes"], lim["moved_bytes"]) == (kept, 0)
    blocks = br.page_kept(br.block_ids(per_layer, 0.3), per_layer)
    lim = br.need_limit(blocks, size // 2, 0, bw)              # half: the lighter half moves
    assert lim["host_bytes"] == max(0, sum(k * n for k, n in blocks) - size // 2)
    assert lim["moved_bytes"] > 0


def test_need_cases_one_tms_then_sublet_all_and_need_per_keep(br):
    cases, notes = br.plan_need_cases([0.3, 1.0], list(br.CONTENDERS), [0.25, 1.0],
                                      64 * GiB, 118 * GiB, tms_ok=True, cycles=2, tms_cycles=2)
    assert [c["label"] for c in cases] == [
        "tms all", "sublet all blocks 30%", "sublet need blocks 30%", "sublet all rows 30%",
        "sublet need rows 30%", "sublet all all 100%", "sublet need all 100%"]
    assert all(c["needs"] == [0.25, 1.0] for c in cases)
    assert [c["stay"] for c in cases[1:3]] == [0, None] and cases[2]["by_need"]
    assert any("tms best" in n for n in notes)
    cases, notes = br.plan_need_cases([1.0], ["tms-all", "sublet", "sublet-need"], [0.25],
                                      100 * GiB, 100 * GiB, tms_ok=True, cycles=1, tms_cycles=1)
    assert [c["label"] for c in cases] == ["sublet need all 100%"]
    assert sum("do not fit" in n for n in notes) == 2


def test_need_cases_pin_ahead_every_sublet_child_when_asked(br):
    def pins(**kw):
        cases, _ = br.plan_need_cases([0.3, 1.0], list(br.CONTENDERS), [0.25], 64 * GiB,
                                      118 * GiB, tms_ok=True, cycles=1, tms_cycles=1, **kw)
        return {c["label"]: c.get("pin_ahead", False) for c in cases}
    assert not any(pins().values())
    asked = pins(pin_ahead=True)
    assert asked.pop("tms all") is False and len(asked) == 6 and all(asked.values())


def need_doc(br, need_out: int) -> dict:
    """A synthetic run by need at 64 GiB, 100 % kept, a 25 % need, 14 GiB free."""
    size, free = 64 * GiB, 14 * GiB
    take = br.need_bytes(0.25, size)
    limit_host = take + br.NEED_SLACK - free

    def cycle(total: float, out: int) -> dict:
        return {"pause_s": total / 3, "take_s": total / 3, "resume_s": total / 3,
                "seconds": 2 * total / 3, "total_s": total, "free_bytes": free,
                "freed_bytes": out, "taken_bytes": take, "out_bytes": out, "in_bytes": out,
                "moved_bytes": 0}

    def result(label: str, mode: str, total: float, out: int) -> dict:
        return {"label": label, "mode": mode, "fraction": 1.0, "pattern": "all",
                "first": cycle(1.2 * total, out), "pin_ahead_s": 4.5 if mode == "sublet" else None,
                "needs": [{"fraction": 0.25, "take_bytes": take,
                           "need_bytes": take + br.NEED_SLACK,
                           "cycles": [cycle(total, out), cycle(total, out)]}]}

    return {"size": size, "bandwidth": {"d2h": 55e9, "h2d": 55e9, "d2d": 2e12},
            "probe": {"gpu": "NVIDIA H100 (synthetic)", "torch": "2.15.0",
                      "free_bytes": 78 * GiB},
            "notes": [], "results": [result("tms all", "tms", 2.9, size),
                                     result("sublet all all 100%", "sublet", 2.8, size),
                                     result("sublet need all 100%", "sublet", 0.5, need_out)],
            "limit_host": limit_host}


def test_report_by_need_prints_limits_and_judges_the_targets(br, capsys):
    doc = need_doc(br, need_out=0)
    doc["results"][2]["needs"][0]["cycles"] = [
        {**c, "out_bytes": doc["limit_host"], "in_bytes": doc["limit_host"]}
        for c in doc["results"][2]["needs"][0]["cycles"]]
    for c in doc["results"][0]["needs"][0]["cycles"]:   # tms: no subletd beside it
        c["free_bytes"] += GiB // 2
    assert br.report_need(doc) == 0
    out = capsys.readouterr().out
    assert "kept 100% (all):" in out and "need 25%: 16.00 GiB taken (16.25 GiB asked)" in out
    assert "asked), 14.00 GiB free; limit" in out                 # the judged row's
    assert "x the limit (14.50 GiB free: link 1.75 GiB" in out    # tms's own
    assert f"limit: link {br.gib(doc['limit_host'])} each way, moved 0.00 GiB" in out
    for label in ("tms all", "sublet all all 100%", "sublet need all 100%"):
        assert label in out
    assert "take 0.167" in out and "x the limit" in out
    assert "first cycles (the largest need):" in out
    assert "PASS sublet need all 100%, need 25%: link bytes = the limit's" in out
    assert "PASS sublet need 100% kept, need 25%: 3 x faster than tms all" in out
    assert "PASS sublet need all 100%: first cycle within 1.5 x a later one" in out
    assert "sublet need all 100% 0.600 s (pinned ahead in 4.500 s)" in out
    assert "(judged at 64 GiB)" not in out


def test_report_by_need_misses(br, capsys):
    doc = need_doc(br, need_out=GiB)
    doc["results"][2]["needs"][0]["cycles"][0]["total_s"] = 5.0
    doc["results"][2]["needs"][0]["cycles"][1]["total_s"] = 5.0
    mine = doc["results"][2]
    mine["first"]["seconds"] = 1.6 * mine["needs"][0]["cycles"][0]["seconds"]
    del mine["pin_ahead_s"]                       # a result of a run without --pin-ahead
    doc["results"].append({"label": "sublet need rows 30%", "error": "exit status 1"})
    assert br.report_need(doc) == 1
    out = capsys.readouterr().out
    assert "sublet need all 100% 0.600 s\n" in out  # its first cycle: nothing pinned ahead
    assert "MISS sublet need all 100%, need 25%: link bytes = the limit's" in out
    assert "MISS sublet need 100% kept, need 25%: 3 x faster than tms all" in out
    assert "MISS sublet need all 100%: first cycle within 1.5 x a later one" in out
    assert "FAILED: exit status 1" in out


def test_the_first_cycle_is_judged_against_its_need_the_largest(br):
    def row(need: float, later: float) -> dict:
        return {"label": "sublet need all 100%", "need": need, "pin_ahead_s": None,
                "first": {"seconds": 3.0}, "cycles": [{"seconds": later}]}

    rows = [row(0.1, 0.01), row(0.25, 2.5)]
    for order in (rows, rows[::-1]):
        [(name, met, text)] = br.need_first_targets(order, 64 * GiB)
        assert met and text == "3.000 s vs 2.500 s at need 25%"
    [(name, met, text)] = br.need_first_targets(rows, 4 * GiB)
    assert met is None and text.endswith("(judged at 64 GiB)")
