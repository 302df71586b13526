"""The benchmark scripts without a GPU: their command lines, the report from a results file,
and the chart (skipped where matplotlib is not installed).

The results file is synthetic, made here in the shape bench/benchmark.py writes, so that the
table, the targets and the plotting path are checked in CI, where no GPU runs the benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
GiB = 1 << 30


def run_script(name: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / name), *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.mark.parametrize("name", [
    "benchmark.py", "bench_daemon.py", "bench_verify.py", "bench_release.py", "bench_empty.py",
    "plot.py"])
def test_help_exits_0(name):
    done = run_script(name, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout


def test_quick_run_without_a_gpu_says_it_needs_one():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run for real")
    done = run_script("benchmark.py", "--quick", "--json", "/nonexistent/results.json")
    assert done.returncode != 0
    assert "needs a CUDA GPU" in done.stderr


def _summary(seconds: float, out_bytes: float, limit: float, n: int = 1) -> dict:
    return {"n": n, "seconds": seconds, "seconds_min": seconds, "seconds_max": seconds,
            "out_bytes": out_bytes, "in_bytes": out_bytes, "limit_s": limit,
            "ratio": seconds / limit}


def _result(method: str, pattern: str, fraction: float, size: int, first: float,
            later: float, copied: float, limit: float) -> dict:
    return {"method": method, "pattern": pattern, "fraction": fraction, "size_bytes": size,
            "free_bytes": 8 * GiB, "kept_fraction": 0.3, "run": 0, "size_note": "",
            "free_bytes_measured": 8 * GiB, "job_bytes": int(size * fraction),
            "kept_bytes": int(size * 0.3), "keep_views": 1, "kept_intact": True,
            "job_alone_s": 0.02, "error": None, "cycles": [],
            "first": _summary(first, copied, limit), "later": _summary(later, copied, limit, 3)}


def synthetic_results() -> dict:
    """Two sizes: 64 GiB with both methods, and an uncapped 120 GiB with sublet alone."""
    results = []
    for size in (64 * GiB, 120 * GiB):
        for fraction in (0.25, 0.75, 1.0):
            copied = max(0.0, fraction - 0.7) * size
            if size == 64 * GiB:
                results.append(_result("copy-all", "any", fraction, size, 42.0, 2.9, size, 2.5))
                results.append(_result("tms", "any", fraction, size, 9.0, 1.0, 0.3 * size, 0.1))
            for pattern in ("rows", "blocks", "slice"):
                results.append(_result("sublet", pattern, fraction, size, 0.5, 0.1 + copied / 5e10,
                                       copied, 0.09 + copied / 5.4e10))
    results.append({**_result("sublet", "rows", 0.5, 64 * GiB, 1, 1, 0, 1),
                    "error": "exit status 1: boom"})
    bandwidth = {"bytes": 4 * GiB, "reps": 5, "d2h_seconds": [0.08], "h2d_seconds": [0.08],
                 "d2h_bytes_per_s": 5.3e10, "h2d_bytes_per_s": 5.4e10}
    return {"schema": "sublet-benchmark/1",
            "machine": {"gpu": "NVIDIA H200 (synthetic)", "driver": "580", "torch": "2.11.0",
                        "cuda_runtime": "13.0", "host_memory_bytes": 125 * GiB},
            "runs": [{"id": 0, "started": "2026-11-29T00:00:00", "bandwidth": bandwidth,
                      "daemon": {"mode": "shared"}}],
            "results": results}


def test_report_prints_the_table_and_the_targets(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(synthetic_results()))
    done = run_script("benchmark.py", "--report", "--json", str(path))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "S = 64 GiB" in out and "S = 120 GiB" in out
    assert "copy-all" in out and "sublet blocks 30%" in out
    assert "failed: exit status 1: boom" in out
    assert "targets:" in out and "met" in out
    assert "faster than torch_memory_saver" in out
    assert "tms (split kept)" in out


def test_plot_renders_an_svg(tmp_path):
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib, which is not "
                                             "installed here (CI installs it: "
                                             "pip install matplotlib)")
    path, out = tmp_path / "results.json", tmp_path / "chart.svg"
    path.write_text(json.dumps(synthetic_results()))
    done = run_script("plot.py", "--json", str(path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def _benchmark_module():
    sys.path.insert(0, str(BENCH))
    try:
        import benchmark
    finally:
        sys.path.remove(str(BENCH))
    return benchmark


def test_default_size_is_capped_by_host_memory():
    plan = _benchmark_module().plan_sizes(
        free_bytes=139 * GiB, mem_available=118 * GiB, size_gib=None, free_gib=8,
        uncapped_sublet=True)
    assert plan["uncapped_bytes"] == 130 * GiB  # all free memory but F and 1 GiB of headroom
    assert plan["size_bytes"] == plan["host_cap_bytes"] == 106 * GiB  # 90% of MemAvailable
    assert plan["capped"]
    assert plan["copy_all_sizes"] == [106 * GiB]
    assert plan["sublet_sizes"] == [106 * GiB, 130 * GiB]


def test_explicit_and_max_sizes():
    plan_sizes = _benchmark_module().plan_sizes
    plan = plan_sizes(139 * GiB, 118 * GiB, 64.0, 8, uncapped_sublet=False)
    assert (plan["size_bytes"], plan["capped"]) == (64 * GiB, False)
    assert plan["copy_all_sizes"] == plan["sublet_sizes"] == [64 * GiB]
    plan = plan_sizes(139 * GiB, 118 * GiB, "max", 8, uncapped_sublet=False)
    assert plan["size_bytes"] == 130 * GiB
    assert plan["copy_all_sizes"] == []  # its pinned buffer would not fit in host memory
    with pytest.raises(SystemExit, match="does not fit"):
        plan_sizes(139 * GiB, 118 * GiB, 200.0, 8, uncapped_sublet=False)


def test_quick_keeps_three_later_cycles_of_sublet_and_one_of_the_slow_methods():
    """--quick: copy-all and tms take seconds a cycle and run one later cycle; sublet's take
    milliseconds, and one slow exit would be its whole later figure: it keeps three."""
    sys.path.insert(0, str(BENCH))
    try:
        import benchmark
    finally:
        sys.path.remove(str(BENCH))
    plan = {"free_bytes": 8 * GiB, "copy_all_sizes": [64 * GiB], "sublet_sizes": [64 * GiB]}
    for argv, slow, fast in ((["--quick"], 1, 3), (["--quick", "--cycles", "2"], 2, 2),
                             ([], 3, 3)):
        s = benchmark.settings_from(benchmark.build_parser().parse_args(argv))
        cycles = {c["method"]: c["cycles"] for c in benchmark.plan_cases(s, plan)}
        assert cycles == {"copy-all": slow, "tms": slow, "sublet": fast}, argv
