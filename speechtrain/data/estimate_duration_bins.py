"""Print ``bucket_duration_bins`` for a dataset config: bucket edges holding equal amounts of audio.

    python -m speechtrain.data.estimate_duration_bins train.json [more.json cuts.jsonl.gz ...] -b 30

Reads durations from the manifests' metadata only (no audio is opened) and prints YAML lines to paste under
``train_ds``.
"""

import argparse

from speechtrain.data.lhotse_loader import LoaderConfig, read_cuts


def estimate_bins(inputs: list[str], num_buckets: int, min_duration: float | None = None,
                  max_duration: float | None = None) -> list[float]:  # fmt: skip
    """``num_buckets - 1`` duration edges that split the total audio of ``inputs`` into equal parts."""
    from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

    if num_buckets < 2:
        raise ValueError(f"num_buckets must be at least 2, got {num_buckets}.")
    manifests = [p for p in inputs if not p.endswith((".jsonl", ".jsonl.gz"))]
    cut_files = [p for p in inputs if p.endswith((".jsonl", ".jsonl.gz"))]
    cfg = LoaderConfig(manifest_filepath=manifests or None, cuts_path=cut_files or None,
                       min_duration=min_duration, max_duration=max_duration)  # fmt: skip
    return [round(b, 3) for b in estimate_duration_buckets(read_cuts(cfg), num_buckets=num_buckets)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m speechtrain.data.estimate_duration_bins", description=__doc__)
    parser.add_argument("inputs", nargs="+", help="NeMo manifests (.json) and/or lhotse cuts (.jsonl[.gz])")
    parser.add_argument("-b", "--buckets", type=int, default=30, help="number of buckets")
    parser.add_argument("--min-duration", type=float)
    parser.add_argument("--max-duration", type=float)
    args = parser.parse_args(argv)
    bins = estimate_bins(args.inputs, args.buckets, args.min_duration, args.max_duration)
    print(f"num_buckets: {args.buckets}")
    print(f"bucket_duration_bins: [{', '.join(f'{b:g}' for b in bins)}]")


if __name__ == "__main__":
    main()
