"""One dataloader builder for every model: manifests or lhotse cuts -> filters -> duration-bucketed batches,
sharded by data-parallel rank.

Inputs (NeMo's config vocabulary): ``manifest_filepath`` (NeMo JSON lines) and/or ``cuts_path`` (lhotse
CutSet ``.jsonl``/``.jsonl.gz``) and/or ``shar_path`` (lhotse Shar folder), all read lazily (memory does not grow
with their length), or a NeMo tarred dataset (``is_tarred: true`` with ``tarred_audio_filepaths``; see
:mod:`speechtrain.data.nemo_adapters`). Batches are built by lhotse's samplers:

- ``use_bucketing`` groups utterances of similar duration into ``num_buckets`` buckets (bins from
  ``bucket_duration_bins``, or estimated from the data: ``bucket_bins_method`` ``equal_duration``, the default, is
  lhotse's equal audio per bucket; ``min_padding`` places the edges where the batches of ``batch_duration`` seconds
  pad least, for in-memory data with a duration limit), so batches carry little
  padding; each batch holds ``batch_duration`` seconds of audio (``quadratic_duration`` q charges d + d^2/q, for
  models whose cost grows with length squared), or a fixed ``batch_size``, or per-bucket ``bucket_batch_size``.
  With both ``batch_size`` and ``batch_duration``, both limits hold: a batch closes at whichever it reaches first
  (logged at start). ``bucket_batch_size`` replaces both (setting them too is an error, never a silent choice).
- Sharding is by data-parallel rank: each rank takes every ``dp_world_size``-th batch of one shared, seeded
  stream, so every utterance is used once per epoch across ranks and all ranks take the same number of steps.
  Tarred data is split by shard instead: each rank reads its own shards (:class:`StreamSampler`).

- Exact resume: the sampler is wrapped in :class:`ResumableSampler`, which can start an epoch after the batches a
  checkpoint says were already trained on (``SpeechModel`` saves and restores that position).

- ``input_cfg`` blends several sources by weight, with ``tags`` attached to their cuts (:func:`blend_sources`).
- Filters: ``min_duration``/``max_duration`` (seconds) and ``min_tps``/``max_tps`` (transcript tokens per second,
  counted with the dataset's tokenizer; catches misaligned transcripts). What they drop is logged at start.
- Audio at another rate than ``sample_rate`` is resampled on the fly (``resample: false`` skips it instead);
  ``augmentation`` (speed, gain, noise; :mod:`speechtrain.data.augment`) is applied by the dataset.
- Untrusted files: lhotse cuts whose audio would come from a ``command`` or a ``url`` source are refused as the
  sampler meets them, before any audio is read; up to ``skip_bad_lines`` bad lines per lazy manifest and pass, and
  NeMo tar members that are missing, over ``max_tar_member_bytes`` or not audio, are skipped and counted; audio
  longer than its manifest ``duration`` by over ``duration_tolerance`` seconds is read up to that duration and
  counted.

The sampler yields :class:`CutBatch` es (cuts and epoch); the datasets of :mod:`speechtrain.data.cut_datasets` turn
them into tensors.
"""

import dataclasses
import functools
import itertools
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader

from speechtrain.data.audio_text import check_audio_sources, unusable_reason
from speechtrain.data.augment import AugmentationConfig
from speechtrain.data.buckets import min_padding_bins
from speechtrain.data.manifest import DEFAULT_SKIP_BAD_LINES, scan_manifest
from speechtrain.data.nemo_adapters import (
    DEFAULT_MAX_TAR_MEMBER_BYTES,
    LazyNeMoManifest,
    LazyNeMoTarredIterator,
    expand_paths,
)

logger = logging.getLogger("speechtrain.data")


