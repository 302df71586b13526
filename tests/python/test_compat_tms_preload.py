"""sublet's preload library (preload/tms.h) as torch_memory_saver's users load it: LD_PRELOAD,
with TMS_INIT_ENABLE from the process's start (slime's trainer), regions per thread, the
original's C symbols (ctypes.CDLL(None)), on a memfd daemon. Each case runs
tms_preload_child.py in a child under the library and checks what it reports: bytes, freed
memory and errors, never times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sublet
from sublet.compat.__main__ import install
from sublet.compat.torch_memory_saver import utils

from conftest import CHILD_ENV, INSTALLED, PAGE

CHILD = Path(__file__).with_name("tms_preload_child.py")
SIZE = 3 * PAGE + 6912 % PAGE  # not a whole number of pages, as upstream's granularity test


@pytest.fixture(scope="module")
def preload() -> Path:
    try:
        return utils.get_binary_path_from_package(utils.PRELOAD_STEM)
    except utils.LibraryMissingError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def shim(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("tms-preload")
    install("torch_memory_saver", target)
    return target


@pytest.fixture(scope="module")
def child_env(memfd_daemon, preload, shim) -> dict[str, str]:
    from sublet._daemon import user_socket
    env = {**os.environ, **CHILD_ENV, "LD_PRELOAD": str(preload),
           "SUBLET_SOCKET": str(user_socket(0, "memfd"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    for name in ("TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP"):
        env.pop(name, None)
    return env


def run_child(env: dict[str, str], scenario: str, **extra: str) -> dict:
    done = subprocess.run([sys.executable, str(CHILD), scenario, str(SIZE)],
                          env={**env, **extra}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{scenario}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def test_memory_made_before_any_call_is_paused_and_comes_back(child_env):
    """And by need (issue 42): $SUBLET_RELEASE_NEED reaches the library's pause
    (tms_sublet_pause_need): one page, not the tag's 4; a need beyond everything releases it
    all, as without need."""
    found = run_child(child_env, "before_any_call", TMS_INIT_ENABLE="1",
                      TMS_INIT_ENABLE_CPU_BACKUP="1")
    assert found == {"freed": pages(SIZE), "backup_while_paused": True, "same": True,
                     "impl": "PreloadImpl", "deep_ep_get": True,
                     "freed_by_need": [PAGE, pages(SIZE)], "same_by_need": [True, True]}


def test_without_backup_the_memory_is_freed_all_the_same(child_env):
    found = run_child(child_env, "before_any_call", TMS_INIT_ENABLE="1")
    assert (found["freed"], found["backup_while_paused"]) == (pages(SIZE), None)


def test_a_region_is_the_calling_threads_and_a_tag_pauses_alone(child_env):
    found = run_child(child_env, "tags_and_threads")
    # The other thread's cudaMalloc went to the CUDA runtime, which fails without a GPU (a
    # region allocation would have succeeded).
    other = found.pop("other_thread")
    assert other["interesting"] is False and other["rc"] != 0
    assert found == {"freed_kv": pages(SIZE), "weights_untouched": True, "kv_same": True,
                     "weights_same": True}


def test_an_allocation_freed_while_paused_stays_freed(child_env):
    assert run_child(child_env, "free_while_paused") == {
        "free_rc": 0, "kept_same": True, "free_again_rc": 0}


def test_the_originals_exits_are_errors_that_say_what_to_do(child_env):
    found = run_child(child_env, "errors")
    assert "not paused: pause it first" in found["resume_active"]
    assert "paused already: resume it first" in found["pause_twice"]
    assert "hook_mode = 'torch'" in found["keep"]


def test_expandable_segments_are_refused_as_by_the_original(child_env):
    found = run_child(child_env, "expandable",
                      PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert "expandable_segments:True bypasses cudaMalloc" in found["error"]


def test_without_a_daemon_an_allocation_fails_naming_the_fix(child_env, tmp_path):
    found = run_child(child_env, "no_daemon", TMS_INIT_ENABLE="1",
                      SUBLET_SOCKET=str(tmp_path / "none.sock"))
    assert found["rc"] == 2
    assert "no subletd serves CUDA device 0" in found["error"]
    assert "SUBLET_SOCKET" in found["error"]


def test_configure_subprocess_puts_the_library_first(preload, monkeypatch):
    from sublet.compat.torch_memory_saver.hooks.mode_preload import configure_subprocess
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with configure_subprocess():
        assert os.environ["LD_PRELOAD"] == f"{preload}:/other/lib.so"
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"


def test_the_library_exports_the_originals_symbols_and_no_sublet_ones(preload):
    nm = subprocess.run(["nm", "-D", "--defined-only", str(preload)], capture_output=True,
                        text=True, check=True).stdout
    names = {line.split()[-1] for line in nm.splitlines() if line.strip()}
    assert {"cudaMalloc", "cudaFree", "tms_pause", "tms_resume", "tms_set_interesting_region",
            "tms_get_interesting_region", "tms_get_cpu_backup_pointer",
            "set_memory_margin_bytes"} <= names
    assert not [n for n in names if n.startswith("sublet_")]


# slime/ray/actor_group.py:73-94 @ 624b824, as it finds the library to LD_PRELOAD.
SLIME_LOOKUP = """
import os, torch_memory_saver
for path in ["torch_memory_saver_hook_mode_preload_cu13.abi3.so",
             "torch_memory_saver_hook_mode_preload_cu12.abi3.so",
             "torch_memory_saver_hook_mode_preload.abi3.so"]:
    dynlib_path = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)),
                               path)
    if os.path.exists(dynlib_path):
        break
else:
    raise FileNotFoundError("Cannot find torch_memory_saver dynamic library")
print(dynlib_path)
"""


@pytest.mark.skipif(not INSTALLED, reason="slime looks beside the installed package (sublet/"
                    "compat/ of a pip-installed sublet): tests/wheel runs this")
def test_slimes_lookup_finds_a_loadable_library(shim):
    env = {**os.environ, **CHILD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    found = subprocess.run([sys.executable, "-c", SLIME_LOOKUP], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    # The preloaded library answers in the process's global namespace: its version is sublet's.
    ask = ("import ctypes; f = ctypes.CDLL(None).tms_sublet_version; f.restype = ctypes.c_char_p;"
           " print(f().decode())")
    loaded = subprocess.run([sys.executable, "-c", ask], env={**env, "LD_PRELOAD": found},
                            capture_output=True, text=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == sublet.__version__
