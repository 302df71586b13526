"""A data-parallel training job that borrows each GPU's offered memory (examples/multi_gpu).

    torchrun --nproc-per-node 2 ddp_borrower.py PREFIX [--big-gib G] [--steps N]

Rank r borrows the offer named PREFIX + str(r) on its own GPU (LOCAL_RANK), fills G GiB of it,
and trains a small transformer with DistributedDataParallel: gradients are all-reduced by NCCL
inside the loan, and the tensors the steps and collectives allocate are served from it. The process group is set up
and warmed before borrowing, so that NCCL's own buffers (which PyTorch cannot route) are made
from free memory outside the loan; their size is printed. Prints one JSON line per rank.
SUBLET_EXAMPLE_HANG_RANK=r makes rank r print "ready PID" and sleep inside the loan (for kill tests).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import sublet


def model(device: torch.device) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 4).to(device)


def nccl_memory(device: torch.device) -> int:
    """Bytes NCCL takes for itself on `device` at its first collective (outside PyTorch's
    allocator): the drop in free memory that PyTorch's own reservations do not explain."""
    torch.cuda.synchronize(device)
    free0, reserved0 = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    x = torch.ones(1, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize(device)
    free1, reserved1 = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
    assert x.item() == dist.get_world_size()
    return (free0 - free1) - (reserved1 - reserved0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix")
    ap.add_argument("--big-gib", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
    nccl_bytes = nccl_memory(device)
    # The model and its DDP wrapper are the job's own state, built before the loan (DDP's
    # gradient buckets live as long as the wrapper); inside the loan go the activations, the
    # gradients, the optimiser's state and the collectives' outputs.
    net = model(device)
    ddp = DistributedDataParallel(net, device_ids=[rank])
    # Two steps before the loan, as a running job has made: DDP rebuilds its gradient buckets
    # in the forward after the first backward, and buckets made inside the loan outlive it.
    for _ in range(2):
        ddp(torch.zeros(1, 8, 512, device=device)).float().mean().backward()
    net.zero_grad(set_to_none=True)
    hang = os.environ.get("SUBLET_EXAMPLE_HANG_RANK") == str(rank)

    with sublet.borrow(name=f"{args.prefix}{rank}", device=device, timeout=120) as loan:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
        big = torch.empty(args.big_gib * 1024 ** 3, dtype=torch.uint8, device=device).fill_(rank)
        g = torch.Generator(device=device).manual_seed(rank)
        for _ in range(args.steps):
            x = torch.randn(16, 256, 512, device=device, generator=g)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = ddp(x).float().pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradient buckets here
            opt.step()
        if hang:
            print("ready", os.getpid(), flush=True)
            time.sleep(600)
        # The replicas must agree after all-reduced steps.
        first = torch.cat([p.detach().reshape(-1)[:64] for p in ddp.parameters()])
        gathered = [torch.empty_like(first) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, first)
        same = all(torch.equal(gathered[0], t) for t in gathered)
        torch.cuda.synchronize(device)
        net.zero_grad(set_to_none=True)  # the gradients were made inside the loan
        del opt, big, x, loss, first, gathered
        gc.collect()
    print(json.dumps({"rank": rank, "loss": float(net(torch.zeros(1, 1, 512, device=device))
                                                    .float().abs().mean()),
                      "replicas_agree": same, "copied_bytes": loan.copied_bytes,
                      "nccl_bytes": nccl_bytes}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
