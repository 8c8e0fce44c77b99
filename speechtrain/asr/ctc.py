"""CTC speech recognisers: features -> encoder -> linear -> CTC, with the blank last (NeMo's convention).

:class:`CTCModel` holds everything but the encoder: tokenizer (characters or a sentencepiece BPE model, stored in
the archive), log-mel front end (fp32), SpecAugment, CTC loss (``mean_volume`` or ``mean_batch``), greedy decoding,
corpus-level WER/CER summed over data-parallel ranks for each validation set, the lhotse loaders, transcription,
and the Megatron bridge's step contract. Subclasses build the encoder in :meth:`build_encoder`.
:class:`ConformerCTCModel` is the Conformer / FastConformer recogniser.
"""

import dataclasses
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from speechtrain.asr.conformer import (
    ConformerConfig,
    ConformerEncoder,
    conformer_forward_flops,
    subsampled_lengths,
)
from speechtrain.asr.decoding import STRATEGIES, BeamSearchDecoder, DecodingConfig, greedy_decode
from speechtrain.asr.features import PreprocessorConfig, build_preprocessor
from speechtrain.asr.spec_augment import SpecAugment, SpecAugmentConfig
from speechtrain.common.batch import NoUsableDataError, is_empty_batch, no_usable_data_message
from speechtrain.common.config import ConfigError
from speechtrain.common.metrics import TextNormalizer, WerConfig, edit_distance, error_rate
from speechtrain.common.tokenizers import CharTokenizer, load_tokenizer
from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.corpora import builtin
from speechtrain.data.audio_text import PARTLY_READ_REASONS, SkipTally
from speechtrain.data.cut_datasets import AsrCutDataset
from speechtrain.data.lhotse_loader import LoaderConfig, get_lhotse_dataloader_from_config, loader_config
from speechtrain.data.usable import check_audio_exists
from speechtrain.lightning import parallel_state
from speechtrain.nn.init import seeded

logger = logging.getLogger(__name__)
# Per validation set: loss sum, target tokens, word errors, words, char errors, chars, greedy word errors, greedy
# char errors, utterances scored, utterances skipped.
VAL_SUMS = 10


@dataclass
class TokenizerConfig:
    """Output vocabulary: a list of characters (``vocab``), or a tokenizer file (``path``: a sentencepiece
    ``.model`` or a character tokenizer ``.json``), which is packed into the model archive. With neither, the
    training scripts train a ``type`` (bpe or unigram) sentencepiece model of ``vocab_size`` pieces on the
    training transcripts first (:func:`speechtrain.asr.jobs.ensure_tokenizer`; cached)."""

    vocab: list[str] | None = None
    path: str | None = None
    type: str = "bpe"
    vocab_size: int = 128


def resolve_manifest(name: Any) -> str:
    """A manifest path, with ``builtin:<corpus>/<split>`` names resolved (built on first use)."""
    return str(builtin.resolve_manifest(name))


def validation_set_name(manifest: str) -> str:
    """A short name for a validation manifest: ``builtin:espeak/dev`` -> ``dev``; ``.../dev/manifest.json`` -> ``dev``;
    ``.../other.json`` -> ``other``."""
    if manifest.startswith("builtin:"):
        return manifest.rsplit("/", 1)[-1]
    path = Path(manifest)
    return path.parent.name if path.stem == "manifest" and path.parent.name else path.stem


