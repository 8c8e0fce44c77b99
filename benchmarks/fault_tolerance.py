"""Per-step cost of the fault-tolerance checks, on the bridge benchmark's model (one CPU process).

    python benchmarks/fault_tolerance.py [--repeats 200]

Times ``NonFiniteGuard.check``: the decision from the global gradient norm (which Megatron's optimizer computes
anyway for clipping) and the step's already-reduced loss, plus its fused copy of the batch-norm statistics
(``before_step``); and the ranks' agreement on the preemption flag (:class:`RankAgreement`), against the step time
of the plain loop in ``benchmarks/bridge_overhead.py``. Multi-rank runs add one all-reduce of the agreement's
flags every ``check_interval`` steps (not measured here).
"""

import argparse
import statistics
import time
from types import SimpleNamespace

import torch
from bridge_overhead import _model

from speechtrain.lightning.fault_tolerance import NonFiniteGuard
from speechtrain.lightning.limits import RankAgreement


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_flush_denormal(True)
    model = _model()
    model.configure_model()
    batch = next(iter(model.train_dataloader()))
    start = time.perf_counter()
    loss_sum, frames = model.loss_step(batch, model.forward_step(batch))
    loss = loss_sum / frames
    loss.backward()
    step = time.perf_counter() - start
    norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in model.parameters()]))))
    guard = NonFiniteGuard()
    trainer = SimpleNamespace(global_step=0)
    check, flag = [], []
    agreement = RankAgreement()
    agreement.register("preempted", lambda: False)
    for _ in range(args.repeats):
        start = time.perf_counter()
        guard.before_step(model)
        guard.observe(loss.detach(), batch)
        ok = guard.check(trainer, model, norm)
        check.append(time.perf_counter() - start)
        start = time.perf_counter()
        agreement.step = None  # a new step: the flags are evaluated again
        agreement.at_step_end(SimpleNamespace(global_step=0, world_size=1))
        flag.append(time.perf_counter() - start)
    assert ok
    params = sum(p.numel() for p in model.parameters())
    check_ms, flag_ms = 1e3 * statistics.median(check), 1e3 * statistics.median(flag)
    print(f"model: {params / 1e6:.2f}M parameters; forward + backward: {1e3 * step:.1f} ms")
    print(f"NonFiniteGuard check (from the optimizer's norm and the reduced loss): {check_ms:.3f} ms = "
          f"{100 * check_ms / (1e3 * step):.3f}%")  # fmt: skip
    print(f"preemption flag (one process): {1e3 * flag_ms:.1f} us")


if __name__ == "__main__":
    main()
