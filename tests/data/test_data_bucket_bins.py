import math
import random

import pytest

from speechtrain.data.buckets import min_padding_bins
from speechtrain.data.lhotse_loader import LoaderConfig, build_sampler


def _skewed(count: int):
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    rng = random.Random(0)
    return CutSet.from_cuts(
        dummy_cut(i, duration=round(math.exp(rng.uniform(0.0, math.log(30.0))), 3)) for i in range(count)
    )


def _padding_and_mean_batch(cuts, cfg):
    padded = total = 0.0
    batches, seen = 0, []
    for batch in build_sampler(cuts, cfg, 0, 1):
        durations = [c.duration for c in batch]
        padded += max(durations) * len(durations) - sum(durations)
        total += max(durations) * len(durations)
        batches += 1
        seen += [c.id for c in batch]
    assert sorted(seen) == sorted(c.id for c in cuts)  # every utterance once
    return padded / total, (total - padded) / batches


def test_min_padding_edges_pad_less_than_equal_audio_edges_without_smaller_batches():
    cuts = _skewed(6000)
    lhotse = _padding_and_mean_batch(cuts, LoaderConfig(batch_duration=120, num_buckets=40))
    ours = _padding_and_mean_batch(
        cuts, LoaderConfig(batch_duration=120, num_buckets=40, bucket_bins_method="min_padding")
    )
    assert ours[0] <= 0.03 < lhotse[0]
    assert ours[1] >= 0.95 * lhotse[1]


def test_min_padding_bins_edges_are_sorted_and_fall_back_to_few_buckets():
    edges = min_padding_bins([1.0, 2.0, 3.0, 4.0] * 50, 10, batch_duration=20)
    assert edges == sorted(edges) and 1 <= len(edges) <= 3  # four distinct durations need at most 3 edges
    assert min_padding_bins([5.0], 10) == []
    with pytest.raises(ValueError, match="bucket_bins_method"):
        build_sampler(_skewed(10), LoaderConfig(batch_duration=20, bucket_bins_method="quantile"), 0, 1)
