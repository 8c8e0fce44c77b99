"""Time to build the built-in corpora: the eSpeak speech corpus (the first target: 10,000 utterances in < 3 min on
2 cores), or the multi-engine ``builtin:speech`` corpus, with one or more synthesis process counts taking turns.

python benchmarks/synthetic_corpus.py [--utterances 10000] [--workers 2]
python benchmarks/synthetic_corpus.py --speech-hours 1 --workers 2 3 --repeats 2   # the multi-engine corpus
"""

import argparse
import tempfile
import time

from speechtrain.corpora.speech_corpus import build_corpus, build_speech_corpus


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--utterances", type=int, default=10_000)
    parser.add_argument("--speech-hours", type=float, default=0.0, help="build builtin:speech of these hours instead")
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    print("\n| corpus | hours of speech | workers | build time (s) | x real time | CPU use (cores) |")
    print("|---|---|---|---|---|---|")
    for _ in range(args.repeats):
        for workers in args.workers:
            with tempfile.TemporaryDirectory() as folder:
                start, cpu = time.perf_counter(), time.process_time()
                children = _children_cpu()
                if args.speech_hours:
                    record = build_speech_corpus(folder, hours=args.speech_hours, workers=workers)
                    name = f"builtin:speech {args.speech_hours:g} h"
                else:
                    record = build_corpus(folder, seed=0, workers=workers, utterances=args.utterances)
                    name = f"eSpeak, {args.utterances} utterances"
                seconds = time.perf_counter() - start
                used = (time.process_time() - cpu + _children_cpu() - children) / seconds
            hours = sum(s["hours"] for s in record["splits"].values())
            print(f"| {name} | {hours:.2f} | {workers} | {seconds:.0f} | {hours * 3600 / seconds:.0f} | {used:.2f} |",
                  flush=True)  # fmt: skip


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the synthesis pool and the engines it started)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
