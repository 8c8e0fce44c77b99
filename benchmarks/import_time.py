"""Import cost of speechtrain vs. lightning, in fresh interpreters (median of N warm runs).

python benchmarks/import_time.py [--runs 7]
"""

import argparse
import statistics
import subprocess
import sys
import time

CASES = {
    "import speechtrain": "import speechtrain",
    "import lightning": "import lightning",
    "import speechtrain.lightning": "import speechtrain.lightning",
    "import speechtrain.asr.conv_ctc": "import speechtrain.asr.conv_ctc",
}


def _time(code: str, runs: int) -> float:
    subprocess.run([sys.executable, "-c", code], check=True)  # warm the file cache
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    baseline = _time("pass", args.runs)
    times = {name: _time(code, args.runs) for name, code in CASES.items()}
    print(f"| import (median of {args.runs}, interpreter start {baseline:.3f} s subtracted) | seconds |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| `{name}` | {seconds - baseline:.3f} |")
    ratio = (times["import speechtrain.lightning"] - baseline) / (times["import lightning"] - baseline)
    print(f"\nspeechtrain.lightning / lightning: {ratio:.3f} (target <= 1.20)")


if __name__ == "__main__":
    main()
