"""Two ranks check GradientBuckets: launched during backward, in order, exact sums; no_sync only accumulates.
Launched by test_lightning_grad_buckets.py with torchrun; rank 0 prints "ok"."""

import torch

from speechtrain.lightning.grad_buckets import GradientBuckets


def main() -> None:
    torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    buckets = GradientBuckets(model, torch.distributed.group.WORLD, bucket_bytes=1)  # one parameter per bucket
    assert len(buckets.buckets) == 6 and buckets.buckets[0][0] is model[2].bias  # backward order

    launched_during_backward = []
    x = torch.full((3, 4), float(rank + 1), requires_grad=True)
    x.register_hook(lambda grad: launched_during_backward.append(len(buckets._pending)))  # the end of backward
    with buckets.no_sync():
        model(x).sum().backward()  # micro-batch 1: accumulate only
    assert not buckets._pending
    model(x).sum().backward()  # micro-batch 2: synchronised
    # Most buckets are in flight before backward reaches the input (the first layer's weight may follow it).
    assert launched_during_backward[0] == 0 and launched_during_backward[1] >= 5, launched_during_backward
    local = [p.grad.clone() for p in model.parameters()]
    buckets.finish(torch.tensor(4.0))

    gathered = [[torch.empty_like(g) for g in local] for _ in range(2)]
    for i, g in enumerate(local):
        torch.distributed.all_gather([gathered[r][i] for r in range(2)], g)
    for i, p in enumerate(model.parameters()):
        torch.testing.assert_close(p.grad, (gathered[0][i] + gathered[1][i]) / 4.0)
    if rank == 0:
        print("ok")


if __name__ == "__main__":
    main()
