"""GPU tests of several GPUs (issue 13): lending on each GPU, NCCL collectives inside loans.

- A data-parallel job (torchrun, NCCL) whose ranks each borrow, on their own GPU, the cache an
  owner process offers there (scattered 64 KiB blocks kept); every kept byte checked by its
  owner. The one-GPU form runs the same scripts with one rank.
- One process lending on two GPUs at once, each through its own GPU's daemon, found by UUID
  under both CUDA_VISIBLE_DEVICES orders.
- A rank SIGKILLed mid-loan: both owners get their data back, the job is torn down.

Tests that need two GPUs skip with fewer. The scripts are examples/multi_gpu/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import CHILD_ENV, REPO

pytestmark = [pytest.mark.gpu, pytest.mark.daemon]
EXAMPLES = REPO / "examples" / "multi_gpu"
OWNER_GIB = 8


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_two = pytest.mark.skipif(gpus() < 2, reason="needs two CUDA GPUs "
                               f"(torch.cuda.device_count() is {gpus()})")


def env() -> dict[str, str]:
    return dict(os.environ, **CHILD_ENV, PYTHONUNBUFFERED="1")


def start_owner(name: str, device: int, seed: int) -> subprocess.Popen:
    owner = subprocess.Popen([sys.executable, str(EXAMPLES / "owner.py"), name, str(OWNER_GIB),
                              "--device", str(device), "--seed", str(seed)], env=env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = owner.stdout.readline()
    assert line.startswith("offered"), owner.stderr.read()
    return owner


def owner_result(owner: subprocess.Popen) -> dict:
    out, err = owner.communicate(timeout=300)
    assert owner.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def start_job(prefix: str, world: int, hang_rank: int | None = None) -> subprocess.Popen:
    extra = {} if hang_rank is None else {"SUBLET_EXAMPLE_HANG_RANK": str(hang_rank)}
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={world}", str(EXAMPLES / "ddp_borrower.py"), prefix,
         "--big-gib", str(OWNER_GIB // 2)],
        env=dict(env(), **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_job(world: int, prefix: str, capsys) -> None:
    owners = [start_owner(f"{prefix}{r}", r, seed=r) for r in range(world)]
    job = start_job(prefix, world)
    out, err = job.communicate(timeout=600)
    assert job.returncode == 0, err[-4000:]
    ranks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    results = [owner_result(o) for o in owners]
    assert sorted(r["rank"] for r in ranks) == list(range(world))
    assert all(r["replicas_agree"] for r in ranks)
    assert all(r["intact"] and not r["borrower_died"] for r in results)
    with capsys.disabled():
        for rank, owner in zip(sorted(ranks, key=lambda r: r["rank"]), results):
            print(f"\n  rank {rank['rank']}: NCCL's own buffers {rank['nccl_bytes'] / 2**20:.0f}"
                  f" MiB (not routed), borrower copied {rank['copied_bytes'] / 2**30:.2f} GiB;"
                  f" owner {owner['device_uuid']}: {owner['kept_bytes'] / 2**30:.2f} GiB kept,"
                  f" intact={owner['intact']}")


def test_ddp_job_borrows_on_one_gpu(capsys):
    """The multi-GPU scripts with one rank: runs on a one-GPU machine too."""
    run_job(1, "ddp1-", capsys)


@needs_two
def test_ddp_job_borrows_on_each_of_two_gpus(capsys):
    run_job(2, "ddp2-", capsys)


@needs_two
def test_a_rank_killed_mid_loan_loses_no_owner_data(capsys):
    owners = [start_owner(f"kill2-{r}", r, seed=10 + r) for r in range(2)]
    job = start_job("kill2-", 2, hang_rank=1)
    pid = None
    for line in job.stdout:  # rank 1 says "ready PID" from inside its loan
        if line.startswith("ready"):
            pid = int(line.split()[1])
            break
    assert pid is not None, job.stderr.read()[-4000:]
    os.kill(pid, signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    results = [owner_result(o) for o in owners]
    assert job.returncode != 0  # torchrun tears the other rank down and reports the failure
    assert "SIGKILL" in err or "Signal 9" in err, err[-4000:]
    assert all(r["borrower_died"] and r["intact"] for r in results), results
    with capsys.disabled():
        print(f"\n  rank 1 (pid {pid}) killed mid-loan; owners: "
              + "; ".join(f"{r['device_uuid']} intact={r['intact']}" for r in results))


TWO_GPUS = textwrap.dedent("""
    import json, uuid, torch, sublet
    out = []
    caches, keeps, before = [], [], []
    for i in range(2):
        info = sublet.info(i)  # the daemon that serves torch device i
        torch_uuid = uuid.UUID(str(torch.cuda.get_device_properties(i).uuid))
        assert info.device_uuid == f"GPU-{torch_uuid}", (info, torch_uuid)
        c = sublet.empty(4096, 1 << 20, dtype=torch.uint8, device=f"cuda:{i}")  # 4 GiB
        c.random_(0, 256)
        keep = torch.arange(i, 4096, 3, device=c.device)
        caches.append(c); keeps.append(keep); before.append(c.index_select(0, keep).cpu())
        out.append(str(torch_uuid))
    with sublet.lend(caches[0], keep=keeps[0]) as a, sublet.lend(caches[1], keep=keeps[1]) as b:
        x = [torch.randn(8192, 8192, device=f"cuda:{i}") for i in range(2)]
        y = (x[0] @ x[0]).to("cuda:1") + x[1] @ x[1]   # work on both, and a copy across
        big = [torch.empty(3 << 30, dtype=torch.uint8, device=f"cuda:{i}").fill_(7)
               for i in range(2)]
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        del x, y, big
    intact = [torch.equal(caches[i].index_select(0, keeps[i]).cpu(), before[i])
              for i in range(2)]
    print(json.dumps({"uuids": out, "intact": intact,
                      "copied": [a.copied_bytes, b.copied_bytes]}))
""")


@needs_two
@pytest.mark.parametrize("order", ["0,1", "1,0"])
def test_one_process_lends_on_two_gpus_found_by_uuid(order, capsys):
    done = subprocess.run([sys.executable, "-c", TWO_GPUS], env=dict(env(),
                          CUDA_VISIBLE_DEVICES=order), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["intact"] == [True, True]
    with capsys.disabled():
        print(f"\n  CUDA_VISIBLE_DEVICES={order}: devices 0, 1 are {result['uuids']}, each "
              f"served by its own GPU's daemon; kept bytes intact on both")
