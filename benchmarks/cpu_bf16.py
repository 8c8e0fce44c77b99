"""Is bf16 autocast worth it on this CPU? fp32 and bf16 GFLOP/s of the demo encoder's feed-forward product
(3000x144 by 144x576), one thread, and what ``trainer.precision=auto`` would choose here
(:mod:`speechtrain.common.auto_precision`).

    python benchmarks/cpu_bf16.py [--repeats 20]

Run it on an idle machine: the timing is what ``auto`` measures when a run starts.
"""

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timings per dtype (the best one counts)")
    args = parser.parse_args(argv)
    import torch

    from speechtrain.common.auto_precision import MIN_SPEEDUP, bf16_speedup, product_gflops

    torch.set_num_threads(1)
    fp32, bf16 = (product_gflops(dtype, args.repeats, products=1) for dtype in (torch.float32, torch.bfloat16))
    speedup = bf16_speedup()
    print("| fp32 GFLOP/s | bf16 GFLOP/s | bf16 speed-up (auto's timing) | auto chooses |")
    print("|---|---|---|---|")
    print(f"| {fp32:.1f} | {bf16:.1f} | {speedup:.2f}x | {'bf16-mixed' if speedup >= MIN_SPEEDUP else '32-true'} |")


if __name__ == "__main__":
    main()
