"""Bucket edges for the duration-bucketing sampler (``bucket_bins_method: min_padding``)."""

from collections.abc import Sequence

import numpy as np


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
