"""Padding and speed of the lhotse dataloader.

    python benchmarks/data_loader.py [--hours 1] [--batch-duration 120]

1. Padding ratio (padded frames / all frames in the batches) and mean batch (audio seconds) without bucketing, with
   lhotse's plain ``DynamicBucketingSampler`` (equal-audio bucket edges, ``bucket_bins_method=equal_duration``) and
   with ``bucket_bins_method=min_padding`` edges, at 30 and 40 buckets, on the built-in eSpeak corpus and on a
   skewed mix of 20,000 utterances of 1-30 s (log-uniform durations, metadata only: padding depends on durations
   alone).
2. Loader throughput in audio-seconds per second (WAV reading, checks, tokenising, padding) for
   num_workers 0 and 2, on the eSpeak corpus; and with speed perturbation and gain on.
"""

import argparse
import math
import random
import time

from speechtrain.common.tokenizers import CharTokenizer
from speechtrain.corpora.speech_corpus import build_corpus
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import (
    LoaderConfig,
    build_sampler,
    get_lhotse_dataloader_from_config,
    loader_config,
    read_cuts,
)


def padding_ratio(cuts, cfg: LoaderConfig) -> tuple[float, float]:
    """Padded / all frames of the batches, and the mean audio seconds of a batch."""
    padded = total = 0.0
    batches = 0
    for batch in build_sampler(cuts, cfg, 0, 1):
        durations = [c.duration for c in batch]
        padded += max(durations) * len(durations) - sum(durations)
        total += max(durations) * len(durations)
        batches += 1
    return padded / total, (total - padded) / batches


def skewed_cuts(count: int = 20000, seed: int = 0):
    from lhotse import CutSet
    from lhotse.testing.dummies import dummy_cut

    rng = random.Random(seed)
    return CutSet.from_cuts(
        dummy_cut(i, duration=round(math.exp(rng.uniform(math.log(1.0), math.log(30.0))), 3)) for i in range(count)
    )


AUGMENT = {"speed": {"factors": [0.9, 1.1], "prob": 0.5}, "gain": {"prob": 0.5}}


def throughput(manifest: str, texts: list[str], workers: int, batch_duration: float, augment: bool = False) -> float:
    cfg = loader_config({"manifest_filepath": manifest, "batch_duration": batch_duration, "num_workers": workers,
                         "augmentation": AUGMENT if augment else {}})  # fmt: skip
    loader = get_lhotse_dataloader_from_config(
        cfg, 0, 1, AsrCutDataset.from_config(CharTokenizer.from_texts(texts), cfg)
    )
    audio = 0.0
    start = time.perf_counter()
    for batch in loader:
        audio += float(batch["audio_lens"].sum()) / 16000
    return audio / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hours", type=float, default=1.0, help="size of the eSpeak corpus used")
    parser.add_argument("--batch-duration", type=float, default=120.0)
    args = parser.parse_args(argv)
    corpus = build_corpus(hours=args.hours, seed=0)
    manifest = corpus["splits"]["train"]["manifest"]
    espeak = read_cuts(LoaderConfig(manifest_filepath=manifest))
    print(f"| data | bucketing ({args.batch_duration:g} s batches) | padding ratio | mean batch (audio s) |")
    print("|---|---|---|---|")
    settings = [("none", {"use_bucketing": False})]
    for buckets in (30, 40):
        settings.append((f"lhotse DynamicBucketingSampler, {buckets} equal-audio buckets",
                         {"num_buckets": buckets, "bucket_bins_method": "equal_duration"}))  # fmt: skip
        settings.append(
            (f"{buckets} min-padding buckets", {"num_buckets": buckets, "bucket_bins_method": "min_padding"})
        )
    for name, cuts in (("eSpeak corpus", espeak), ("skewed 1-30 s mix", skewed_cuts())):
        for label, options in settings:
            padding, mean_batch = padding_ratio(cuts, LoaderConfig(batch_duration=args.batch_duration, **options))
            print(f"| {name} | {label} | {100 * padding:.1f}% | {mean_batch:.1f} |", flush=True)
    texts = [c.supervisions[0].text for c in espeak]
    print("\n| loader (eSpeak corpus, WAV) | audio-s/s |")
    print("|---|---|")
    for workers in (0, 2):
        print(f"| num_workers={workers} | {throughput(manifest, texts, workers, args.batch_duration):.0f} |")
    for workers in (0, 2):
        rate = throughput(manifest, texts, workers, args.batch_duration, augment=True)
        print(f"| num_workers={workers}, speed (p=0.5) + gain (p=0.5) augmentation | {rate:.0f} |")


if __name__ == "__main__":
    main()
