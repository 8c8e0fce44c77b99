"""A tiny frame-regression transformer built from :mod:`speechtrain.nn`, runnable under any TP/PP/DP layout.

It maps (B, T, input_dim) frames to (B, T, output_dim) targets with a masked, frame-summed squared error: a
stand-in for a speech model with variable-length utterances whose loss is frame-weighted. Its initial weights
depend only on the seed, never on the parallel layout: each part is drawn from its own seeded stream, so a
pipeline stage that builds only layers 2 and 3 gets the same weights as a single process building all four.
"""

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.lightning import parallel_state
from speechtrain.nn import TransformerBlock
from speechtrain.nn.init import seeded


@dataclass
class ToyConfig:
    """Sizes and data of :class:`ToyTransformerRegressor`."""

    input_dim: int = 6
    output_dim: int = 3
    d_model: int = 16
    num_heads: int = 4
    d_ff: int = 32
    num_layers: int = 4
    dropout: float = 0.0
    relative_positions: bool = False
    input_norm: bool = False  # batch norm on the input frames (tests of normalisation statistics under DP)
    seed: int = 0
    num_samples: int = 64
    max_frames: int = 12
    batch_size: int = 8
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(name="adam", lr=1e-2, weight_decay=0.0))


def toy_dataset(cfg: ToyConfig) -> TensorDataset:
    """Random frames and targets with lengths from 3 to ``max_frames`` (padded frames are zero)."""
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    lengths = torch.randint(3, cfg.max_frames + 1, (cfg.num_samples,), generator=generator)
    frames = torch.randn(cfg.num_samples, cfg.max_frames, cfg.input_dim, generator=generator)
    targets = torch.randn(cfg.num_samples, cfg.max_frames, cfg.output_dim, generator=generator)
    mask = (torch.arange(cfg.max_frames)[None, :] < lengths[:, None]).unsqueeze(-1)
    return TensorDataset(frames * mask, targets * mask, lengths)


class ToyTransformerRegressor(SpeechModel):
    """Frame regression with transformer blocks; pipeline stages own contiguous ranges of blocks."""

    Config = ToyConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self._input_tensor: torch.Tensor | None = None
        self.blocks: torch.nn.ModuleDict | None = None

    def configure_model(self) -> None:
        """Build this pipeline stage's layers (after the parallel state exists). Idempotent."""
        if self.blocks is not None:
            return
        cfg = self.cfg
        stages = parallel_state.pipeline_parallel_world_size()
        if cfg.num_layers % stages:
            raise ValueError(f"num_layers={cfg.num_layers} is not divisible by pipeline_model_parallel_size={stages}.")
        per_stage = cfg.num_layers // stages
        first = parallel_state.pipeline_parallel_rank() * per_stage
        self.pre_process = parallel_state.is_pipeline_first_stage()
        self.post_process = parallel_state.is_pipeline_last_stage()
        if self.pre_process:
            with seeded(cfg.seed * 1000):
                self.input_proj = torch.nn.Linear(cfg.input_dim, cfg.d_model)
            self.input_norm = torch.nn.BatchNorm1d(cfg.input_dim) if cfg.input_norm else None
        blocks = {}
        for index in range(first, first + per_stage):
            with seeded(cfg.seed * 1000 + 1 + index):
                blocks[str(index)] = TransformerBlock(
                    cfg.d_model,
                    cfg.num_heads,
                    cfg.d_ff,
                    dropout=cfg.dropout,
                    relative_positions=cfg.relative_positions,
                )
        self.blocks = torch.nn.ModuleDict(blocks)
        if self.post_process:
            with seeded(cfg.seed * 1000 + 999):
                self.final_norm = torch.nn.LayerNorm(cfg.d_model)
                self.head = torch.nn.Linear(cfg.d_model, cfg.output_dim)

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        """The previous pipeline stage's activation (Megatron's schedules call this)."""
        self._input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward_step(self, batch: list[torch.Tensor]) -> torch.Tensor:
        """This stage's forward: (B, T, input_dim) frames -> (B, T, d_model) or, on the last stage, predictions."""
        frames, _, lengths = batch
        pad_mask = torch.arange(frames.shape[1], device=frames.device)[None, :] >= lengths[:, None]  # (B, T)
        if self.pre_process and self.input_norm is not None:
            frames = self.input_norm(frames.transpose(1, 2)).transpose(1, 2)  # (B, T, C) -> (B, C, T) and back
        x = self.input_proj(frames) if self.pre_process else self._input_tensor
        for block in self.blocks.values():
            x = block(x, pad_mask)
        return self.head(self.final_norm(x)) if self.post_process else x

    def loss_step(self, batch: list[torch.Tensor], output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared error summed over valid frames, and the number of valid frames."""
        _, targets, lengths = batch
        mask = (torch.arange(output.shape[1], device=output.device)[None, :] < lengths[:, None]).unsqueeze(-1)
        return (((output.float() - targets) ** 2) * mask).sum(), lengths.sum()

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Single-process meaning of a step (MegatronStrategy runs forward_step/loss_step itself)."""
        loss_sum, frames = self.loss_step(batch, self.forward_step(batch))
        loss = loss_sum / frames.clamp(min=1)
        self.log("reduced_train_loss", loss, batch_size=1)
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        loss_sum, frames = self.loss_step(batch, self.forward_step(batch))
        self.log("val_loss", loss_sum / frames.clamp(min=1), batch_size=int(frames))

    def train_dataloader(self) -> DataLoader:
        """Shuffled by a seeded permutation of the whole set, sharded by data-parallel rank: the union of the
        ranks' batches at a step is the same global batch whatever the data-parallel size."""
        sampler = DistributedSampler(
            toy_dataset(self.cfg),
            num_replicas=parallel_state.data_parallel_world_size(),
            rank=parallel_state.data_parallel_rank(),
            shuffle=True,
            seed=self.cfg.seed,
        )
        return DataLoader(sampler.dataset, batch_size=self.cfg.batch_size, sampler=sampler)
