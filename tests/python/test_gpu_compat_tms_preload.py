"""GPU tests of sublet's preload library (preload/tms.h) as slime and SGLang run
torch_memory_saver: children started with it in LD_PRELOAD (tms_preload_gpu_child.py), a
process that knows nothing of sublet taking the freed memory between pause and resume, every
kept byte compared as bits. The trainer's case starts in a runtime directory of its own, so
that the library finds no daemon and starts this user's. Skipped without CUDA.

    python3 -m pytest tests/python/test_gpu_compat_tms_preload.py -m gpu -s
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sublet.compat.__main__ import install
from sublet.compat.torch_memory_saver import utils

from conftest import CHILD_ENV
from test_gpu import settled_free_memory

CHILD = Path(__file__).with_name("tms_preload_gpu_child.py")
MiB = 1024 ** 2
pytestmark = [pytest.mark.gpu, pytest.mark.daemon]


@pytest.fixture(scope="module")
def child_env(native, tmp_path_factory) -> dict[str, str]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shim = tmp_path_factory.mktemp("tms-preload-gpu")
    install("torch_memory_saver", shim)
    env = {**os.environ, **CHILD_ENV,
           "LD_PRELOAD": str(utils.get_binary_path_from_package(utils.PRELOAD_STEM))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    for name in ("SUBLET_BACKEND", "SUBLET_SOCKET", "TMS_INIT_ENABLE",
                 "TMS_INIT_ENABLE_CPU_BACKUP"):
        env.pop(name, None)
    return env


def run_child(env: dict[str, str], scenario: str, **extra: str) -> dict:
    settled_free_memory()
    done = subprocess.run([sys.executable, str(CHILD), scenario], env={**env, **extra},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{scenario}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    print(scenario, done.stdout.strip().splitlines()[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_trainers_memory_from_process_start_is_released_and_back(child_env, tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    found = run_child(child_env, "trainer_from_start", TMS_INIT_ENABLE="1",
                      TMS_INIT_ENABLE_CPU_BACKUP="1", XDG_RUNTIME_DIR=str(runtime))
    assert found["impl"] == "PreloadImpl"
    assert found["freed"] >= found["held"]       # the model and the optimizer state, at least
    assert found["taken"] > 0 and found["plain"] == 64 * MiB
    assert found["same"] is True
    started = list((runtime / "sublet").glob("GPU-*.sock"))
    assert len(started) == 1, "the library started this user's daemon for the GPU"
    subprocess.run(["pkill", "-TERM", "-F", str(started[0].with_suffix(".pid"))], check=False)


def test_sglangs_pause_order_with_a_pauseable_cuda_graph(child_env):
    found = run_child(child_env, "sglang_order")
    assert found["freed"] >= found["kv_bytes"] + 128 * MiB
    assert found["taken"] > 0
    assert (found["weights_same"], found["graph_same"]) == (True, True)


def test_a_thread_beside_a_region_keeps_plain_memory(child_env):
    found = run_child(child_env, "thread_beside")
    assert found["freed"] >= found["kv"]
    assert (found["plain_while_paused"], found["kv_same"]) == (True, True)