@dataclass
class LoaderConfig:
    """A dataset node (``train_ds``, ``validation_ds``): what to read and how to batch it. See module docstring."""

    manifest_filepath: Any = None
    cuts_path: Any = None
    shar_path: str | None = None
    input_cfg: list[Any] | None = None
    is_tarred: bool = False
    tarred_audio_filepaths: Any = None
    sample_rate: int = 16000
    resample: bool = True
    min_duration: float | None = None
    max_duration: float | None = None
    min_tps: float | None = None
    max_tps: float | None = None
    batch_size: int | None = None
    batch_duration: float | None = None
    quadratic_duration: float | None = None
    use_bucketing: bool = True
    num_buckets: int = 30
    bucket_duration_bins: list[float] | None = None
    bucket_bins_method: str = "equal_duration"
    bucket_batch_size: list[int] | None = None
    bucket_buffer_size: int = 10000
    shuffle: bool = True
    shuffle_buffer_size: int = 10000
    seed: int = 0
    num_workers: int = 0
    pin_memory: bool = False
    drop_last: bool = False
    augmentation: AugmentationConfig = field(default_factory=AugmentationConfig)
    skip_bad_lines: int = DEFAULT_SKIP_BAD_LINES
    # read every NeMo manifest of the set once at start: bad lines counted and named before the run, and a set
    # with more than skip_bad_lines of them refused then (costs one read of each manifest per loader build)
    scan_manifests: bool = False
    max_tar_member_bytes: int = DEFAULT_MAX_TAR_MEMBER_BYTES
    duration_tolerance: float = 1.0

    def __post_init__(self) -> None:
        for key in ("skip_bad_lines", "max_tar_member_bytes", "duration_tolerance"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key}={getattr(self, key)}: must be >= 0.")
        # input_cfg names all of the data: a manifest set beside it (a command-line override of a recipe that
        # blends, or a fine-tuning set over an archive's blend) would otherwise be read together with the blend.
        if self.input_cfg:
            given = {k: getattr(self, k) for k in ("manifest_filepath", "cuts_path", "shar_path") if getattr(self, k)}
            if given:
                key, value = next(iter(given.items()))
                raise ValueError(
                    f"The dataset names its data twice: input_cfg and {key}={value}. Set one of them: "
                    f"input_cfg=null to read {key} alone, or {key}=null to read the input_cfg blend."
                )


class CutBatch(NamedTuple):
    """What the sampler yields: a batch of cuts and the epoch it belongs to (seeds the augmentations)."""

    cuts: Any
    epoch: int


def loader_config(cfg: "LoaderConfig | Any") -> LoaderConfig:
    """``cfg`` (a :class:`LoaderConfig` or a mapping / DictConfig of its keys) as a checked :class:`LoaderConfig`;
    an unknown key fails with the closest known one."""
    if isinstance(cfg, LoaderConfig):
        return cfg
    from omegaconf import DictConfig, OmegaConf

    from speechtrain.common.config import validate_config

    plain = OmegaConf.to_container(cfg) if isinstance(cfg, DictConfig) else dict(cfg)
    return OmegaConf.to_object(validate_config(plain, LoaderConfig))


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | Path):
        return [str(value)]
    return [str(v) for v in value]


def cuts_from_nemo_manifest(
    path: str | Path, sample_rate: int, skip_bad_lines: int = DEFAULT_SKIP_BAD_LINES, scan: bool = False
) -> Any:
    """A lazy lhotse CutSet for a NeMo manifest: read line by line while the sampler iterates (no audio is opened
    here, and memory does not grow with the manifest's length). See
    :class:`~speechtrain.data.nemo_adapters.LazyNeMoManifest`. ``scan``: read it through once now
    (:func:`~speechtrain.data.manifest.scan_manifest`)."""
    from lhotse import CutSet

    if scan:
        scan_manifest(path, skip_bad_lines)

    return CutSet(LazyNeMoManifest(path, sample_rate, skip_bad_lines))


def cuts_from_lhotse_manifest(path: str | Path) -> Any:
    """A lhotse CutSet manifest, read lazily when it is JSON lines (``.jsonl``, ``.jsonl.gz``). A cut whose audio
    would come from a command or a URL is refused when the sampler meets it
    (:func:`~speechtrain.data.audio_text.check_audio_sources`)."""
    from lhotse import CutSet

    if ".jsonl" in Path(path).name:
        if not Path(path).is_file():
            raise FileNotFoundError(f"cuts_path: no such file: {path}")
        return CutSet.from_jsonl_lazy(path).map(check_audio_sources)
    return CutSet.from_file(path).map(check_audio_sources)


def cuts_from_shar(path: str | Path) -> Any:
    """A lhotse Shar folder's cuts, lazily; sources checked as in :func:`cuts_from_lhotse_manifest`."""
    from lhotse import CutSet

    return CutSet.from_shar(in_dir=path).map(check_audio_sources)


def _chain(parts: list[Any]) -> Any:
    from lhotse import CutSet
    from lhotse.lazy import LazyIteratorChain

    return parts[0] if len(parts) == 1 else CutSet(LazyIteratorChain(*parts))


_SOURCE_KEYS = {
    "nemo": {"manifest_filepath"},
    "lhotse": {"cuts_path"},
    "lhotse_shar": {"shar_path"},
    "group": {"input_cfg"},
}


