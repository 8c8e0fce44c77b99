"""A small convolutional CTC recogniser: the smallest real speech job (the bridge and loader tests train it).

log-mel (fp32) -> strided Conv1d (subsampling) -> residual depthwise-separable conv blocks -> linear -> CTC.
The CTC blank is the last output index, after the tokenizer's characters (NeMo's convention).
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from speechtrain.asr.ctc import CTCModel, TokenizerConfig
from speechtrain.asr.decoding import DecodingConfig
from speechtrain.asr.features import PreprocessorConfig
from speechtrain.asr.spec_augment import SpecAugmentConfig
from speechtrain.core.optim import OptimConfig
from speechtrain.data.lhotse_loader import LoaderConfig

logger = logging.getLogger(__name__)


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
    spec_augment: SpecAugmentConfig | None = None
    ctc_reduction: str = "mean_volume"
    decoding: DecodingConfig = field(default_factory=DecodingConfig)


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


class ConvEncoder(torch.nn.Module):
    """Strided Conv1d subsampling, then residual depthwise-separable conv blocks and a final LayerNorm."""

    def __init__(self, cfg: ConvEncoderConfig, n_mels: int) -> None:
        super().__init__()
        self.subsample = torch.nn.Conv1d(
            n_mels, cfg.d_model, kernel_size=2 * cfg.subsampling + 1, stride=cfg.subsampling
        )
        self.blocks = torch.nn.ModuleList(
            ConvBlock(cfg.d_model, cfg.kernel_size, cfg.dropout) for _ in range(cfg.num_layers)
        )
        self.final_norm = torch.nn.LayerNorm(cfg.d_model)

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """feats (B, n_mels, F), lengths (B,) -> (B, F', D), lengths (B,)."""
        stride, kernel = self.subsample.stride[0], self.subsample.kernel_size[0]
        x = self.subsample(F.pad(feats, (kernel // 2, kernel // 2))).transpose(1, 2)  # (B, D, F') -> (B, F', D)
        lengths = torch.div(lengths - 1, stride, rounding_mode="floor") + 1
        mask = (torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]).unsqueeze(-1)  # (B, F', 1)
        x = x * mask
        for block in self.blocks:
            x = block(x, mask)
        return self.final_norm(x), lengths


class ConvCTCModel(CTCModel):
    """Convolutional CTC speech recogniser (see module docstring)."""

    Config = ConvCTCConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.configure_model()  # no tensor-parallel layers: built right away

    def build_encoder(self) -> tuple[torch.nn.Module, int]:
        return ConvEncoder(
            OmegaConf.to_object(self.cfg.encoder), self.cfg.preprocessor.n_mels
        ), self.cfg.encoder.d_model
