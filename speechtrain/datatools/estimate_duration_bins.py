"""Print ``bucket_duration_bins`` for a dataset config: bucket edges holding equal amounts of audio, or (``--method
min_padding``) the edges that leave the least padding in batches of ``--batch-duration`` seconds.

    python -m speechtrain.datatools.estimate_duration_bins train.json [more.json cuts.jsonl.gz ...] -b 30

Reads durations from the manifests' metadata only (no audio is opened) and prints YAML lines to paste under
``train_ds``.
"""

import argparse

from speechtrain.data.buckets import min_padding_bins
from speechtrain.data.lhotse_loader import LoaderConfig, read_cuts


def estimate_bins(inputs: list[str], num_buckets: int, min_duration: float | None = None,
                  max_duration: float | None = None, method: str = "equal_duration",
                  batch_duration: float | None = None) -> list[float]:  # fmt: skip
    """``num_buckets - 1`` duration edges for the audio of ``inputs``: equal parts of the total audio
    (``equal_duration``, lhotse's estimate) or the least padding (``min_padding``, :func:`min_padding_bins`)."""
    from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

    if num_buckets < 2:
        raise ValueError(f"num_buckets must be at least 2, got {num_buckets}.")
    if method not in ("equal_duration", "min_padding"):
        raise ValueError(f"method must be equal_duration or min_padding, got {method!r}.")
    manifests = [p for p in inputs if not p.endswith((".jsonl", ".jsonl.gz"))]
    cut_files = [p for p in inputs if p.endswith((".jsonl", ".jsonl.gz"))]
    cfg = LoaderConfig(manifest_filepath=manifests or None, cuts_path=cut_files or None,
                       min_duration=min_duration, max_duration=max_duration)  # fmt: skip
    if method == "min_padding":
        bins = min_padding_bins([c.duration for c in read_cuts(cfg)], num_buckets, batch_duration)
    else:
        bins = estimate_duration_buckets(read_cuts(cfg), num_buckets=num_buckets)
    return [round(b, 3) for b in bins]


def main(argv: list[str] | None = None) -> None:
    prog = "python -m speechtrain.datatools.estimate_duration_bins"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    parser.add_argument("inputs", nargs="+", help="NeMo manifests (.json) and/or lhotse cuts (.jsonl[.gz])")
    parser.add_argument("-b", "--buckets", type=int, default=30, help="number of buckets")
    parser.add_argument("--min-duration", type=float)
    parser.add_argument("--max-duration", type=float)
    parser.add_argument("--method", choices=["equal_duration", "min_padding"], default="equal_duration")
    parser.add_argument("--batch-duration", type=float, help="min_padding: the batch_duration of the sampler")
    args = parser.parse_args(argv)
    bins = estimate_bins(args.inputs, args.buckets, args.min_duration, args.max_duration, args.method,
                         args.batch_duration)  # fmt: skip
    print(f"num_buckets: {args.buckets}")
    print(f"bucket_duration_bins: [{', '.join(f'{b:g}' for b in bins)}]")


if __name__ == "__main__":
    main()
