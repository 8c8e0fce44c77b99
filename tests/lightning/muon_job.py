"""Two gloo ranks sharing Muon's Newton-Schulz iterations, launched by ``test_lightning_muon.py``.

    torchrun --nproc_per_node=2 muon_job.py --out result.json

Both ranks hold the same parameters and gradients (as after data-parallel reduction); each orthogonalises its share
of the matrices and one all_gather gives every rank all the updates. Rank 0 runs the same three steps in one process
without a group and writes the largest difference from it, and the largest difference between the two ranks.
"""

import argparse
import json

import torch

from speechtrain.lightning.muon import GroupedMuon

SHAPES = [(12, 8), (8, 8), (8, 12), (8, 8), (12, 8), (16, 8), (8, 8)]


def run(group):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    optimizer = GroupedMuon(params, lr=0.02, weight_decay=0.1, group=group)
    for step in range(3):
        generator = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    shared = run(torch.distributed.group.WORLD)
    gathered = [torch.empty_like(shared) for _ in range(2)]
    torch.distributed.all_gather(gathered, shared)
    if torch.distributed.get_rank() == 0:
        alone = run(None)
        report = {"ranks_differ_by": float((gathered[0] - gathered[1]).abs().max()),
                  "differs_from_one_process_by": float((shared - alone).abs().max()),
                  "moved": float((shared - run_initial()).abs().max())}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump(report, f)
    torch.distributed.destroy_process_group()


def run_initial():
    torch.manual_seed(0)
    return torch.cat([torch.randn(shape).reshape(-1) for shape in SHAPES])


if __name__ == "__main__":
    main()