def _source(entry: Any, sample_rate: int, seed: int, where: str, skip_bad_lines: int, scan: bool = False) -> Any:
    entry = dict(entry)
    kind = entry.get("type", "nemo")
    if kind not in _SOURCE_KEYS:
        raise ValueError(f"{where}.type={kind!r} is not a source type; choose one of {', '.join(_SOURCE_KEYS)}.")
    allowed = _SOURCE_KEYS[kind] | {"type", "weight", "tags", "repeat"}
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown} for a {kind!r} source; allowed: {sorted(allowed)}.")
    missing = sorted(_SOURCE_KEYS[kind] - set(entry))
    if missing:
        raise ValueError(f"{where}: a {kind!r} source needs {missing[0]}.")
    repeat = entry.get("repeat", 1)
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"{where}.repeat must be a whole number >= 1, got {repeat!r}.")
    if kind == "nemo":
        from speechtrain.corpora.builtin import resolve_manifest

        cuts = cuts_from_nemo_manifest(resolve_manifest(entry["manifest_filepath"]), sample_rate, skip_bad_lines, scan)
    elif kind == "lhotse":
        cuts = cuts_from_lhotse_manifest(entry["cuts_path"])
    elif kind == "lhotse_shar":
        cuts = cuts_from_shar(entry["shar_path"])
    else:
        cuts = blend_sources(entry["input_cfg"], sample_rate, seed, where=f"{where}.input_cfg",
                             skip_bad_lines=skip_bad_lines, scan=scan)  # fmt: skip
    tags = dict(entry.get("tags") or {})
    if tags:
        cuts = cuts.map(functools.partial(_with_tags, tags=tags))
    # lhotse's repeat gives each pass's cuts their own ids (``<id>_repeat<n>``), so a sampler sees no duplicates.
    return cuts.repeat(times=repeat) if repeat > 1 else cuts


def _with_tags(cut: Any, tags: dict[str, Any]) -> Any:
    cut.custom = {**(cut.custom or {}), **tags}
    return cut


def blend_sources(
    sources: list[Any],
    sample_rate: int,
    seed: int = 0,
    where: str = "input_cfg",
    skip_bad_lines: int = DEFAULT_SKIP_BAD_LINES,
    scan: bool = False,
) -> Any:
    """Mix the sources of an ``input_cfg`` list by their ``weight`` (default 1; groups nest, weights multiply).

    Each source is ``{type: nemo|lhotse|lhotse_shar|group, <its path key>, weight, tags, repeat}``; ``tags`` become
    custom fields of every cut of that source; ``repeat: n`` reads the source n times per epoch (default 1), to
    weight a small source without shortening the others. ``builtin:`` names are resolved. While every source still
    has data, cuts are drawn from source i with probability ``weight_i / sum(weights)``; every cut of every source
    (times its repeat) is used once per epoch. Weights proportional to each source's cuts (times its repeat) make
    the sources run out together, so every stretch of the epoch has the same mix.
    """
    from lhotse import CutSet

    if not sources:
        raise ValueError(f"{where} is empty.")
    parts, weights = [], []
    for index, entry in enumerate(sources):
        weight = float(dict(entry).get("weight", 1.0))
        if weight <= 0:
            raise ValueError(f"{where}[{index}].weight must be positive, got {weight}.")
        parts.append(_source(entry, sample_rate, seed, f"{where}[{index}]", skip_bad_lines, scan))
        weights.append(weight)
    return parts[0] if len(parts) == 1 else CutSet.mux(*parts, weights=weights, seed=seed)


def read_cuts(cfg: LoaderConfig, tokenizer: Any = None) -> Any:
    """All inputs of ``cfg`` as one lazy CutSet, filtered by duration and by tokens per second (which needs
    ``tokenizer``). NeMo tarred data is read by :func:`read_tarred_cuts` instead (it is split by rank)."""

    if cfg.is_tarred or _names_tarred(cfg.input_cfg):
        raise ValueError("NeMo tarred data is read per data-parallel rank: use read_tarred_cuts.")
    parts = [cuts_from_nemo_manifest(p, cfg.sample_rate, cfg.skip_bad_lines, cfg.scan_manifests)
             for p in _as_list(cfg.manifest_filepath)]  # fmt: skip
    parts += [cuts_from_lhotse_manifest(p) for p in _as_list(cfg.cuts_path)]
    if cfg.shar_path:
        parts.append(cuts_from_shar(cfg.shar_path))
    if cfg.input_cfg:
        parts.append(blend_sources(cfg.input_cfg, cfg.sample_rate, cfg.seed, skip_bad_lines=cfg.skip_bad_lines,
                                   scan=cfg.scan_manifests))  # fmt: skip
    if not parts:
        raise ValueError("The dataset config names no data: set manifest_filepath, cuts_path or shar_path.")
    return _filtered(_chain(parts), cfg, tokenizer)


