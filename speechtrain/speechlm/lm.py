"""Pretraining a small GPT on text, for a self-contained SALM recipe (no pretrained LLM can be downloaded here).

:class:`GPTPretrainModel` trains the same Megatron ``GPTModel`` that SALM uses (so tensor parallelism applies) on
packed token sequences: documents ``<bos> sentence <eos>`` concatenated and cut into rows of ``seq_len + 1``
tokens. The default text source is the built-in corpus's sentence generator, keeping only sentences that the
corpus would assign to its *train* split (dev and test sentences are never seen). After training, the script
writes a Hugging Face checkpoint folder (:func:`speechtrain.speechlm.hf.export_hf`) that SALM imports like any
other Llama / Qwen2 checkpoint.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.lightning import parallel_state
from speechtrain.speechlm.backbone import GPTConfig, build_gpt, gpt_logits
from speechtrain.speechlm.tokenizer import LLMTokenizer

logger = logging.getLogger(__name__)


@dataclass
class TextDataConfig:
    """Packed text: ``sentences`` generated sentences (train split of the corpus with ``corpus_seed``) or the lines
    of ``text_file``; the last ``validation_fraction`` of the rows is held out for the validation loss."""

    text_file: str | None = None
    sentences: int = 200_000
    corpus_seed: int = 0
    generator_seed: int = 1
    seq_len: int = 128
    batch_size: int = 32
    validation_fraction: float = 0.01


@dataclass
class GPTPretrainConfig:
    """Config of :class:`GPTPretrainModel`: the GPT shape, the tokenizer (``tokenizer.json``), the data."""

    llm: GPTConfig = field(default_factory=GPTConfig)
    tokenizer: str | None = None
    data: TextDataConfig = field(default_factory=TextDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)


def corpus_sentences(count: int, corpus_seed: int = 0, generator_seed: int = 1) -> list[str]:
    """``count`` distinct generated sentences that the built-in corpus (seed ``corpus_seed``) puts in its train
    split: no dev or test sentence among them."""
    from speechtrain.corpora.sentences import SentenceGenerator, split_of
    from speechtrain.corpora.speech_corpus import SPLITS

    generator = SentenceGenerator(generator_seed)
    kept: list[str] = []
    while len(kept) < count:
        kept += [s for s in generator.sentences(5000) if split_of(s, SPLITS, corpus_seed) == "train"]
    return kept[:count]


def pack(documents: list[list[int]], row: int) -> torch.Tensor:
    """Concatenated documents cut into (N, row) rows (the tail that does not fill a row is dropped)."""
    flat = torch.tensor([t for doc in documents for t in doc], dtype=torch.long)
    n = flat.numel() // row
    return flat[: n * row].view(n, row)


class _ShardedShuffle(torch.utils.data.Sampler):
    """This data-parallel rank's share of the rows, in a seeded order per epoch."""

    def __init__(self, rows: int, shuffle: bool, seed: int = 0) -> None:
        self.rows, self.shuffle, self.seed, self.epoch = rows, shuffle, seed, 0
        self.rank, self.world = parallel_state.data_parallel_rank(), parallel_state.data_parallel_world_size()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        order = torch.arange(self.rows)
        if self.shuffle:
            order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter(order[self.rank :: self.world].tolist())

    def __len__(self) -> int:
        return len(range(self.rank, self.rows, self.world))


class GPTPretrainModel(SpeechModel):
    """Next-token prediction on packed text with Megatron's GPT (see the module docstring)."""

    Config = GPTPretrainConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        if not self.cfg.tokenizer:
            raise ValueError("model.tokenizer: the tokenizer.json to pretrain with is not set.")
        tokenizer_file = self.register_artifact("tokenizer", self.cfg.tokenizer)
        self.tokenizer = LLMTokenizer.from_folder(tokenizer_file.parent)
        if self.tokenizer.vocab_size > self.cfg.llm.vocab_size:
            raise ValueError(f"The tokenizer has {self.tokenizer.vocab_size} tokens; model.llm.vocab_size is only "
                             f"{self.cfg.llm.vocab_size}.")  # fmt: skip
        self.llm: torch.nn.Module | None = None
        self._rows: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        if self.llm is None:
            from omegaconf import OmegaConf

            self.llm = build_gpt(GPTConfig(**OmegaConf.to_container(self.cfg.llm)))

    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        if any(t is not None for t in tensors):
            raise ValueError(f"{type(self).__name__} has a single pipeline stage: use pipeline_model_parallel_size=1.")

    def forward_step(self, batch: torch.Tensor) -> torch.Tensor:
        """Per-token cross-entropy (B, seq_len) of next-token prediction on rows (B, seq_len + 1)."""
        self.configure_model()
        embeds = self.llm.embedding.word_embeddings(batch[:, :-1])
        return gpt_logits(self.llm, embeddings=embeds, labels=batch[:, 1:]).float()

    def loss_step(self, batch: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return output.sum(), torch.tensor(output.numel(), device=output.device)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.forward_step(batch).mean()
        self.log("train_loss", loss, prog_bar=True, batch_size=batch.shape[0])
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        losses = self.forward_step(batch)
        self.log("val_loss", losses.mean(), prog_bar=True, sync_dist=True, batch_size=batch.shape[0])

    # ------------------------------------------------------------------------------------------------ data
    def setup_data(self, stage: str) -> None:
        if self._rows:
            return
        data = self.cfg.data
        if data.text_file:
            with open(data.text_file, encoding="utf-8") as f:
                texts = [line.strip() for line in f if line.strip()]
        else:
            texts = corpus_sentences(data.sentences, data.corpus_seed, data.generator_seed)
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id
        docs = [([bos] if bos is not None else []) + self.tokenizer.encode(t) + [eos] for t in texts]
        rows = pack(docs, data.seq_len + 1)
        held = max(1, int(len(rows) * data.validation_fraction))
        self._rows = {"train": rows[:-held], "val": rows[-held:]}
        logger.info("LM data: %d texts, %d tokens, %d training rows of %d", len(texts), sum(map(len, docs)),
                    len(self._rows["train"]), data.seq_len + 1)  # fmt: skip

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        rows = self._rows[split]
        sampler = _ShardedShuffle(len(rows), shuffle)
        return DataLoader(rows, batch_size=self.cfg.data.batch_size, sampler=sampler, drop_last=shuffle)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def on_train_epoch_start(self) -> None:
        super().on_train_epoch_start()
        sampler = self.trainer.train_dataloader.sampler if self.trainer.train_dataloader is not None else None
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(self.current_epoch)
