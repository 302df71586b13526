"""torch_memory_saver's own test suite, unmodified, against sublet's drop-in: its `test/` tree
(tests/python/tms_upstream/, vendored verbatim with its LICENSE) runs in a child pytest with
the drop-in installed as torch_memory_saver (`python -m sublet.compat install --target DIR`,
DIR first on the path), and each of its tests here checks that test's outcome against UPSTREAM.

UPSTREAM is the one place that says, for every upstream test, what it does without a GPU and
with one CUDA GPU, and why where it is not a pass. Without CUDA the tests that need a GPU are
not run (skipped here, saying so); those upstream skips itself (XPU, two devices, CUDA-only
paths) run and skip. An expected failure is an xfail with its reason; a test that does better
or worse than the table fails, so that the table stays true. The GPU column is what the
predictions of issue 40 and the code say until a GPU run confirms it; the cases a GPU decides
are marked gpu, so that tests/gpu runs them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from sublet.compat.__main__ import install

from conftest import CHILD_ENV
from tms_upstream_run import (FAIL, NOT_RUN, PASS, SKIP, UPSTREAM_DIR, child_env,
                              outcomes as _outcomes, pytest_command)

CUDA = torch.cuda.is_available()
NEEDS_GPU = None   # not run without a GPU

_TWO = "upstream skips it: it needs two devices (none lent yet)"
_XPU = "upstream skips it: Intel XPU only (sublet runs on CUDA)"
_CUDA_ONLY = "upstream skips it without CUDA"

# upstream test -> (without a GPU, with one CUDA GPU, why)
UPSTREAM: dict[str, tuple[str | None, str, str]] = {
    **{f"test_utils.py::{name}": (PASS, PASS, "") for name in (
        "test_get_binary_path_from_package_uses_unsuffixed_rocm_binary",
        "test_get_binary_path_from_package_keeps_cuda_suffix_selection",
        "test_change_env_leaves_absent_key_absent", "test_change_env_restores_previous_value",
        "test_cpu_backup_backend_requires_enable", "test_cpu_backup_backend_rejected_on_xpu",
        "test_cpu_backup_backend_rejects_mmap_on_rocm")},
    **{f"test_configure_subprocess.py::{name}": (PASS, PASS, "") for name in (
        "test_sets_ld_preload_when_unset", "test_prepends_without_overwriting_existing",
        "test_restores_ld_preload_after_context")},
    **{f"test_examples.py::{name}[{mode}]": row for mode in ("preload", "torch")
       for name, row in {
           "test_simple": (NEEDS_GPU, PASS, ""),
           "test_cuda_graph": (NEEDS_GPU, PASS, ""),
           "test_cpu_backup": (NEEDS_GPU, PASS, ""),
           "test_cpu_backup_multi_device_mmap_restore": (SKIP, SKIP, _TWO),
           "test_cpu_backup_backend_from_env": (SKIP, PASS, _CUDA_ONLY),
           "test_disk_backup": (FAIL, FAIL, "disk backup is refused: NotImplementedError "
                                "naming region(enable_cpu_backup=True)"),
           "test_cpu_backup_retain_from_env": (PASS, PASS, ""),
           "test_multi_device": (SKIP, SKIP, _TWO),
           "test_rl_example": (NEEDS_GPU, PASS, ""),
       }.items()},
    "test_examples.py::test_cpu_backup_rss": (SKIP, PASS, _CUDA_ONLY),
    "test_examples.py::test_cpu_backup_preload_backend_from_env": (SKIP, PASS, _CUDA_ONLY),
    "test_examples.py::test_multi_device_torch_mode": (SKIP, SKIP, _TWO),
    **{f"test_examples.py::{name}": (SKIP, SKIP, _XPU) for name in (
        "test_disable_unsupported_xpu", "test_resume_failure_injection_xpu",
        "test_cleanup_failure_injection_xpu", "test_free_failure_injection_xpu",
        "test_multi_device_sync_xpu", "test_memory_margin_unsupported_xpu")},
    "test_examples.py::test_training_engine": (NEEDS_GPU, PASS, ""),
    "test_examples.py::test_cuda_vmm_granularity": (SKIP, PASS, _CUDA_ONLY),
    "test_examples.py::test_nested_region": (NEEDS_GPU, PASS, ""),
}


def expected(nodeid: str) -> str | None:
    without, with_gpu, _ = UPSTREAM[nodeid]
    return with_gpu if CUDA else without


def _child_pytest(shim: Path, args: list[str]) -> subprocess.CompletedProcess:
    """Upstream's pytest in a child, in its own directory, under none of sublet's pytest
    configuration, with the drop-in first on the path (tms_upstream_run.py, which
    tests/tms-upstream-gpu runs it with too)."""
    return subprocess.run(pytest_command(shim.parent / "pytest.ini", args),
                          env=child_env(shim, {**os.environ, **CHILD_ENV}), cwd=UPSTREAM_DIR,
                          capture_output=True, text=True, timeout=1800)


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("tms-upstream") / "site"
    target.mkdir()
    install("torch_memory_saver", target)
    return target


@pytest.fixture(scope="module")
def results(shim) -> dict[str, tuple[str, str]]:
    """nodeid -> (outcome, message) of one child run of every test that runs here."""
    chosen = [n for n in UPSTREAM if expected(n) is not None]
    report = shim.parent / "report.xml"
    done = _child_pytest(shim, [f"--junitxml={report}", "-q", *chosen])
    if not report.exists():
        pytest.fail(f"upstream's pytest left no report:\n{done.stdout[-3000:]}"
                    f"\n{done.stderr[-3000:]}")
    return _outcomes(report)


def test_the_table_lists_every_upstream_test(shim):
    listed = _child_pytest(shim, ["--collect-only", "-q"])
    collected = {line for line in listed.stdout.splitlines() if "::" in line}
    assert collected, listed.stdout + listed.stderr
    assert collected == set(UPSTREAM), (
        f"upstream tests not in UPSTREAM: {sorted(collected - set(UPSTREAM))}; "
        f"in UPSTREAM, not upstream's: {sorted(set(UPSTREAM) - collected)}")
    assert set(NOT_RUN) <= {p.name for p in UPSTREAM_DIR.glob("test_*.py")}


def _param(nodeid: str):
    """The cases whose outcome a GPU decides are marked gpu (tests/gpu runs those)."""
    without, with_gpu, _ = UPSTREAM[nodeid]
    on_gpu = without is NEEDS_GPU or without != with_gpu
    return pytest.param(nodeid, id=nodeid, marks=[pytest.mark.gpu] if on_gpu else [])


@pytest.mark.parametrize("nodeid", [_param(n) for n in sorted(UPSTREAM)])
def test_upstream(nodeid, results):
    want = expected(nodeid)
    why = UPSTREAM[nodeid][2]
    if want is None:
        pytest.skip("needs a CUDA GPU")
    actual, message = results.get(nodeid, ("not run", "no result in the child's report"))
    if actual == want == FAIL:
        pytest.xfail(why)
    if actual == want == SKIP:
        pytest.skip(message.strip().splitlines()[0] if message.strip() else why)
    assert actual == want, (f"{nodeid}: {actual}, where UPSTREAM says {want}"
                            f"{f' ({why})' if why else ''}: update the table if sublet "
                            f"changed\n{message}")