def _filtered(cuts: Any, cfg: LoaderConfig, tokenizer: Any) -> Any:
    keep = _CutFilter(cfg, tokenizer)
    if not keep.active:
        return cuts
    # Lazy: what the filters drop is known once a pass has read the data (ResumableSampler logs it then).
    return cuts.filter(keep)


def read_tarred_cuts(
    cfg: LoaderConfig, dp_rank: int, dp_world_size: int, tokenizer: Any = None
) -> tuple[Any, list[LazyNeMoTarredIterator]]:
    """This data-parallel rank's endless stream of cuts of a NeMo tarred dataset (``is_tarred: true``), filtered,
    and the tarred readers behind it.

    ``tarred_audio_filepaths`` and ``manifest_filepath`` are brace patterns or lists of them (one dataset), or
    lists of lists of them (several datasets, blended in proportion to their shard counts). Or ``input_cfg`` lists
    ``{type: nemo_tarred, manifest_filepath, tarred_audio_filepaths, weight, tags}`` sources (and groups of them),
    blended by weight. See :mod:`speechtrain.data.nemo_adapters` for the sharding.
    """
    from lhotse import CutSet

    readers: list[LazyNeMoTarredIterator] = []

    def dataset(manifests: Any, tars: Any, where: str) -> Any:
        manifests = expand_paths(manifests, f"{where}manifest_filepath")
        for manifest in manifests if cfg.scan_manifests else ():
            scan_manifest(manifest, cfg.skip_bad_lines)
        reader = LazyNeMoTarredIterator(
            manifests, expand_paths(tars, f"{where}tarred_audio_filepaths"),
            cfg.sample_rate, dp_rank, dp_world_size, seed=cfg.seed, shuffle_shards=cfg.shuffle,
            max_member_bytes=cfg.max_tar_member_bytes, skip_bad_lines=cfg.skip_bad_lines,
        )  # fmt: skip
        readers.append(reader)
        return CutSet(reader)

    def blend(entries: list[Any], where: str) -> Any:
        parts, weights = [], []
        for index, entry in enumerate(entries):
            entry, at = dict(entry), f"{where}[{index}]"
            kind = entry.get("type", "nemo")
            if kind == "group":
                part = blend(entry.get("input_cfg") or [], f"{at}.input_cfg")
            elif kind == "nemo_tarred":
                allowed = {"type", "weight", "tags", "manifest_filepath", "tarred_audio_filepaths"}
                unknown = sorted(set(entry) - allowed)
                if unknown:
                    raise ValueError(f"{at}: unknown key(s) {unknown} for a 'nemo_tarred' source; allowed: "
                                     f"{sorted(allowed)}.")  # fmt: skip
                part = dataset(entry.get("manifest_filepath"), entry.get("tarred_audio_filepaths"), f"{at}.")
            else:
                raise ValueError(
                    f"{at}.type={kind!r}: a blend with nemo_tarred sources holds only nemo_tarred sources (and groups "
                    "of them): each rank reads its own shards, and other sources would be read whole by every rank."
                )
            if entry.get("tags"):
                part = part.map(functools.partial(_with_tags, tags=dict(entry["tags"])))
            parts.append(part)
            weights.append(float(entry.get("weight", 1.0)))
        if not parts:
            raise ValueError(f"{where} is empty.")
        return parts[0] if len(parts) == 1 else CutSet.mux(*parts, weights=weights, seed=cfg.seed)

    if cfg.input_cfg:
        return _filtered(blend(list(cfg.input_cfg), "input_cfg"), cfg, tokenizer), readers
    tars, manifests = cfg.tarred_audio_filepaths, cfg.manifest_filepath
    if not tars or not manifests:
        raise ValueError("is_tarred: true needs tarred_audio_filepaths and manifest_filepath.")
    if isinstance(tars, list | tuple) and any(isinstance(t, list | tuple) for t in tars):
        if isinstance(manifests, str) or len(manifests) != len(tars):
            raise ValueError(
                f"tarred_audio_filepaths is a list of {len(tars)} datasets (lists of tars): manifest_filepath must be "
                "a list of as many manifest lists, in the same order."
            )
        parts = [dataset(m, t, f"[{i}].") for i, (m, t) in enumerate(zip(manifests, tars))]
        weights = [len(r.tars) for r in readers]
        cuts = CutSet.mux(*parts, weights=weights, seed=cfg.seed)
    else:
        cuts = dataset(manifests, tars, "")
    return _filtered(cuts, cfg, tokenizer), readers


