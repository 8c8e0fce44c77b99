"""Print ``bucket_duration_bins`` for a dataset config: bucket edges holding equal amounts of audio, or (``--method
min_padding``) the edges that leave the least padding in batches of ``--batch-duration`` seconds.

    python -m speechtrain.data.estimate_duration_bins train.json [more.json cuts.jsonl.gz ...] -b 30

Reads durations from the manifests' metadata only (no audio is opened) and prints YAML lines to paste under
``train_ds``.
"""

import argparse
from collections.abc import Sequence

import numpy as np

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


def min_padding_bins(durations: Sequence[float], num_buckets: int, batch_duration: float | None = None,
                     batch_size: int | None = None, points: int = 600) -> list[float]:  # fmt: skip
    """Up to ``num_buckets - 1`` duration edges that minimise the expected padding of the batches.

    A batch of a bucket holds ``m`` utterances drawn at random from it (``m`` as many of its longest as fit in
    ``batch_duration`` seconds, or ``batch_size``), padded to the longest of them, expected at the bucket's
    ``m / (m + 1)`` quantile. The padding of a bucket is then its count times that length minus its audio; dynamic
    programming over the sorted durations (grouped into ``points`` quantiles) finds the edges with the least total.
    Equal-audio edges (lhotse's estimate) give wide buckets to the short utterances, whose batches hold many and
    pad to their bucket's top; these edges narrow them.

    Args:
        durations: utterance durations (seconds, or any length unit).
        num_buckets: at most this many buckets.
        batch_duration: the sampler's padded-duration limit per batch.
        batch_size: the sampler's utterance limit per batch (both limits may be given).
        points: resolution of the search.

    Returns:
        Ascending edges; an utterance of duration ``d`` goes to the first bucket whose edge is above ``d``.
    """
    d = np.sort(np.asarray(durations, dtype=np.float64))
    if len(d) < 2 or num_buckets < 2:
        return []
    bounds = np.unique(np.linspace(0, len(d), min(points, len(d)) + 1).astype(np.int64))
    starts, ends = bounds[:-1], bounds[1:]  # group g holds d[starts[g]:ends[g]]
    prefix = np.concatenate([[0.0], np.cumsum(d)])
    first, last = np.meshgrid(np.arange(len(starts)), np.arange(len(starts)), indexing="ij")  # bucket = groups i..j
    lo, hi = starts[first], ends[last]
    count = (hi - lo).astype(np.float64)
    longest = d[hi - 1]
    per_batch = np.full_like(longest, np.inf)
    if batch_duration is not None:
        per_batch = np.maximum(1.0, np.floor(batch_duration / longest))
    if batch_size is not None:
        per_batch = np.minimum(per_batch, batch_size)
    quantile = np.where(np.isinf(per_batch), 1.0, per_batch / (per_batch + 1))
    padded_to = d[np.clip(lo + np.floor(quantile * count).astype(np.int64), lo, hi - 1)]
    cost = np.where(first <= last, count * padded_to - (prefix[hi] - prefix[lo]), np.inf)  # (i, j)
    # best[b][j]: least padding of groups 0..j in b + 1 buckets; choice[b][j]: the first group of the last bucket.
    best, choices = [cost[0]], []
    for _ in range(1, num_buckets):
        before = np.concatenate([[np.inf], best[-1][:-1]])  # groups 0..i-1 in b buckets
        total = before[:, None] + cost
        choices.append(np.argmin(total, axis=0))
        best.append(np.minimum(best[-1], total[choices[-1], np.arange(len(starts))]))
        choices[-1] = np.where(total[choices[-1], np.arange(len(starts))] < best[-2], choices[-1], -1)
    edges, j = [], len(starts) - 1
    for b in range(num_buckets - 2, -1, -1):
        i = choices[b][j]
        if i <= 0:
            continue
        edges.append(float((d[ends[i - 1] - 1] + d[starts[i]]) / 2))
        j = i - 1
    return sorted(set(edges))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m speechtrain.data.estimate_duration_bins", description=__doc__)
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
