"""Time to build the built-in eSpeak speech corpus (the issue's target: 10,000 utterances in < 3 min on 2 cores).

python benchmarks/synthetic_corpus.py [--utterances 10000] [--workers 2]
"""

import argparse
import tempfile
import time

from speechtrain.data.speech_corpus import build_corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utterances", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        record = build_corpus(folder, seed=0, workers=args.workers, utterances=args.utterances)
        seconds = time.perf_counter() - start
    hours = sum(s["hours"] for s in record["splits"].values())
    print("\n| utterances | hours of speech | workers | build time (s) | x real time |")
    print("|---|---|---|---|---|")
    print(f"| {args.utterances} | {hours:.2f} | {args.workers} | {seconds:.0f} | {hours * 3600 / seconds:.0f} |")
    for split, info in record["splits"].items():
        print(f"- {split}: {info['utterances']} utterances, {info['hours']} h, {info['voices']} voices")


if __name__ == "__main__":
    main()
