"""A small convolutional CTC recogniser: the smallest real speech job, trained by ``examples/asr_train.py``.

log-mel (fp32) -> strided Conv1d (subsampling) -> residual depthwise-separable conv blocks -> linear -> CTC.
The CTC blank is the last output index, after the tokenizer's characters (NeMo's convention).
"""

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from speechtrain.asr.features import LogMelFeatures, PreprocessorConfig
from speechtrain.asr.metrics import word_errors
from speechtrain.asr.tokenizers import CharTokenizer
from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.data.audio_text import SkipTally
from speechtrain.data.cut_datasets import AsrCutDataset, is_empty_batch
from speechtrain.data.lhotse_loader import LoaderConfig, get_lhotse_dataloader_from_config, loader_config
from speechtrain.data.synthetic import resolve_manifest
from speechtrain.lightning import parallel_state

logger = logging.getLogger(__name__)


@dataclass
class TokenizerConfig:
    """Characters of the output vocabulary: a list here, or a tokenizer file (packed into archives)."""

    vocab: list[str] | None = None
    path: str | None = None


@dataclass
class ConvEncoderConfig:
    """Encoder sizes.

    Attributes:
        d_model: channel width.
        num_layers: residual conv blocks.
        kernel_size: depthwise kernel (odd).
        subsampling: time stride of the input convolution.
        dropout: dropout inside each block.
    """

    d_model: int = 128
    num_layers: int = 4
    kernel_size: int = 9
    subsampling: int = 2
    dropout: float = 0.1


@dataclass
class ConvCTCConfig:
    """Config of :class:`ConvCTCModel`."""

    sample_rate: int = 16000
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    preprocessor: PreprocessorConfig = field(default_factory=PreprocessorConfig)
    encoder: ConvEncoderConfig = field(default_factory=ConvEncoderConfig)
    train_ds: LoaderConfig = field(default_factory=lambda: LoaderConfig(batch_duration=40.0, num_buckets=10))
    validation_ds: LoaderConfig = field(
        default_factory=lambda: LoaderConfig(batch_size=64, use_bucketing=False, shuffle=False)
    )
    optim: OptimConfig = field(default_factory=OptimConfig)


