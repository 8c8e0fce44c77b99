"""Import cost of speechtrain vs. lightning, in fresh interpreters (median of N warm runs).

python benchmarks/import_time.py [--runs 7]

The figures are appended to results/speed.jsonl (``speed.import.*``) unless ``--no-record``.
"""

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402

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
    parser.add_argument("--no-record", action="store_true", help="print only: append nothing to results/")
    args = parser.parse_args(argv)
    baseline = _time("pass", args.runs)
    times = {name: _time(code, args.runs) for name, code in CASES.items()}
    print(f"| import (median of {args.runs}, interpreter start {baseline:.3f} s subtracted) | seconds |")
    print("|---|---|")
    for name, seconds in times.items():
        print(f"| `{name}` | {seconds - baseline:.3f} |")
    ratio = (times["import speechtrain.lightning"] - baseline) / (times["import lightning"] - baseline)
    print(f"\nspeechtrain.lightning / lightning: {ratio:.3f} (target <= 1.20)")
    if not args.no_record:
        command = shlex.join(["python", "benchmarks/import_time.py", *(sys.argv[1:] if argv is None else argv)])
        own = times["import speechtrain"] - baseline
        append("speed.import.speechtrain", round(own, 3), "s", command, "without torch; interpreter start subtracted")
        append("speed.import.lightning_ratio", round(ratio, 3), "x import lightning", command, "target <= 1.20")


if __name__ == "__main__":
    main()