def _names_tarred(entries: Any) -> bool:
    """Whether an ``input_cfg`` list names a ``nemo_tarred`` source (at any depth)."""
    for entry in entries or []:
        entry = dict(entry)
        if entry.get("type") == "nemo_tarred" or (
            entry.get("type") == "group" and _names_tarred(entry.get("input_cfg"))
        ):
            return True
    return False


def _metadata_duration_bins(readers: list[LazyNeMoTarredIterator], cfg: LoaderConfig) -> list[float]:
    """Bucket bins estimated from the manifests of tarred data (lhotse would read 10,000 utterances' audio)."""
    from lhotse import CutSet
    from lhotse.dataset.sampling.dynamic_bucketing import estimate_duration_buckets

    keep = _CutFilter(cfg, None) if cfg.min_tps is None and cfg.max_tps is None else None
    per_reader = max(1, 10_000 // len(readers))
    cuts = [c for r in readers for c in r.iter_metadata(per_reader) if keep is None or not keep.active or keep(c)]
    bins = estimate_duration_buckets(CutSet.from_cuts(cuts), num_buckets=cfg.num_buckets)
    logger.info("tarred data: bucket_duration_bins estimated from %d manifest entries: %s", len(cuts),
                [round(b, 3) for b in bins])  # fmt: skip
    return list(bins)


class _CutFilter:
    """Duration and tokens-per-second limits as a picklable predicate that counts what it drops."""

    def __init__(self, cfg: LoaderConfig, tokenizer: Any) -> None:
        self.min_duration, self.max_duration = cfg.min_duration, cfg.max_duration
        self.min_tps, self.max_tps = cfg.min_tps, cfg.max_tps
        if (self.min_tps is not None or self.max_tps is not None) and tokenizer is None:
            raise ValueError("min_tps/max_tps count transcript tokens: they need a dataset with a tokenizer.")
        for low, high, name in ((self.min_duration, self.max_duration, "duration"),
                                (self.min_tps, self.max_tps, "tps")):  # fmt: skip
            if low is not None and high is not None and low > high:
                raise ValueError(f"min_{name}={low} is larger than max_{name}={high}.")
        self.tokenizer = tokenizer
        self.active = any(v is not None for v in (self.min_duration, self.max_duration, self.min_tps, self.max_tps))
        self.dropped: dict[str, int] = {}
        self.seen = 0

    def _drop(self, reason: str) -> bool:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        return False

    def report(self) -> str:
        """``kept K of N utterances (dropped: reason=count, ...)`` since the last :meth:`reset`."""
        dropped = ", ".join(f"{reason}={count}" for reason, count in sorted(self.dropped.items())) or "none"
        return f"kept {self.seen - sum(self.dropped.values())} of {self.seen} utterances (dropped: {dropped})"

    def reset(self) -> None:
        self.dropped, self.seen = {}, 0

    def __call__(self, cut: Any) -> bool:
        if unusable_reason(cut) is not None:
            return True  # a placeholder for a bad entry: the dataset counts it (see speechtrain.data.audio_text)
        self.seen += 1
        if self.min_duration is not None and cut.duration < self.min_duration:
            return self._drop("too_short")
        if self.max_duration is not None and cut.duration > self.max_duration:
            return self._drop("too_long")
        if self.min_tps is None and self.max_tps is None:
            return True
        text = " ".join(s.text or "" for s in cut.supervisions)
        try:
            tps = len(self.tokenizer.encode(text)) / max(cut.duration, 1e-6)
        except ValueError:
            return True  # the dataset skips and counts untokenizable transcripts when it reads them
        if self.min_tps is not None and tps < self.min_tps:
            return self._drop("too_few_tokens_per_second")
        if self.max_tps is not None and tps > self.max_tps:
            return self._drop("too_many_tokens_per_second")
        return True


def build_sampler(cuts: Any, cfg: LoaderConfig, dp_rank: int, dp_world_size: int, constraint: Any = None) -> Any:
    """The lhotse sampler that ``cfg`` describes, sharded by data-parallel rank. ``constraint``: a lhotse
    ``SamplingConstraint`` that measures and batches cuts in other units than seconds (e.g. SALM's total length);
    bucket bins are then in its units."""
    with warnings.catch_warnings():
        # Small in-memory cut sets (tests, tools) are fine; lhotse would suggest lazy reading.
        warnings.filterwarnings("ignore", message=".*eagerly read CutSet.*")
        return _build_sampler(cuts, cfg, dp_rank, dp_world_size, constraint)


def _build_sampler(cuts: Any, cfg: LoaderConfig, dp_rank: int, dp_world_size: int, constraint: Any = None) -> Any:
    from lhotse.dataset import DynamicBucketingSampler, DynamicCutSampler
    from lhotse.dataset.sampling.dynamic_bucketing import FixedBucketBatchSizeConstraint

    common = {"shuffle": cfg.shuffle, "drop_last": cfg.drop_last, "seed": cfg.seed, "world_size": dp_world_size,
              "rank": dp_rank}  # fmt: skip
    if constraint is not None:
        num_buckets = min(cfg.num_buckets, _count_upto(cuts, cfg.num_buckets))
        if cfg.use_bucketing and num_buckets >= 2:
            return DynamicBucketingSampler(
                cuts, constraint=constraint, num_buckets=num_buckets, duration_bins=cfg.bucket_duration_bins,
                buffer_size=cfg.bucket_buffer_size, **common,
            )  # fmt: skip
        return DynamicCutSampler(cuts, constraint=constraint, shuffle_buffer_size=cfg.shuffle_buffer_size, **common)
    if cfg.bucket_batch_size is not None:
        if cfg.batch_size is not None or cfg.batch_duration is not None:
            raise ValueError(
                "bucket_batch_size sets every bucket's batch size: set batch_size and batch_duration to null (they "
                "would not be used)."
            )
        if not cfg.use_bucketing or not cfg.bucket_duration_bins:
            raise ValueError("bucket_batch_size needs use_bucketing=true and bucket_duration_bins.")
        if len(cfg.bucket_batch_size) != len(cfg.bucket_duration_bins) + 1:
            raise ValueError(
                f"bucket_batch_size has {len(cfg.bucket_batch_size)} entries; it needs one per bucket: "
                f"len(bucket_duration_bins) + 1 = {len(cfg.bucket_duration_bins) + 1}."
            )
        constraint = FixedBucketBatchSizeConstraint(
            max_seq_len_buckets=[*cfg.bucket_duration_bins, float("inf")], batch_sizes=list(cfg.bucket_batch_size)
        )
        return DynamicBucketingSampler(
            cuts, constraint=constraint, duration_bins=list(cfg.bucket_duration_bins),
            buffer_size=cfg.bucket_buffer_size, **common,
        )  # fmt: skip
    if cfg.batch_size is None and cfg.batch_duration is None:
        raise ValueError("Set batch_size or batch_duration (or bucket_batch_size with bucket_duration_bins).")
    if cfg.batch_size is not None and cfg.batch_duration is not None:
        logger.info("a batch closes at %d utterances or %g s of audio, whichever comes first", cfg.batch_size,
                    cfg.batch_duration)  # fmt: skip
    limits = {
        "max_cuts": cfg.batch_size,
        "max_duration": cfg.batch_duration,
        "quadratic_duration": cfg.quadratic_duration,
    }
    num_buckets = cfg.num_buckets
    available = _count_upto(cuts, num_buckets) if cfg.use_bucketing and cfg.bucket_duration_bins is None else 0
    if cfg.use_bucketing and cfg.bucket_duration_bins is None and available < num_buckets:
        # A small set (a dev set, a smoke test) cannot fill the default number of buckets: use fewer.
        num_buckets = available
        logger.info("only %d utterances: bucketing with %d buckets instead of %d", available, num_buckets,
                    cfg.num_buckets)  # fmt: skip
    if cfg.bucket_bins_method not in ("min_padding", "equal_duration"):
        raise ValueError(f"bucket_bins_method must be min_padding or equal_duration, got {cfg.bucket_bins_method!r}.")
    bins = cfg.bucket_duration_bins
    if (cfg.use_bucketing and num_buckets >= 2 and bins is None and cfg.bucket_bins_method == "min_padding"
            and not cuts.is_lazy and cfg.quadratic_duration is None):  # fmt: skip
        bins = min_padding_bins([c.duration for c in cuts], num_buckets, cfg.batch_duration, cfg.batch_size)
        num_buckets = len(bins) + 1
    if cfg.use_bucketing and num_buckets >= 2:
        # The bucketing sampler shuffles within its buffer (bucket_buffer_size); shuffle_buffer_size is for the
        # non-bucketing sampler.
        return DynamicBucketingSampler(
            cuts, num_buckets=num_buckets, duration_bins=bins,
            buffer_size=cfg.bucket_buffer_size, **limits, **common,
        )  # fmt: skip
    return DynamicCutSampler(cuts, shuffle_buffer_size=cfg.shuffle_buffer_size, **limits, **common)


def _count_upto(cuts: Any, limit: int) -> int:
    """How many cuts there are, counting no further than ``limit`` (cheap on a lazy set of any size)."""
    return sum(1 for _ in itertools.islice(cuts, limit))


class ResumableSampler:
    """A lhotse sampler that can resume mid-epoch: ``resume(epoch, batches_done)`` makes the next pass over that
    epoch skip the batches already trained on (its order is a function of the seed and the epoch)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.epoch = 0
        self._resume: tuple[int, int] | None = None
        self._counts: dict[int, int] = {}
        predicate = getattr(getattr(getattr(sampler, "cuts", [None])[0], "data", None), "predicate", None)
        self._filter = predicate if isinstance(predicate, _CutFilter) else None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def batches_per_epoch(self, limit: int | None = None) -> int:
        """Batches in one pass at the current epoch (counted from metadata once per epoch: a pass over the sampler;
        batch counts vary a little by epoch). With ``limit``, counting stops after ``limit + 1`` batches: a result
        above ``limit`` means "more than ``limit``" (a huge manifest need not be read to the end)."""
        if self.epoch in self._counts:
            return self._counts[self.epoch]
        count = sum(1 for _ in itertools.islice(self.sampler, None if limit is None else limit + 1))
        if limit is None or count <= limit:
            self._counts[self.epoch] = count
        return count

    def resume(self, epoch: int, batches_done: int) -> None:
        """Continue from a checkpoint taken after ``batches_done`` batches of ``epoch``.

        The sampler moves to that epoch (or to the next one, if the epoch was complete) right away: Lightning
        starts the data iterator before it announces the epoch of a resumed run.
        """
        self.set_epoch(epoch)
        if batches_done >= self.batches_per_epoch(limit=batches_done):
            self.set_epoch(epoch + 1)
            self._resume = None
        else:
            self._resume = (epoch, batches_done)

    def __iter__(self) -> Any:
        batches = iter(self.sampler)
        if self._resume is not None and self._resume[0] == self.epoch:
            # Applied once, on the pass over the saved epoch (Lightning may peek at other epochs' data before).
            _, skip = self._resume
            self._resume = None
            for _ in range(skip):
                next(batches, None)
        if self._filter is not None:
            self._filter.reset()
        # Not ``yield from``: a lhotse sampler is its own iterator and would restart its pass on iter().
        while True:
            try:
                yield CutBatch(next(batches), self.epoch)
            except StopIteration:
                if self._filter is not None:
                    logger.info("epoch %d: dataset filters %s", self.epoch, self._filter.report())
                return


class EvaluationSampler:
    """A validation or test set split by utterance: data-parallel rank ``r`` batches the utterances ``r``,
    ``r + W``, ``r + 2W``, ... of the set (in order, with the set's batching), so that every utterance is decoded
    exactly once whatever the data-parallel size ``W``. lhotse's own sharding draws ``W`` batches per step and, at the
    end of a set, hands the last group out again (utterances repeat when fewer remain than ranks). Every rank
    yields as many batches as the rank with the most (each rank batches every share from the metadata to count
    them, no collective), the others padding with empty batches, which the models and the bridge step through with
    the same collectives as a full one."""

    def __init__(self, cuts: Any, cfg: LoaderConfig, dp_rank: int, dp_world_size: int, constraint: Any = None) -> None:
        from lhotse import CutSet

        every = list(cuts)
        shares = [CutSet(every[r::dp_world_size]) for r in range(dp_world_size)]
        samplers = [build_sampler(share, cfg, 0, 1, constraint) for share in shares]
        counts = [sum(1 for _ in sampler) for sampler in samplers]
        self.sampler, self.batches, self.epoch = samplers[dp_rank], max(counts), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Any:
        from lhotse import CutSet

        done = 0
        for batch in iter(self.sampler):
            done += 1
            yield CutBatch(batch, self.epoch)
        for _ in range(self.batches - done):
            yield CutBatch(CutSet([]), self.epoch)


class StreamSampler:
    """The sampler of data without epochs (NeMo tarred): one endless, seeded stream of batches per rank, cut into
    Lightning epochs of ``epoch_batches`` batches (``trainer.limit_train_batches``).

    Epoch ``e`` takes batches ``e * epoch_batches`` to ``(e + 1) * epoch_batches - 1`` of the stream, whatever
    happened before (an epoch left early is skipped to its end), so each epoch sees new data and a resumed run sees
    what the uninterrupted one saw. ``resume`` skips the batches already trained on by drawing them again (their
    audio is read, not decoded).

    Args:
        sampler: a lhotse sampler over this rank's stream (``world_size=1``: the data is split by rank already).
        epoch_batches: batches per Lightning epoch; None: one endless epoch (``trainer.max_steps`` ends the run).
    """

    def __init__(self, sampler: Any, epoch_batches: int | None = None) -> None:
        self.sampler = sampler
        self.epoch_batches = epoch_batches
        self.epoch = 0
        self._stream: Any = None
        self._position = 0  # batches drawn from the stream so far
        self._resume: tuple[int, int] | None = None  # (epoch, batches already trained) of a resumed run

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches_per_epoch(self, limit: int | None = None) -> int:
        if self.epoch_batches is None:
            raise ValueError(
                "NeMo tarred data has no epochs: set trainer.limit_train_batches=<batches per epoch> (an int) and "
                "trainer.max_steps, as with NeMo."
            )
        return self.epoch_batches

    def resume(self, epoch: int, batches_done: int) -> None:
        """Continue from a checkpoint taken after ``batches_done`` batches of ``epoch``: the next pass over that
        epoch skips them (if Lightning moves on to another epoch instead, that epoch starts at its own place)."""
        if self.epoch_batches is not None and batches_done >= self.epoch_batches:
            epoch, batches_done = epoch + 1, 0
        self.set_epoch(epoch)
        self._resume = (epoch, batches_done)

    def __iter__(self) -> Any:
        start = self.epoch * (self.epoch_batches or 0)
        if self._resume is not None:
            epoch, done = self._resume
            self._resume = None
            if epoch == self.epoch:
                start += done
        if self._stream is None or self._position > start:
            self._stream, self._position = iter(self.sampler), 0
        for _ in range(start - self._position):
            next(self._stream)
        self._position = start
        end = None if self.epoch_batches is None else (self.epoch + 1) * self.epoch_batches
        while end is None or self._position < end:
            batch = next(self._stream)
            self._position += 1
            yield CutBatch(batch, self.epoch)


def get_lhotse_dataloader_from_config(
    cfg: LoaderConfig | dict,
    dp_rank: int,
    dp_world_size: int,
    dataset: torch.utils.data.Dataset,
    *,
    cuts: Any = None,
    constraint: Any = None,
    epoch_batches: int | None = None,
    evaluation: bool = False,
) -> DataLoader:
    """The dataloader for one dataset node (see module docstring).

    Args:
        cfg: the dataset config (a :class:`LoaderConfig` or a mapping with its keys).
        dp_rank: this process's data-parallel rank (not its global rank).
        dp_world_size: the number of data-parallel ranks.
        dataset: maps a :class:`CutBatch` to a collated batch (see :mod:`speechtrain.data.cut_datasets`); its
            ``tokenizer`` attribute, if any, counts tokens for the ``min_tps``/``max_tps`` filters.
        cuts: cuts to read instead of those ``cfg`` names (a caller that adds its own sources).
        constraint: a lhotse sampling constraint in other units than seconds (see :func:`build_sampler`).
        epoch_batches: batches per epoch of data without epochs (NeMo tarred; ``trainer.limit_train_batches``).
        evaluation: a validation or test set: split by utterance, each decoded exactly once at any data-parallel
            size (:class:`EvaluationSampler`).
    """
    if not isinstance(cfg, LoaderConfig):
        cfg = loader_config(cfg)
    tokenizer = getattr(dataset, "tokenizer", None)
    if cfg.is_tarred or _names_tarred(cfg.input_cfg):
        stream, readers = read_tarred_cuts(cfg, dp_rank, dp_world_size, tokenizer)
        if cfg.use_bucketing and cfg.bucket_duration_bins is None and cfg.bucket_batch_size is None:
            cfg = dataclasses.replace(cfg, bucket_duration_bins=_metadata_duration_bins(readers, cfg))
        sampler: Any = StreamSampler(build_sampler(stream, cfg, 0, 1, constraint), epoch_batches)
    else:
        if cuts is None:
            cuts = read_cuts(cfg, tokenizer=tokenizer)
        if evaluation and dp_world_size > 1:
            sampler = EvaluationSampler(cuts, cfg, dp_rank, dp_world_size, constraint)
        else:
            sampler = ResumableSampler(build_sampler(cuts, cfg, dp_rank, dp_world_size, constraint))
    # Its own generator: starting an epoch's iterator must not draw from the global RNG, or a run resumed
    # mid-epoch (which starts one more iterator) would see different dropout than the uninterrupted run.
    return DataLoader(
        dataset, sampler=sampler, batch_size=None, num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0, generator=torch.Generator().manual_seed(cfg.seed),
        pin_memory=cfg.pin_memory and torch.cuda.is_available(),  # page-locked batches: faster, async copies to GPU
    )  # fmt: skip