class ConvBlock(torch.nn.Module):
    """Pre-norm residual block: LayerNorm -> depthwise conv -> pointwise expand -> GELU -> pointwise -> dropout."""

    def __init__(self, d_model: int, kernel_size: int, dropout: float) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d_model)
        self.depthwise = torch.nn.Conv1d(d_model, d_model, kernel_size, padding=kernel_size // 2, groups=d_model)
        self.expand = torch.nn.Linear(d_model, 2 * d_model)
        self.project = torch.nn.Linear(2 * d_model, d_model)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: (B, F, D); mask: (B, F, 1), 1 on valid frames. Padded frames stay zero."""
        y = self.norm(x) * mask
        y = self.depthwise(y.transpose(1, 2)).transpose(1, 2)  # (B, F, D) -> (B, D, F) -> (B, F, D)
        y = self.project(F.gelu(self.expand(y)))
        return (x + self.dropout(y)) * mask


class ConvCTCModel(SpeechModel):
    """Convolutional CTC speech recogniser (see module docstring)."""

    Config = ConvCTCConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        if cfg.tokenizer.path:
            self.tokenizer = CharTokenizer.load(self.register_artifact("tokenizer.path", cfg.tokenizer.path))
        elif cfg.tokenizer.vocab:
            self.tokenizer = CharTokenizer(list(cfg.tokenizer.vocab))
        else:
            raise ValueError("model.tokenizer needs either vocab (a list of characters) or path (a tokenizer file).")
        enc = cfg.encoder
        self.preprocessor = LogMelFeatures(OmegaConf.to_object(cfg.preprocessor), cfg.sample_rate)
        self.subsample = torch.nn.Conv1d(
            cfg.preprocessor.n_mels, enc.d_model, kernel_size=2 * enc.subsampling + 1, stride=enc.subsampling
        )
        self.blocks = torch.nn.ModuleList(
            ConvBlock(enc.d_model, enc.kernel_size, enc.dropout) for _ in range(enc.num_layers)
        )
        self.final_norm = torch.nn.LayerNorm(enc.d_model)
        self.decoder = torch.nn.Linear(enc.d_model, self.tokenizer.vocab_size + 1)
        self.blank = self.tokenizer.vocab_size
        self._val_sums = torch.zeros(4, dtype=torch.float64)  # loss * tokens, tokens, word errors, words
        self._skips = SkipTally()  # bad utterances of the training epoch, as reported by the batches

    def forward(self, audio: torch.Tensor, audio_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-frame log-probabilities.

        Args:
            audio: (B, T) waveforms.
            audio_lens: (B,) valid samples.

        Returns:
            log_probs (B, F', V+1) in fp32, blank last; lengths (B,) of valid output frames.
        """
        feats, lengths = self.preprocessor(audio, audio_lens)  # (B, n_mels, F)
        stride, kernel = self.subsample.stride[0], self.subsample.kernel_size[0]
        x = self.subsample(F.pad(feats, (kernel // 2, kernel // 2))).transpose(1, 2)  # (B, D, F') -> (B, F', D)
        lengths = torch.div(lengths - 1, stride, rounding_mode="floor") + 1
        mask = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1)  # (B, F', 1)
        x = x * mask
        for block in self.blocks:
            x = block(x, mask)
        logits = self.decoder(self.final_norm(x))
        return F.log_softmax(logits.float(), dim=-1), lengths

    def ctc_loss(self, log_probs: torch.Tensor, lengths: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """Summed CTC loss over the batch (divide by the token count for NeMo's ``mean_volume``)."""
        return F.ctc_loss(
            log_probs.transpose(0, 1),  # (B, F', V+1) -> (F', B, V+1)
            batch["tokens"],
            lengths,
            batch["token_lens"],
            blank=self.blank,
            reduction="sum",
            zero_infinity=True,
        )

    def greedy_decode(self, log_probs: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Best path: argmax per frame, merge repeats, drop blanks."""
        best = log_probs.argmax(-1).cpu()  # (B, F')
        texts = []
        for row, length in zip(best, lengths.cpu()):
            ids = torch.unique_consecutive(row[:length]).tolist()
            texts.append(self.tokenizer.decode([i for i in ids if i != self.blank]))
        return texts

    # The Megatron bridge's step contract (speechtrain.lightning.megatron_parallel): one pipeline stage.
    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        if any(t is not None for t in tensors):
            raise ValueError("ConvCTCModel has a single pipeline stage: use pipeline_model_parallel_size=1.")

    def forward_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log_probs (B, F', V+1), output lengths (B,)) of a batch."""
        return self(batch["audio"], batch["audio_lens"])

    def loss_step(
        self, batch: dict[str, Any], output: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed CTC loss and the number of target tokens (NeMo's ``mean_volume``: the ratio is the loss)."""
        log_probs, lengths = output
        return self.ctc_loss(log_probs, lengths, batch), batch["token_lens"].sum()

    def training_step(self, batch: dict[str, Any] | None, batch_idx: int) -> torch.Tensor | None:
        if is_empty_batch(batch):
            return None
        loss_sum, tokens = self.loss_step(batch, self.forward_step(batch))
        loss = loss_sum / tokens.clamp(min=1)
        self.log("train_loss", loss, prog_bar=True, batch_size=len(batch["ids"]))
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_sums.zero_()

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int) -> None:
        if is_empty_batch(batch):
            return
        log_probs, lengths = self(batch["audio"], batch["audio_lens"])
        hyps = self.greedy_decode(log_probs, lengths)
        refs = [self.tokenizer.decode(t[:n].tolist()) for t, n in zip(batch["tokens"], batch["token_lens"])]
        errors, words = word_errors(hyps, refs)
        loss = self.ctc_loss(log_probs, lengths, batch)
        self._val_sums += torch.tensor(
            [loss.item(), batch["token_lens"].sum().item(), errors, words], dtype=torch.float64
        )

    def on_validation_epoch_end(self) -> None:
        sums = self._val_sums.clone()
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum").cpu()
        loss_sum, tokens, errors, words = sums.tolist()
        # Already summed over data-parallel ranks; sync_dist only averages identical values.
        self.log("val_loss", loss_sum / max(tokens, 1.0), prog_bar=True, sync_dist=True)
        self.log("val_wer", errors / max(words, 1.0), prog_bar=True, sync_dist=True)

    # ------------------------------------------------------------------------------------------------ data
    def setup_data(self, stage: str) -> None:
        if stage == "fit":
            self._train_loader = self._build_loader(self.cfg.train_ds)
        if stage in ("fit", "validate"):
            self._val_loader = self._build_loader(self.cfg.validation_ds)

    def _build_loader(self, ds_cfg: Any) -> DataLoader | None:
        if not ds_cfg.manifest_filepath:
            return None
        cfg = loader_config(OmegaConf.to_object(ds_cfg))
        cfg.manifest_filepath = str(resolve_manifest(cfg.manifest_filepath))
        cfg.sample_rate = self.cfg.sample_rate
        return get_lhotse_dataloader_from_config(
            cfg,
            parallel_state.data_parallel_rank(),
            parallel_state.data_parallel_world_size(),
            AsrCutDataset.from_config(self.tokenizer, cfg),
        )

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._skips.add_batch(batch)

    def on_train_epoch_end(self) -> None:
        """Reports the utterances skipped during the epoch (batches carry their counts, so loader workers' skips
        are included)."""
        summary = self._skips.take_summary()
        if summary:
            logger.warning("Epoch %d: %s", self.current_epoch, summary)

    def train_dataloader(self) -> DataLoader:
        if self._train_loader is None:
            raise ValueError("model.train_ds.manifest_filepath is not set: there is nothing to train on.")
        return self._train_loader

    def val_dataloader(self) -> DataLoader | list:
        return self._val_loader if self._val_loader is not None else []

    _train_loader: DataLoader | None = None
    _val_loader: DataLoader | None = None

    # ------------------------------------------------------------------------------------------- inference
    @torch.inference_mode()
    def transcribe(self, audio: list[str | Path | np.ndarray], batch_size: int = 16) -> list[str]:
        """Transcribe audio files (read with soundfile, at the model's sample rate) or 1-D float arrays."""
        was_training = self.training
        self.eval()
        texts: list[str] = []
        try:
            for start in range(0, len(audio), batch_size):
                waves = [self._load_audio(a) for a in audio[start : start + batch_size]]
                lens = torch.tensor([len(w) for w in waves])
                padded = torch.zeros(len(waves), int(lens.max()))
                for i, w in enumerate(waves):
                    padded[i, : len(w)] = w
                log_probs, lengths = self(padded.to(self.device), lens.to(self.device))
                texts += self.greedy_decode(log_probs, lengths)
        finally:
            self.train(was_training)
        return texts

    def _load_audio(self, item: str | Path | np.ndarray) -> torch.Tensor:
        if isinstance(item, np.ndarray):
            return torch.from_numpy(item.astype(np.float32))
        data, rate = sf.read(str(item), dtype="float32", always_2d=True)
        if rate != self.cfg.sample_rate:
            raise ValueError(f"{item}: sample rate {rate} Hz, but the model expects {self.cfg.sample_rate} Hz.")
        return torch.from_numpy(data.mean(axis=1))

    # --------------------------------------------------------------------------------------- memory planning
    def example_batch(self, batch_size: int, duration: float, tokens_per_second: float = 20.0) -> dict[str, Any]:
        """A synthetic worst-case training batch for :mod:`speechtrain.data.oomptimizer`.

        Every utterance lasts ``duration`` seconds and carries a transcript as long as a fast speaker's
        (``tokens_per_second`` characters), bounded by what CTC can align: one token per output frame.

        Returns:
            the batch dict of :func:`~speechtrain.data.audio_text.collate_audio_text`, on the model's device:
            ``audio`` (B, T), ``audio_lens`` (B,), ``tokens`` (B, U), ``token_lens`` (B,), ``ids``.
        """
        samples = max(1, round(duration * self.cfg.sample_rate))
        frames = samples // self.preprocessor.hop + 1
        out_frames = (frames - 1) // self.subsample.stride[0] + 1
        num_tokens = max(1, min(out_frames, round(duration * tokens_per_second)))
        audio = 0.1 * torch.randn(batch_size, samples, generator=torch.Generator().manual_seed(0))
        tokens = (torch.arange(num_tokens) % self.tokenizer.vocab_size).expand(batch_size, num_tokens)
        return {
            "ids": [f"example-{i}" for i in range(batch_size)],
            "audio": audio.to(self.device),
            "audio_lens": torch.full((batch_size,), samples, device=self.device),
            "tokens": tokens.contiguous().to(self.device),
            "token_lens": torch.full((batch_size,), num_tokens, device=self.device),
        }