class CTCModel(SpeechModel):
    """Base of the CTC recognisers (see module docstring). The config needs ``sample_rate``, ``tokenizer``,
    ``preprocessor``, ``spec_augment`` (or None), ``encoder``, ``ctc_reduction``, ``train_ds``, ``validation_ds``
    and ``optim``.

    ``validation_ds.manifest_filepath`` may list several manifests: each is its own validation set, logged as
    ``val_wer_<name>`` / ``val_cer_<name>``; ``val_wer`` and ``val_loss`` are those of the first set.
    """

    NO_TRAINING_DATA = (
        "model.train_ds names no data (manifest_filepath, cuts_path, shar_path, input_cfg, or a tarred dataset): "
        "there is nothing to train on."
    )

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        if cfg.tokenizer.path:
            self.tokenizer = load_tokenizer(self.register_artifact("tokenizer.path", cfg.tokenizer.path))
        elif cfg.tokenizer.vocab:
            self.tokenizer = CharTokenizer(list(cfg.tokenizer.vocab))
        else:
            raise ValueError("model.tokenizer needs either vocab (a list of characters) or path (a tokenizer file).")
        if cfg.ctc_reduction not in ("mean_volume", "mean_batch"):
            raise ValueError(f"model.ctc_reduction must be mean_volume or mean_batch, got {cfg.ctc_reduction!r}.")
        self.blank = self.tokenizer.vocab_size
        if cfg.decoding.strategy not in STRATEGIES:
            raise ValueError(f"model.decoding.strategy must be one of {', '.join(STRATEGIES)}, got "
                             f"{cfg.decoding.strategy!r}.")  # fmt: skip
        if cfg.decoding.lm_path:
            self.register_artifact("decoding.lm_path", cfg.decoding.lm_path)
        self._beam: BeamSearchDecoder | None = None
        # WER/CER normalisation (model.wer): recorded in the config, logged at the first validation.
        self.text_normalizer = TextNormalizer(OmegaConf.to_container(cfg.wer) if cfg.get("wer") else None)
        self._normalization_logged = False
        self._val_strategy = "greedy"
        self.closing_greedy: dict[int, dict[str, str]] | None = None
        # The base of every weight's initialisation stream: drawn once from the seeded global stream, so it is
        # the same on every rank and the same for every parallel layout.
        self._init_seed = int(torch.randint(0, 2**30, ()).item())
        self._forwards = 0  # training forwards outside a trainer (the step number, for the attention context draw)
        self.encoder: torch.nn.Module | None = None
        self._pending_init: tuple[Any, list[str] | None, list[str] | None] | None = None
        self._skips = SkipTally()
        self._val_sums: dict[int, torch.Tensor] = {}
        self._train_loader: DataLoader | None = None
        self._val_loaders: list[DataLoader] = []
        self._val_names: list[str] = []

    # ---------------------------------------------------------------------------------------------- layers
    def build_encoder(self) -> tuple[torch.nn.Module, int]:
        """The encoder (features (B, n_mels, F), lengths -> (B, F', D), lengths) and its output width D."""
        raise NotImplementedError

    def configure_model(self) -> None:
        """Builds the layers once the parallel layout is known (tensor-parallel layers are sharded), then loads
        pretrained weights if asked (:meth:`init_from_pretrained_when_built`). Idempotent."""
        if self.encoder is not None:
            return
        self.build_layers()
        if self._pending_init is not None:
            source, include, exclude = self._pending_init
            self._pending_init = None
            self.init_from_pretrained(source, include=include, exclude=exclude)

    def build_layers(self) -> None:
        """Every layer of the model; subclasses add theirs after ``super().build_layers()``, so that pretrained
        weights are loaded into all of them (a transducer's prediction and joint networks included)."""
        cfg = self.cfg
        self.preprocessor = build_preprocessor(OmegaConf.to_object(cfg.preprocessor), cfg.sample_rate)
        self.spec_augment = SpecAugment(OmegaConf.to_object(cfg.spec_augment)) if cfg.spec_augment else None
        self.encoder, width = self.build_encoder()
        with seeded(self._init_seed + 100_000):
            self.decoder = torch.nn.Linear(width, self.tokenizer.vocab_size + 1)

    def init_from_pretrained_when_built(
        self, source: Any, include: list[str] | None = None, exclude: list[str] | None = None
    ) -> None:
        """:meth:`init_from_pretrained` once the layers are built: in a training run that is when the parallel
        layout is known, so that under tensor parallelism each rank takes its slices of the full weights."""
        if self.encoder is not None:
            self.init_from_pretrained(source, include=include, exclude=exclude)
        else:
            self._pending_init = (source, include, exclude)

    def _built(self) -> None:
        if self.encoder is None:
            self.configure_model()

    def features(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio (B, T), audio_lens (B,) -> the encoder's input (B, n_mels, F) in fp32 (SpecAugment applied in
        training), frame lengths (B,)."""
        self._built()
        feats, lengths = self.preprocessor(audio, audio_lens)
        if self.spec_augment is not None:
            feats = self.spec_augment(feats, lengths)
        return feats, lengths

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """Encoder frames (B, F', D) -> CTC log-probabilities (B, F', V+1) in fp32 (blank last)."""
        return F.log_softmax(self.decoder(x).float(), dim=-1)

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """audio (B, T), audio_lens (B,) -> log_probs (B, F', V+1) in fp32 (blank last), lengths (B,)."""
        feats, lengths = self.features(audio, audio_lens)  # (builds the layers on first use)
        x, lengths = self.encoder(feats, lengths)
        return self.log_probs(x), lengths

    def ctc_losses(self, log_probs: torch.Tensor, lengths: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """Per-utterance CTC losses (B,), fp32 (an utterance too short for its transcript gives 0, not inf)."""
        input_lengths, target_lengths = self.host_lengths(batch, lengths)
        return F.ctc_loss(
            log_probs.transpose(0, 1).float(),  # (B, F', V+1) -> (F', B, V+1)
            batch["tokens"],
            input_lengths,
            target_lengths,
            blank=self.blank,
            reduction="none",
            zero_infinity=True,
        )

    def every_parameter_gets_a_gradient(self) -> bool:
        """Every utterance reaches every layer and the CTC head (and the intermediate taps when set)."""
        return True

    def host_lengths(self, batch: dict[str, Any], lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The output frames and target tokens of the batch's utterances as CPU int64 tensors, from the lengths the
        collator also gives as Python ints: CUDA's CTC loss reads its lengths on the host, and device tensors would
        cost a synchronisation per call (three per step with two intermediate-CTC taps). Without them (a batch made
        by hand), ``lengths`` and ``token_lens`` as they are."""
        samples, tokens = batch.get("audio_samples"), batch.get("token_counts")
        if samples is None or tokens is None or not hasattr(self.encoder, "output_lengths"):
            return lengths, batch["token_lens"]
        frames = self.encoder.output_lengths(self.preprocessor.frame_lengths(np.asarray(samples, dtype=np.int64)))
        return torch.from_numpy(frames), torch.tensor(tokens, device="cpu")

    def greedy_decode(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best path: argmax per frame, merge repeats, drop blanks."""
        return [self.tokenizer.decode(ids) for ids in greedy_decode(log_probs, lengths, self.blank)]

    def decode(self, log_probs: torch.Tensor, lengths: torch.Tensor, strategy: str | None = None) -> list[str]:
        """Text of each utterance, decoded with ``strategy`` (default: ``cfg.decoding.strategy``)."""
        strategy = strategy or self.cfg.decoding.strategy
        if strategy == "greedy":
            return self.greedy_decode(log_probs, lengths)
        if self._beam is None:
            keys = {f.name for f in fields(DecodingConfig)}  # a subclass's config may hold more
            decoding = DecodingConfig(
                **{k: v for k, v in OmegaConf.to_container(self.cfg.decoding).items() if k in keys}
            )
            self._beam = BeamSearchDecoder(self.tokenizer, decoding)
            skipped = self._beam.skipped_words
            if skipped:
                logger.warning("Beam search: %d LM words cannot be spelled by the tokenizer and are left out of the "
                               "lexicon, e.g. %s.", len(skipped), skipped[:5])  # fmt: skip
        return self._beam(log_probs, lengths)

    # ------------------------------------------------------------------ the Megatron bridge's step contract
    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        if any(t is not None for t in tensors):
            raise ValueError(f"{type(self).__name__} has a single pipeline stage: use pipeline_model_parallel_size=1.")

    def forward_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_probs (B, F', V+1), output lengths (B,)) of a batch."""
        return self(batch["audio"], batch["audio_lens"])

    def loss_step(
        self, batch: dict[str, Any], output: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, count): the ratio is the loss. ``mean_volume`` counts target tokens (NeMo's default for
        Conformer-CTC), ``mean_batch`` counts utterances."""
        return self.reduced(self.ctc_losses(*output, batch), batch)

    def reduced(self, losses: torch.Tensor, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-utterance losses (B,) -> (loss sum, count) under ``ctc_reduction``."""
        if self.cfg.ctc_reduction == "mean_batch":
            return losses.sum(), torch.tensor(losses.shape[0], device=losses.device)
        return losses.sum(), batch["token_lens"].sum()

    def utterance_losses(self, output: torch.Tensor, lengths: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """(B,) losses of the model's output (:meth:`forward`), as validation reports them; CTC's here."""
        return self.ctc_losses(output, lengths, batch)

    # ---------------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        self._val_sums = {}
        self._val_skips = {}
        # Validation inside fit decodes greedily (fast, comparable across runs); trainer.validate uses
        # cfg.decoding and, for beam search, also reports the greedy WER.
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == "fit"
        self._val_strategy = "greedy" if fitting else self.cfg.decoding.strategy
        # A closing validation keeps its greedy transcripts ({validation set index: {cut id: text}}, this rank's
        # share): the report's per-engine breakdown reads them instead of decoding every set again.
        self.closing_greedy = None if fitting else {}
        if not self._normalization_logged:
            logger.info(
                "WER/CER are counted on transcripts normalised as: %s (model.wer)", self.text_normalizer.describe()
            )
            self._normalization_logged = True

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._val_skips.setdefault(dataloader_idx, SkipTally()).add_batch(batch)
        skipped = sum(n for reason, n in (batch or {}).get("skipped", {}).items() if reason not in PARTLY_READ_REASONS)
        if is_empty_batch(batch):
            self._add_val_sums(dataloader_idx, torch.zeros(VAL_SUMS, dtype=torch.float64, device=self.device), skipped)
            return
        log_probs, lengths = self(batch["audio"], batch["audio_lens"])
        norm = self.text_normalizer
        raw = self.greedy_decode(log_probs, lengths)
        if self.closing_greedy is not None and batch.get("ids") is not None:
            self.closing_greedy.setdefault(dataloader_idx, {}).update(zip(batch["ids"], raw, strict=True))
        greedy = [norm(t) for t in raw]
        hyps = greedy
        if self._val_strategy != "greedy":
            hyps = [norm(t) for t in self.decode(log_probs, lengths, self._val_strategy)]
        refs = [norm(self.tokenizer.decode(t[:n].tolist())) for t, n in zip(batch["tokens"], batch["token_lens"])]

        def errors(texts: list[str]) -> tuple[int, int]:
            return (sum(edit_distance(h.split(), r.split()) for h, r in zip(texts, refs)),
                    sum(edit_distance(h, r) for h, r in zip(texts, refs)))  # fmt: skip

        word_err, char_err = errors(hyps)
        greedy_word_err, greedy_char_err = errors(greedy) if hyps is not greedy else (word_err, char_err)
        sums = torch.tensor(
            [self.utterance_losses(log_probs, lengths, batch).sum().item(), batch["token_lens"].sum().item(), word_err,
             sum(len(r.split()) for r in refs), char_err, sum(len(r) for r in refs), greedy_word_err,
             greedy_char_err, len(refs), 0.0],
            dtype=torch.float64, device=log_probs.device,
        )  # fmt: skip
        self._add_val_sums(dataloader_idx, sums, skipped)

    def _add_val_sums(self, index: int, sums: torch.Tensor, skipped: int) -> None:
        sums[VAL_SUMS - 1] = skipped
        previous = self._val_sums.get(index)
        self._val_sums[index] = sums if previous is None else previous + sums

    def on_validation_epoch_end(self) -> None:
        names = self._val_names or ["val"]
        for index, name in enumerate(names):
            sums = self._val_sums.get(index, torch.zeros(VAL_SUMS, dtype=torch.float64, device=self.device))
            if self.trainer.world_size > 1:
                sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum").cpu()
            (loss_sum, tokens, word_err, words, char_err, chars, greedy_word_err, greedy_char_err, utterances,
             skipped) = sums.tolist()  # fmt: skip
            if utterances == 0 and not self.trainer.sanity_checking:
                self._stop_on_unusable_validation_set(index)
            # A rate over nothing is NaN (shown as n/a), never 0%; the skipped utterances are reported beside it.
            metrics = {"loss": loss_sum / tokens if tokens else float("nan"), "wer": error_rate(word_err, words),
                       "cer": error_rate(char_err, chars), "skipped": skipped}  # fmt: skip
            if self._val_strategy != "greedy":
                metrics["wer_greedy"] = error_rate(greedy_word_err, words)
                metrics["cer_greedy"] = error_rate(greedy_char_err, chars)
            # Already summed over data-parallel ranks; sync_dist only averages identical values.
            for key, value in metrics.items():
                if index == 0 and key != "skipped":
                    self.log(f"val_{key}", value, prog_bar=key in ("loss", "wer"), sync_dist=True,
                             add_dataloader_idx=False)  # fmt: skip
                if len(names) > 1 or key == "skipped":
                    self.log(f"val_{key}_{name}", value, sync_dist=True, add_dataloader_idx=False)
            if skipped:
                tally = self._val_skips.get(index)
                logger.warning("Validation set %s: %s (not in val_wer_%s; counted in val_skipped_%s)", name,
                               tally.take_summary() if tally else f"skipped {skipped:.0f}", name, name)  # fmt: skip

    def _stop_on_unusable_validation_set(self, index: int) -> None:
        manifests = self.cfg.validation_ds.manifest_filepath
        manifests = [manifests] if isinstance(manifests, str) else list(manifests)
        tally = self._val_skips.get(index) or SkipTally()
        raise NoUsableDataError(no_usable_data_message(
            f"validation set {self._val_names[index] if self._val_names else 'val'}",
            "model.validation_ds.manifest_filepath", str(manifests[index]), dict(tally.counts), dict(tally.examples),
        ))  # fmt: skip

    # ------------------------------------------------------------------------------------------------ data
    def setup_data(self, stage: str) -> None:
        if stage == "fit":
            self._train_loader = self._build_loader(self.cfg.train_ds, train=True)
        if stage in ("fit", "validate"):
            sets = self._validation_sets()
            self._val_loaders = [self._build_loader(cfg) for _, cfg in sets]
            self._val_names = [name for name, _ in sets]

    def _validation_sets(self) -> list[tuple[str, LoaderConfig]]:
        """(name, loader config) of each validation set: one per manifest and per cuts file of ``validation_ds``."""
        cfg = loader_config(OmegaConf.to_object(self.cfg.validation_ds))
        if cfg.is_tarred:
            raise ValueError("model.validation_ds: is_tarred is for training data; validate on a NeMo manifest "
                             "(manifest_filepath) or lhotse cuts (cuts_path) of the validation audio.")  # fmt: skip
        manifests = [cfg.manifest_filepath] if isinstance(cfg.manifest_filepath, str) else cfg.manifest_filepath
        cuts = [cfg.cuts_path] if isinstance(cfg.cuts_path, str) else cfg.cuts_path
        only = {"manifest_filepath": None, "cuts_path": None, "shar_path": None, "input_cfg": None}
        sets = [(validation_set_name(str(m)), dataclasses.replace(cfg, **{**only, "manifest_filepath": m}))
                for m in manifests or []]  # fmt: skip
        sets += [
            (Path(str(c)).name.split(".")[0], dataclasses.replace(cfg, **{**only, "cuts_path": c})) for c in cuts or []
        ]
        if cfg.shar_path or cfg.input_cfg:
            sets.append(("val", dataclasses.replace(cfg, manifest_filepath=None, cuts_path=None)))
        return sets

    def _build_loader(self, ds_cfg: Any, train: bool = False) -> DataLoader | None:
        cfg = ds_cfg if isinstance(ds_cfg, LoaderConfig) else loader_config(OmegaConf.to_object(ds_cfg))
        if not any((cfg.manifest_filepath, cfg.cuts_path, cfg.shar_path, cfg.input_cfg)):
            return None
        manifests = cfg.manifest_filepath
        if not cfg.is_tarred:  # builtin: names; a tarred dataset's manifests are brace patterns
            manifests = resolve_manifest(manifests) if isinstance(manifests, str) else [
                resolve_manifest(m) for m in manifests or []] or None  # fmt: skip
        if not cfg.is_tarred:
            key = "train_ds" if train else "validation_ds"
            given = cfg.manifest_filepath if isinstance(cfg.manifest_filepath, list) else [cfg.manifest_filepath]
            resolved = manifests if isinstance(manifests, list) else [manifests]
            for name, path in zip(given, resolved):
                if path is None:
                    continue
                if not Path(path).is_file():
                    raise FileNotFoundError(
                        f"model.{key}.manifest_filepath={name}: no such file ({Path(path).resolve()})."
                    )
                check_audio_exists(f"model.{key}.manifest_filepath", path, shown=str(name))
        cfg = dataclasses.replace(cfg, manifest_filepath=manifests, sample_rate=self.cfg.sample_rate)
        epoch_batches = None
        if train and cfg.is_tarred and self._trainer is not None:
            limit = self.trainer.limit_train_batches
            epoch_batches = limit if isinstance(limit, int) else None
        return get_lhotse_dataloader_from_config(
            cfg,
            parallel_state.data_parallel_rank(),
            parallel_state.data_parallel_world_size(),
            AsrCutDataset.from_config(self.tokenizer, cfg),
            epoch_batches=epoch_batches,
            evaluation=not train,
        )

    # ------------------------------------------------------------------------------------------- inference
    @torch.inference_mode()
    def transcribe(
        self, audio: list[str | Path | np.ndarray], batch_size: int = 16, strategy: str | None = None
    ) -> list[str]:
        """Transcribe audio files (read with soundfile; resampled to the model's rate) or 1-D float arrays, with
        ``strategy`` (default: the model's ``decoding.strategy``)."""
        self._built()
        was_training = self.training
        self.eval()
        texts: list[str] = []
        try:
            for padded, lens in self._audio_batches(audio, batch_size):
                texts += self.decode(*self(padded, lens), strategy)
        finally:
            self.train(was_training)
        return texts

    def _audio_batches(self, audio: list[Any], batch_size: int) -> Any:
        """``audio`` (paths or 1-D arrays) in padded batches on the model's device: (B, T) samples, (B,) lengths."""
        for start in range(0, len(audio), batch_size):
            waves = [self._load_audio(a) for a in audio[start : start + batch_size]]
            lens = torch.tensor([len(w) for w in waves], device=self.device)
            padded = torch.zeros(len(waves), int(lens.max()), device=self.device)
            for i, w in enumerate(waves):
                padded[i, : len(w)] = torch.as_tensor(w, device=self.device)
            yield padded, lens

    def _load_audio(self, item: str | Path | np.ndarray) -> torch.Tensor:
        if isinstance(item, np.ndarray):
            return torch.from_numpy(item.astype(np.float32))
        data, rate = sf.read(str(item), dtype="float32", always_2d=True)
        audio = torch.from_numpy(data.mean(axis=1))
        if rate != self.cfg.sample_rate:
            from speechtrain.data.augment import resample

            audio = resample(audio, rate, self.cfg.sample_rate)
        return audio

    # --------------------------------------------------------------------------------------- memory planning
    def output_frames(self, samples: int) -> int:
        """Encoder frames for an utterance of ``samples`` samples."""
        self._built()
        lengths = self.preprocessor.frame_lengths(torch.tensor([samples]))
        with torch.no_grad():
            feats = torch.zeros(1, self.cfg.preprocessor.n_mels, int(lengths))
            return int(self.encoder(feats, lengths)[1])

    def example_batch(self, batch_size: int, duration: float, tokens_per_second: float = 20.0) -> dict[str, Any]:
        """A synthetic worst-case training batch for :mod:`speechtrain.datatools.oomptimizer`: every utterance lasts
        ``duration`` seconds with a transcript of ``tokens_per_second`` tokens per second (at most one per output
        frame, what CTC can align)."""
        samples = max(1, round(duration * self.cfg.sample_rate))
        num_tokens = max(1, min(self.output_frames(samples), round(duration * tokens_per_second)))
        audio = 0.1 * torch.randn(batch_size, samples, generator=torch.Generator().manual_seed(0))
        tokens = (torch.arange(num_tokens) % self.tokenizer.vocab_size).expand(batch_size, num_tokens)
        return {
            "ids": [f"example-{i}" for i in range(batch_size)],
            "audio": audio.to(self.device),
            "audio_lens": torch.full((batch_size,), samples, device=self.device),
            "tokens": tokens.contiguous().to(self.device),
            "token_lens": torch.full((batch_size,), num_tokens, device=self.device),
        }


# Named sizes: the encoder's shape, and what depends on its depth (the temporal U-Net's span of half-rate layers),
# so that ``model.size=NAME`` alone gives a working encoder in every recipe. ``debug`` for tests; ``demo``, the CPU
# demo's 4x Conformer; FastConformer's published small/medium/large/xlarge (8x dw_striding, the encoder defaults).
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "debug": {"d_model": 32, "num_layers": 2, "num_heads": 2, "conv_kernel_size": 5, "subsampling": "striding",
              "subsampling_factor": 4, "subsampling_conv_channels": 32},
    "demo": {"d_model": 144, "num_layers": 8, "num_heads": 4, "conv_kernel_size": 15, "subsampling": "striding",
             "subsampling_factor": 4, "subsampling_conv_channels": 64, "dropout": 0.0, "dropout_att": 0.0,
             "time_reduce_idx": 2, "time_recovery_idx": 7},
    "small": {"d_model": 176, "num_layers": 16, "num_heads": 4},
    "medium": {"d_model": 256, "num_layers": 16, "num_heads": 4},
    "large": {"d_model": 512, "num_layers": 17, "num_heads": 8},
    "xlarge": {"d_model": 1024, "num_layers": 24, "num_heads": 8},
}  # fmt: skip
# The intermediate-CTC taps of a size (layer indices depend on the depth): those of ``model.interctc`` that the
# config does not give. Sizes not listed have none (NeMo's default).
SIZE_INTERCTC: dict[str, dict[str, Any]] = {
    "demo": {"loss_weights": [0.2, 0.2], "apply_at_layers": [2, 5], "self_conditioning": True},
}


# Command-line overrides that turn intermediate CTC off (e.g. for an encoder too shallow for the demo's taps).
INTERCTC_OFF = ("model.interctc.apply_at_layers=[]", "model.interctc.loss_weights=[]",
                "model.interctc.self_conditioning=false")  # fmt: skip
# ... and the temporal U-Net off (for an encoder too shallow for the demo's span of half-rate layers).
UNET_OFF = ("model.encoder.time_reduce_idx=-1", "model.encoder.time_recovery_idx=-1")


@dataclass
class InterCTCConfig:
    """Intermediate CTC losses (NeMo's ``model.interctc``): the CTC head also reads the output of the encoder layers
    ``apply_at_layers`` (0-based) in training, and the loss is ``(1 - sum(loss_weights)) * final +
    sum(w_i * intermediate_i)`` (for a hybrid transducer, ``final`` is its transducer-CTC mix). It regularises the
    lower layers and shortens the CTC plateau; decoding and validation use the final layer only. Empty lists: off.

    ``self_conditioning`` (not in NeMo; such a model does not export to ``.nemo``): each captured layer's output
    distribution, projected back to the model width, is added to the layer's output before the next layer reads it
    (self-conditioned CTC), in training and in inference alike."""

    loss_weights: list[float] = field(default_factory=list)
    apply_at_layers: list[int] = field(default_factory=list)
    self_conditioning: bool = False


@dataclass
class ConformerCTCConfig:
    """Config of :class:`ConformerCTCModel` (``size`` fills in the encoder shape and its intermediate-CTC taps,
    :data:`MODEL_SIZES`; every encoder or ``interctc`` key given in the YAML or on the command line wins over the
    size, whatever its value)."""

    sample_rate: int = 16000
    size: str | None = None
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    spec_augment: SpecAugmentConfig | None = field(default_factory=SpecAugmentConfig)
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    ctc_reduction: str = "mean_volume"
    interctc: InterCTCConfig = field(default_factory=InterCTCConfig)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    wer: WerConfig = field(default_factory=WerConfig)
    train_ds: LoaderConfig = field(default_factory=lambda: LoaderConfig(batch_duration=120.0))
    validation_ds: LoaderConfig = field(
        default_factory=lambda: LoaderConfig(batch_duration=300.0, use_bucketing=False, shuffle=False)
    )
    optim: OptimConfig = field(default_factory=OptimConfig)

    @staticmethod
    def expand_given(config: dict[str, Any]) -> dict[str, Any]:
        """Called by :func:`~speechtrain.common.config.validate_config` on the keys given, before defaults are
        filled in: ``size``'s encoder shape and intermediate-CTC taps under the keys that were given."""
        size = config.get("size")
        if not size:
            return config
        if size not in MODEL_SIZES:
            raise ConfigError(f"Unknown model.size={size!r}; choose one of {', '.join(MODEL_SIZES)}.")
        expanded = {**config, "encoder": {**MODEL_SIZES[size], **dict(config.get("encoder") or {})}}
        if size in SIZE_INTERCTC:
            expanded["interctc"] = {**SIZE_INTERCTC[size], **dict(config.get("interctc") or {})}
        return expanded


class ConformerCTCModel(CTCModel):
    """Conformer (``striding``, 4x) or FastConformer (``dw_striding``, 8x) encoder with a CTC head."""

    Config = ConformerCTCConfig
    # Muon's input (the subsampling), output (the CTC head) and the self-conditioning's vocabulary projection stay
    # with AdamW.
    MUON_ADAMW_MODULES = ("encoder.subsampling", "decoder", "conditioning")

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        weights, layers = list(self.cfg.interctc.loss_weights), list(self.cfg.interctc.apply_at_layers)
        depth = self.cfg.encoder.num_layers
        if len(weights) != len(layers):
            raise ConfigError(f"model.interctc: loss_weights {weights} and apply_at_layers {layers} must have the "
                              "same length (one weight per layer).")  # fmt: skip
        if any(w <= 0 for w in weights) or sum(weights) >= 1:
            raise ConfigError(f"model.interctc.loss_weights={weights}: each must be > 0 and their sum < 1 (the final "
                              "layer's CTC loss gets 1 - sum).")  # fmt: skip
        if any(not 0 <= layer < depth for layer in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"model.interctc.apply_at_layers={layers}: distinct 0-based layer indices below "
                              f"model.encoder.num_layers={depth}. Choose layers of this encoder, or turn "
                              f"intermediate CTC off: {' '.join(INTERCTC_OFF)}.")  # fmt: skip
        if self.cfg.interctc.self_conditioning and not layers:
            raise ConfigError("model.interctc.self_conditioning=true needs layers to condition on: set "
                              "model.interctc.apply_at_layers and loss_weights.")  # fmt: skip
        try:
            OmegaConf.to_object(self.cfg.encoder).reduced_layers()
        except ValueError as error:
            raise ConfigError(f"model.{error} Turn it off with {' '.join(UNET_OFF)}.") from None
        try:
            encoder = OmegaConf.to_object(self.cfg.encoder)
            encoder.context_sizes()
            encoder.conv_padding()
        except ValueError as error:
            raise ConfigError(f"model.{error}") from None

    def build_layers(self) -> None:
        super().build_layers()
        if self.cfg.interctc.self_conditioning:
            with seeded(self._init_seed + 300_000):  # the CTC distribution (V+1) back to the model width
                self.conditioning = torch.nn.Linear(self.decoder.out_features, self.decoder.in_features)

    def _encode(self, audio: torch.Tensor, audio_lens: torch.Tensor, capture: tuple[int, ...]) -> tuple:
        """Features -> encoder output, lengths and the captured layers' outputs (self-conditioned if asked)."""
        feats, lengths = self.features(audio, audio_lens)
        condition = self._condition if self.cfg.interctc.self_conditioning else None
        if self.training:  # the limited attention context of this step is drawn from its number (a host integer)
            trainer = self._trainer
            self.encoder.training_step_index = trainer.global_step if trainer is not None else self._forwards
            self._forwards += 1
        return self.encoder.forward_with_layers(feats, lengths, capture, condition)

    def _condition(self, hidden: torch.Tensor) -> torch.Tensor:
        """Self-conditioning: a captured layer's CTC distribution, projected back to the model width."""
        return self.conditioning(F.softmax(self.decoder(hidden).float(), dim=-1).to(hidden.dtype))

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output of the last encoder layer's frames: CTC log-probabilities here (a transducer keeps the
        frames for its joint)."""
        return self.log_probs(x)

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`CTCModel.forward` (:meth:`_head` of the encoder output); a self-conditioned model runs its tapped
        layers' conditioning too."""
        interctc = self.cfg.interctc
        capture = tuple(interctc.apply_at_layers) if interctc.self_conditioning else ()
        x, lengths, _ = self._encode(audio, audio_lens, capture)
        return self._head(x), lengths

    def forward_step(self, batch: dict[str, Any]) -> tuple:
        """(:meth:`_head` output, lengths) of a batch; in training with ``interctc``, also the CTC log-probabilities
        of the captured layers (the same CTC head; lengths are shared)."""
        layers = tuple(self.cfg.interctc.apply_at_layers)
        if not (layers and self.training):
            return super().forward_step(batch)
        x, lengths, captured = self._encode(batch["audio"], batch["audio_lens"], layers)
        return self._head(x), lengths, [self.log_probs(c) for c in captured]

    def loss_step(self, batch: dict[str, Any], output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """CTC's (loss sum, count); with intermediate outputs, the interctc-weighted sum of the per-utterance CTC
        losses (NeMo's weighting), reduced the same way."""
        if len(output) == 2:
            return super().loss_step(batch, output)
        log_probs, lengths, captured = output
        weights = self.cfg.interctc.loss_weights
        losses = (1.0 - sum(weights)) * self.ctc_losses(log_probs, lengths, batch)
        for weight, layer_log_probs in zip(weights, captured, strict=True):
            losses = losses + weight * self.ctc_losses(layer_log_probs, lengths, batch)
        return self.reduced(losses, batch)

    def save_to(self, path: str | Path) -> Path:
        """Write the model archive (``.stm``), or, for a ``.nemo`` path, NeMo's ``EncDecCTCModelBPE`` checkpoint
        (:func:`speechtrain.asr.export_nemo.write_nemo`). Every rank must call this in a distributed run."""
        if Path(path).suffix == ".nemo":
            from speechtrain.asr.export_nemo import write_nemo

            return write_nemo(self, path)
        return super().save_to(path)

    def build_encoder(self) -> tuple[torch.nn.Module, int]:
        enc = OmegaConf.to_object(self.cfg.encoder)
        return ConformerEncoder(enc, self.cfg.preprocessor.n_mels, self._init_seed), enc.d_model

    def flops_per_batch(self, batch: dict[str, Any]) -> torch.Tensor:
        """Training FLOPs of one step on ``batch`` (forward x 3: the backward pass costs twice the forward), for
        the telemetry's model TFLOP/s and MFU."""
        self._built()
        frames = self.preprocessor.frame_lengths(batch["audio_lens"])
        enc = OmegaConf.to_object(self.cfg.encoder)
        forward = conformer_forward_flops(enc, self.cfg.preprocessor.n_mels, frames)
        out_frames = subsampled_lengths(frames, enc.subsampling_factor)
        return 3 * (forward + 2 * out_frames.sum() * enc.d_model * (self.tokenizer.vocab_size + 1))
