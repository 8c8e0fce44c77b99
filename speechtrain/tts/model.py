"""Codec-token text-to-speech: a transformer encoder reads text (characters or phonemes), a causal transformer
decoder predicts the frames of an audio codec autoregressively, one output head per codebook (MagpieTTS-style).

Data flow of a training step::

    audio --codec.encode--> codes (B, K, F) --BOS + shift--> decoder input: sum of K codebook embeddings per step
    text ids --embedding + encoder--> memory (B, N, D) --cross-attention (+ log alignment prior)--^
    decoder output (B, steps, D) --heads--> logits (B, steps, S, K, C + 2) --masked CE--> loss

* ``S`` = ``frame_stacking`` codec frames per decoder step (fewer, cheaper steps); ``C`` codewords per codebook plus
  ``BOS`` (= C) and ``EOS`` (= C + 1). The frame after the last one is EOS in every codebook.
* Alignment aid: a beta-binomial prior over text positions for each decoder step (near-diagonal, as in RAD-TTS and
  MagpieTTS) is added, as log-probabilities, to the cross-attention logits at the start of training and faded out
  between ``prior_scaledown_start_step`` and ``prior_end_step``, so the model learns monotonic alignment quickly
  but does not depend on it. At inference an optional window around the attended position (tracked from the
  cross-attention) keeps the alignment monotonic, and EOS is held back until the last text tokens are reached.
* Classifier-free guidance: training replaces the text of a ``condition_dropout`` fraction of utterances by a
  single "no text" token; synthesis runs both (in one batch of 2B) and combines the logits
  (:mod:`speechtrain.tts.guidance`).
* The codec (:class:`~speechtrain.tts.codec.MelRVQCodec`) is a submodule: its codebooks are buffers saved in the
  archive, never trained. The text front-end's symbol inventory is in the config.
"""

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from speechtrain.common.batch import is_empty_batch
from speechtrain.core.model import SpeechModel
from speechtrain.core.optim import OptimConfig
from speechtrain.data.audio_text import SkipTally
from speechtrain.data.cut_datasets import TtsCutDataset
from speechtrain.data.lhotse_loader import LoaderConfig, get_lhotse_dataloader_from_config, loader_config
from speechtrain.lightning import parallel_state
from speechtrain.nn import ColumnParallelLinear, DecoderBlock, TransformerBlock
from speechtrain.nn.init import seeded
from speechtrain.tts.codec import MelRVQCodec, MelRVQCodecConfig
from speechtrain.tts.guidance import condition_dropout_mask, guide_logits, sample_codes
from speechtrain.tts.text import TextFrontEnd, TextFrontEndConfig

logger = logging.getLogger(__name__)


@dataclass
class TTSTransformerConfig:
    """Shape of the encoder-decoder transformer.

    Attributes:
        d_model: width of both stacks.
        encoder_layers, decoder_layers: depths.
        num_heads: attention heads (self and cross; divisible by the TP size).
        d_ff: feed-forward hidden width.
        dropout: residual and feed-forward dropout.
        attention_dropout: dropout on attention probabilities.
    """

    d_model: int = 256
    encoder_layers: int = 4
    decoder_layers: int = 6
    num_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.1
    attention_dropout: float = 0.0


@dataclass
class AlignmentPriorConfig:
    """The beta-binomial alignment prior of training and the monotonic window of inference.

    Attributes:
        scaling: concentration of the beta-binomial prior (1.0: RAD-TTS's; larger is sharper).
        alignment_loss_weight: weight of the forward-sum (CTC) alignment loss on every decoder layer's
            head-averaged cross-attention, which teaches monotonic alignment to the attention itself (0: off).
        scaledown_start_step, end_step: full strength until the first step, faded linearly to off at the second.
        floor: smallest prior probability (its log bounds the logit bias).
        inference_window: at synthesis, each step may attend only to text positions within
            ``[p - inference_window_back, p + inference_window]`` of the position ``p`` attended at the previous
            step (0: no window).
        inference_window_back: see above.
        eos_margin: at synthesis, EOS is held back until the attended position is within this many tokens of the
            text's end (-1: never held back).
    """

    scaling: float = 1.0
    alignment_loss_weight: float = 0.1
    scaledown_start_step: int = 1000
    end_step: int = 2000
    floor: float = 1e-8
    inference_window: int = 3
    inference_window_back: int = 1
    eos_margin: int = 3


@dataclass
class InferenceConfig:
    """Defaults of :meth:`TTSModel.synthesize`: ``guidance_scale`` (1: no CFG), ``temperature`` (0: greedy),
    ``top_k``, and the length limits: ``max_seconds`` of audio, and ``max_frames_per_token`` codec frames per text
    symbol (a model that fails to stop ends there instead of babbling on to ``max_seconds``)."""

    guidance_scale: float = 1.5
    temperature: float = 0.6
    top_k: int = 80
    max_seconds: float = 20.0
    max_frames_per_token: int = 12


@dataclass
class TTSConfig:
    """Config of :class:`TTSModel`.

    Attributes:
        sample_rate: audio rate (the codec's).
        text: text front-end (characters or eSpeak phonemes; the symbol inventory is filled from the training
            transcripts by the training script).
        codec: the codec's config; its fitted codebooks come with the model's weights.
        transformer: the encoder-decoder's shape.
        frame_stacking: codec frames predicted per decoder step.
        speakers: speaker names, for a multi-speaker model (a learned embedding per speaker, added to every
            decoder step); None: one voice.
        condition_dropout: fraction of training utterances whose text is replaced by "no text" (for CFG).
        prior: alignment aids (see :class:`AlignmentPriorConfig`).
        inference: synthesis defaults.
        max_text_tokens: longer texts are skipped in training (and refused at synthesis).
        train_ds, validation_ds: loader configs (bucketed by duration).
        val_samples: dev utterances synthesised at each validation and logged to TensorBoard (audio, spectrogram,
            attention).
        optim: optimizer and schedule.
    """

    sample_rate: int = 16000
    text: TextFrontEndConfig = field(default_factory=TextFrontEndConfig)
    codec: MelRVQCodecConfig = field(default_factory=MelRVQCodecConfig)
    transformer: TTSTransformerConfig = field(default_factory=TTSTransformerConfig)
    frame_stacking: int = 1
    speakers: list[str] | None = None
    condition_dropout: float = 0.1
    prior: AlignmentPriorConfig = field(default_factory=AlignmentPriorConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    max_text_tokens: int = 400
    train_ds: LoaderConfig = field(default_factory=lambda: LoaderConfig(batch_duration=60.0))
    validation_ds: LoaderConfig = field(
        default_factory=lambda: LoaderConfig(batch_duration=120.0, use_bucketing=False, shuffle=False)
    )
    val_samples: int = 2
    optim: OptimConfig = field(default_factory=OptimConfig)


def sinusoidal_positions(length: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """(length, d_model) sinusoidal encodings of positions 0 .. length - 1."""
    positions = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    frequencies = torch.exp(torch.arange(0, d_model, 2, device=device) * (-math.log(10000.0) / d_model))
    encoding = torch.zeros(length, d_model, device=device)
    encoding[:, 0::2] = torch.sin(positions * frequencies)
    encoding[:, 1::2] = torch.cos(positions * frequencies)
    return encoding


def beta_binomial_log_prior(
    text_lens: torch.Tensor, step_lens: torch.Tensor, scaling: float = 1.0, shape: tuple[int, int] | None = None
) -> torch.Tensor:
    """(B, T, N) log-probabilities of text position n for decoder step t: a beta-binomial distribution over the
    ``text_len`` positions with ``a = scaling * (t + 1)``, ``b = scaling * (step_len - t)``, so that its mean moves
    from the first to the last token along the utterance. Entries beyond an utterance's lengths are 0. ``shape``:
    (T, N) when the padded sizes exceed the longest lengths."""
    device = text_lens.device
    steps, positions = shape if shape is not None else (int(step_lens.max()), int(text_lens.max()))
    t = torch.arange(steps, device=device, dtype=torch.float64)[None, :, None]  # (1, T, 1)
    n = torch.arange(positions, device=device, dtype=torch.float64)[None, None, :]  # (1, 1, N)
    count = (text_lens.double() - 1)[:, None, None]  # (B, 1, 1) trials: positions 0 .. N-1
    a = scaling * (t + 1)
    b = scaling * (step_lens.double()[:, None, None] - t)
    b = b.clamp(min=scaling)  # steps beyond the utterance: any positive value (masked below)
    k = n.clamp(max=count.clamp(min=0))

    def log_beta(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.lgamma(x) + torch.lgamma(y) - torch.lgamma(x + y)

    log_choose = torch.lgamma(count + 1) - torch.lgamma(k + 1) - torch.lgamma(count - k + 1)
    log_prior = log_choose + log_beta(k + a, count - k + b) - log_beta(a, b)
    valid = (t < step_lens[:, None, None]) & (n < text_lens[:, None, None])
    return torch.where(valid, log_prior, torch.zeros((), dtype=torch.float64, device=device)).float()


def alignment_loss(weights: torch.Tensor, text_lens: torch.Tensor, step_lens: torch.Tensor,
                   blank_log_prob: float = -1.0, reduction: str = "mean") -> torch.Tensor:  # fmt: skip
    """RAD-TTS's forward-sum loss: the negative log-likelihood, under the (B, T, N) attention ``weights``, of
    visiting text positions 1..N in order (each for one or more decoder steps), by CTC with a constant-score blank;
    per utterance divided by its text length (``reduction="none"``: those (B,)), averaged over the batch (an
    impossible alignment counts 0)."""
    log_probs = torch.log(weights.float().clamp(min=1e-8))
    positions = torch.arange(log_probs.shape[-1], device=log_probs.device)
    # Padded positions get a large negative score, not -inf: CTC's gradient is NaN at -inf inputs.
    log_probs = log_probs.masked_fill(positions[None, None, :] >= text_lens[:, None, None], -1e4)
    log_probs = F.pad(log_probs, (1, 0), value=blank_log_prob).log_softmax(dim=-1)  # (B, T, 1 + N), blank first
    targets = (positions + 1)[None, :].expand(log_probs.shape[0], -1)
    losses = F.ctc_loss(log_probs.transpose(0, 1), targets, step_lens, text_lens, blank=0, reduction="none",
                        zero_infinity=True)  # fmt: skip
    per = losses / text_lens.clamp(min=1).to(losses.dtype)
    return per if reduction == "none" else per.mean()


class TTSModel(SpeechModel):
    """Encoder-decoder codec-token TTS with CFG (see the module docstring)."""

    NO_TRAINING_DATA = "model.train_ds.manifest_filepath is not set: there is nothing to train on."

    Config = TTSConfig

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        if cfg.frame_stacking < 1:
            raise ValueError(f"model.frame_stacking must be >= 1, got {cfg.frame_stacking}.")
        if not 0.0 <= cfg.condition_dropout <= 1.0:
            raise ValueError(f"model.condition_dropout must be in [0, 1], got {cfg.condition_dropout}.")
        self.text_frontend = TextFrontEnd(OmegaConf.to_object(cfg.text))
        self.codec = MelRVQCodec(cfg.codec)
        if self.codec.sample_rate != cfg.sample_rate:
            raise ValueError(f"model.sample_rate={cfg.sample_rate} differs from the codec's {self.codec.sample_rate}.")
        self.num_codebooks = cfg.codec.num_codebooks
        self.codebook_size = cfg.codec.codebook_size
        self.bos, self.eos = self.codebook_size, self.codebook_size + 1
        self.entries = self.codebook_size + 2  # codewords, BOS, EOS
        self._init_seed = int(torch.randint(0, 2**30, ()).item())
        self.encoder: torch.nn.ModuleList | None = None
        self._skips = SkipTally()
        self._train_loader: DataLoader | None = None
        self._val_loaders: list[DataLoader] = []
        self._val_sums: torch.Tensor | None = None
        self._val_examples: list[dict[str, Any]] = []

    # ---------------------------------------------------------------------------------------------- layers
    @property
    def text_vocab_size(self) -> int:
        return self.text_frontend.vocab_size

    @property
    def no_text_id(self) -> int:
        """The id of the "no text" token that replaces the text of unconditional utterances."""
        return self.text_vocab_size

    def configure_model(self) -> None:
        """Builds the layers once the parallel layout is known (each from its own seeded stream, so TP=n draws
        the TP=1 weights). Idempotent."""
        if self.encoder is not None:
            return
        t, seed = self.cfg.transformer, self._init_seed
        stacked = self.cfg.frame_stacking * self.num_codebooks
        with seeded(seed):
            self.text_embedding = torch.nn.Embedding(self.text_vocab_size + 1, t.d_model)
            self.code_embedding = torch.nn.Embedding(stacked * self.entries, t.d_model)
            self.speaker_embedding = (
                torch.nn.Embedding(len(self.cfg.speakers), t.d_model) if self.cfg.speakers else None
            )
            # Unit-variance inputs: a step's input is the sum of S*K code embeddings, each scaled so that the sum
            # has unit variance per feature, like the sinusoidal positions added to it.
            torch.nn.init.normal_(self.code_embedding.weight, std=stacked**-0.5)
        encoder = []
        for index in range(t.encoder_layers):
            with seeded(seed + 1 + index):
                encoder.append(TransformerBlock(t.d_model, t.num_heads, t.d_ff, t.dropout, t.attention_dropout,
                                                relative_positions=True))  # fmt: skip
        decoder = []
        for index in range(t.decoder_layers):
            with seeded(seed + 1001 + index):
                decoder.append(DecoderBlock(t.d_model, t.num_heads, t.d_ff, t.dropout, t.attention_dropout))
        self.encoder = torch.nn.ModuleList(encoder)
        self.decoder = torch.nn.ModuleList(decoder)
        self.encoder_norm = torch.nn.LayerNorm(t.d_model)
        self.decoder_norm = torch.nn.LayerNorm(t.d_model)
        self.dropout = torch.nn.Dropout(t.dropout)
        with seeded(seed + 2001):
            self.head = ColumnParallelLinear(t.d_model, stacked * self.entries, gather_output=True)
        # Offsets of each (stacked frame, codebook) slot in the shared code embedding table.
        self.register_buffer("_slot_offsets", torch.arange(stacked) * self.entries, persistent=False)

    def _built(self) -> None:
        if self.encoder is None:
            self.configure_model()

    # --------------------------------------------------------------------------------------------- forward
    def encode_text(self, tokens: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, N) ids, (B,) lengths -> (B, N, D) memory and its (B, N) pad mask (True on padding)."""
        self._built()
        pad = torch.arange(tokens.shape[1], device=tokens.device)[None, :] >= lens[:, None]
        x = self.dropout(self.text_embedding(tokens))
        for layer in self.encoder:
            x = layer(x, pad)
        return self.encoder_norm(x) * ~pad[:, :, None], pad

    def _step_inputs(self, steps_codes: torch.Tensor) -> torch.Tensor:
        """(B, T, S*K) codes of each step's input frames -> (B, T, D): the sum of their embeddings."""
        return self.code_embedding(steps_codes + self._slot_offsets).sum(dim=2)

    def decode_steps(
        self,
        inputs: torch.Tensor,
        memory: torch.Tensor,
        memory_pad: torch.Tensor,
        bias: torch.Tensor | None = None,
        speaker_ids: torch.Tensor | None = None,
        start: int = 0,
        caches: list[dict] | None = None,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Decoder over step inputs (B, T, S*K) starting at step ``start`` -> logits (B, T, S, K, C+2) in fp32 and
        each layer's (B, T, N) cross-attention weights (when ``need_weights``)."""
        x = self._step_inputs(inputs)
        x = x + sinusoidal_positions(start + x.shape[1], x.shape[-1], x.device)[start:].to(x.dtype)
        if self.speaker_embedding is not None and speaker_ids is not None:
            x = x + self.speaker_embedding(speaker_ids)[:, None, :]
        x = self.dropout(x)
        weights = []
        for index, layer in enumerate(self.decoder):
            cache = caches[index] if caches is not None else None
            x, w = layer(x, memory, memory_pad, bias, need_weights, cache)
            weights.append(w)
        logits = self.head(self.decoder_norm(x)).float()
        return logits.view(*logits.shape[:2], self.cfg.frame_stacking, self.num_codebooks, self.entries), weights

    # ------------------------------------------------------------------------------------- training targets
    def stack_codes(self, codes: torch.Tensor, frame_lens: torch.Tensor) -> dict[str, torch.Tensor]:
        """Teacher-forcing tensors from codec codes (B, K, F): ``inputs`` (B, T, S*K) (BOS then the frames of the
        previous step), ``targets`` (B, T, S, K) (the frames, EOS after the last, BOS-padded), ``mask`` (B, T, S)
        True on frames that count (real frames and the EOS), and ``step_lens`` (B,)."""
        stacking = self.cfg.frame_stacking
        batch, k, frames = codes.shape
        steps = (frames + 1 + stacking - 1) // stacking  # room for the EOS frame
        total = steps * stacking
        framewise = torch.full((batch, total, k), self.bos, dtype=torch.long, device=codes.device)
        framewise[:, :frames] = codes.transpose(1, 2)
        index = torch.arange(total, device=codes.device)[None, :]
        framewise.masked_fill_((index == frame_lens[:, None])[:, :, None], self.eos)
        valid = index <= frame_lens[:, None]  # real frames and the EOS frame
        framewise = torch.where(valid[:, :, None], framewise, torch.full_like(framewise, self.bos))
        targets = framewise.view(batch, steps, stacking, k)
        inputs = torch.cat([torch.full_like(targets[:, :1], self.bos), targets[:, :-1]], dim=1)
        inputs = inputs.masked_fill(inputs == self.eos, self.bos)  # an EOS never feeds back
        step_lens = frame_lens // stacking + 1
        return {"inputs": inputs.flatten(2), "targets": targets, "mask": valid.view(batch, steps, stacking),
                "step_lens": step_lens}  # fmt: skip

    def prior_strength(self, step: int) -> float:
        """1 until ``prior.scaledown_start_step``, then linearly down to 0 at ``prior.end_step``."""
        prior = self.cfg.prior
        if step < prior.scaledown_start_step:
            return 1.0
        if step >= prior.end_step:
            return 0.0
        return 1.0 - (step - prior.scaledown_start_step) / max(1, prior.end_step - prior.scaledown_start_step)

    def prior_bias(self, text_lens: torch.Tensor, step_lens: torch.Tensor, strength: float,
                   shape: tuple[int, int]) -> torch.Tensor | None:  # fmt: skip
        """(B, 1, T, N) logit bias ``log(strength * prior + 1 - strength)`` for a (T, N) attention map (None when
        ``strength`` is 0)."""
        if strength <= 0:
            return None
        prior = beta_binomial_log_prior(text_lens, step_lens, self.cfg.prior.scaling, shape).exp()
        prior = prior.clamp(min=self.cfg.prior.floor)
        return torch.log(strength * prior + (1.0 - strength))[:, None]

    def codes_of(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's codec codes (B, K, F) and frame lengths: precomputed, or encoded from its audio."""
        if "codes" in batch:
            return batch["codes"], batch["code_lens"]
        return self.codec.encode(batch["audio"], batch["audio_lens"], batch.get("audio_samples"))

    def drop_condition(self, tokens: torch.Tensor, lens: torch.Tensor, dropped: torch.Tensor) -> tuple:
        """Texts with the ``dropped`` (B,) ones replaced by the single "no text" token."""
        tokens = torch.cat([torch.where(dropped, self.no_text_id, tokens[:, 0])[:, None], tokens[:, 1:]], dim=1)
        return tokens, torch.where(dropped, torch.ones_like(lens), lens)

    def teacher_forced_logits(
        self, batch: dict[str, Any], dropped: torch.Tensor | None = None, prior_strength: float = 0.0,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        """Logits (B, T, S, K, C+2) of a batch under teacher forcing, the targets (:meth:`stack_codes`) and the
        cross-attention weights; ``dropped`` (B,) utterances get no text."""
        self._built()
        codes, frame_lens = self.codes_of(batch)
        tf = self.stack_codes(codes, frame_lens)
        tokens, lens = batch["text_tokens"], batch["text_lens"]
        if dropped is not None:  # (a no-op where none is dropped: no host check)
            tokens, lens = self.drop_condition(tokens, lens, dropped)
        memory, pad = self.encode_text(tokens, lens)
        bias = self.prior_bias(lens, tf["step_lens"], prior_strength, (tf["inputs"].shape[1], memory.shape[1]))
        logits, weights = self.decode_steps(tf["inputs"], memory, pad, bias, batch.get("speaker_ids"),
                                            need_weights=need_weights)  # fmt: skip
        return logits, tf, weights

    def code_losses(self, logits: torch.Tensor, tf: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy over valid (frame, codebook) slots, their count)."""
        ce = F.cross_entropy(logits.flatten(0, 3), tf["targets"].flatten(), reduction="none").view(tf["targets"].shape)
        weights = tf["mask"][..., None].expand_as(ce).float()
        return (ce * weights).sum(), weights.sum()

    # ------------------------------------------------------------------ the Megatron bridge's step contract
    def set_input_tensor(self, tensors: list[torch.Tensor | None]) -> None:
        if any(t is not None for t in tensors):
            raise ValueError(f"{type(self).__name__} has a single pipeline stage: use pipeline_model_parallel_size=1.")

    def forward_step(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Logits, targets and the alignment loss (0 outside training); during training a ``condition_dropout``
        fraction of utterances has no text (and no alignment loss), and the alignment prior is applied at the
        current step's strength."""
        dropped = None
        strength = 0.0
        weight = self.cfg.prior.alignment_loss_weight
        if self.training:
            dropped = condition_dropout_mask(len(batch["ids"]), self.cfg.condition_dropout,
                                             device=batch["text_tokens"].device)  # fmt: skip
            strength = self.prior_strength(self.global_step if self._trainer is not None else 0)
        need = self.training and weight > 0
        logits, tf, weights = self.teacher_forced_logits(batch, dropped, strength, need_weights=need)
        align = torch.zeros((), device=logits.device)
        if need:  # over the utterances that kept their text (masks, not selections: no host synchronisation)
            keep = ~dropped
            lens, steps = batch["text_lens"], tf["step_lens"]
            per = sum(alignment_loss(w, lens, steps, reduction="none") for w in weights) / len(weights)
            align = torch.where(keep, per, torch.zeros_like(per)).sum() / keep.sum().clamp(min=1)
        return logits, tf, align

    def loss_step(self, batch: dict[str, Any], output: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, count) over valid (frame, codebook) slots: the ratio is the mean cross-entropy, plus the
        weighted alignment loss."""
        logits, tf, align = output
        loss_sum, count = self.code_losses(logits, tf)
        if self.training:
            self._last_alignment_loss = align.detach()
        return loss_sum + self.cfg.prior.alignment_loss_weight * align * count, count

    def log_step_extras(self, batch: dict[str, Any]) -> None:
        if getattr(self, "_last_alignment_loss", None) is not None:
            self.log("train_alignment_loss", self._last_alignment_loss, batch_size=len(batch["ids"]))

    # ---------------------------------------------------------------------------------------------- validation
    def on_validation_epoch_start(self) -> None:
        self._val_sums = torch.zeros(4, dtype=torch.float64, device=self.device)
        self._val_examples = []

    def validation_step(self, batch: dict[str, Any] | None, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Teacher-forced loss and first-codebook accuracy; keeps the first ``val_samples`` utterances for the
        synthesis logged at the end."""
        if is_empty_batch(batch):
            return
        logits, tf, _ = self.teacher_forced_logits(batch)
        loss_sum, count = self.code_losses(logits, tf)
        mask = tf["mask"]
        correct = ((logits[..., 0, :].argmax(-1) == tf["targets"][..., 0]) & mask).sum()
        self._val_sums += torch.stack([loss_sum.detach(), count, correct, mask.sum()]).double()  # no host sync
        for i in range(len(batch["ids"])):
            if len(self._val_examples) < self.cfg.val_samples:
                self._val_examples.append({"id": batch["ids"][i], "text": batch["texts"][i]})

    def on_validation_epoch_end(self) -> None:
        sums = (
            self._val_sums if self._val_sums is not None else torch.zeros(4, dtype=torch.float64, device=self.device)
        )
        if self.trainer.world_size > 1:
            sums = self.trainer.strategy.reduce(sums.to(self.device), reduce_op="sum").cpu()
        loss_sum, count, correct, frames = sums.tolist()
        self.log("val_loss", loss_sum / max(count, 1.0), prog_bar=True, sync_dist=True)
        self.log("val_acc_codebook0", correct / max(frames, 1.0), sync_dist=True)
        # Tensor-parallel peers synthesise together (their layers exchange activations); global rank 0 writes.
        if self._val_examples and parallel_state.in_first_replica() and not self.trainer.sanity_checking:
            self._log_samples(self._val_examples)

    def _log_samples(self, examples: list[dict[str, Any]]) -> None:
        """Synthesises ``examples`` and sends audio, spectrogram and attention images to TensorBoard."""
        # Off rank 0 the loggers' experiments are Lightning's no-op stand-ins: every rank decides alike.
        writer = next((lg.experiment for lg in self.trainer.loggers if hasattr(lg.experiment, "add_audio")), None)
        if writer is None:
            return
        result = self.synthesize([e["text"] for e in examples], return_details=True)
        step = self.global_step
        for i, example in enumerate(examples):
            audio = result["audio"][i]
            writer.add_audio(f"val_audio/{i}", audio[None], step, sample_rate=self.cfg.sample_rate)
            writer.add_text(f"val_text/{i}", example["text"], step)
            writer.add_image(f"val_spectrogram/{i}", _image(result["log_mels"][i].flip(0)), step)
            writer.add_image(f"val_attention/{i}", _image(result["attention"][i].T.flip(0)), step)

    # ------------------------------------------------------------------------------------------------ data
    def setup_data(self, stage: str) -> None:
        if stage == "fit":
            self._train_loader = self._build_loader(self.cfg.train_ds, self.cfg.train_ds.manifest_filepath)
        if stage in ("fit", "validate"):
            loader = self._build_loader(self.cfg.validation_ds, self.cfg.validation_ds.manifest_filepath, True)
            self._val_loaders = [loader] if loader is not None else []

    def _build_loader(self, ds_cfg: Any, manifests: Any, evaluation: bool = False) -> DataLoader | None:
        from speechtrain.corpora.builtin import resolve_manifest

        if not manifests:
            return None
        cfg = loader_config(OmegaConf.to_object(ds_cfg))
        cfg.manifest_filepath = (str(resolve_manifest(manifests)) if isinstance(manifests, str)
                                 else [str(resolve_manifest(m)) for m in manifests])  # fmt: skip
        cfg.sample_rate = self.cfg.sample_rate
        speakers = {name: i for i, name in enumerate(self.cfg.speakers)} if self.cfg.speakers else None
        dataset = TtsCutDataset.from_config(_TextEncoder(self.text_frontend, self.cfg.max_text_tokens), cfg,
                                            speakers=speakers)  # fmt: skip
        return get_lhotse_dataloader_from_config(
            cfg, parallel_state.data_parallel_rank(), parallel_state.data_parallel_world_size(), dataset,
            evaluation=evaluation,
        )  # fmt: skip

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Shows training speed and the time left (:meth:`log_training_speed`), and the prior's strength."""
        if self.log_training_speed(batch):
            self.log("prior_strength", self.prior_strength(self.global_step), batch_size=1)

    # ------------------------------------------------------------------------------------------- synthesis
    def encode_texts(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded text ids (B, N) and lengths of ``texts``.

        Raises:
            ValueError: naming a text that is empty, too long, or holds symbols outside the inventory.
        """
        ids = []
        for text in texts:
            tokens = self.text_frontend.encode(text)
            if not tokens:
                raise ValueError(f"Cannot synthesise an empty text: {text!r}.")
            if len(tokens) > self.cfg.max_text_tokens:
                raise ValueError(f"Text of {len(tokens)} symbols exceeds model.max_text_tokens="
                                 f"{self.cfg.max_text_tokens}: {text[:80]!r}...")  # fmt: skip
            ids.append(torch.tensor(tokens))
        lens = torch.tensor([len(t) for t in ids])
        padded = torch.zeros(len(ids), int(lens.max()), dtype=torch.long)
        for i, t in enumerate(ids):
            padded[i, : len(t)] = t
        return padded.to(self.device), lens.to(self.device)

    @torch.inference_mode()
    def generate_codes(
        self,
        texts: list[str],
        guidance_scale: float | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        max_seconds: float | None = None,
        seed: int | None = 0,
        speaker_ids: torch.Tensor | None = None,
        use_cache: bool = True,
    ) -> dict[str, Any]:
        """Autoregressive generation of codec codes for a batch of texts (defaults from ``cfg.inference``).

        ``guidance_scale`` != 1 runs the conditional and unconditional passes as one batch of 2B and combines their
        logits; each utterance stops at EOS (sampled in the first codebook, and not before its attention is within
        ``prior.eos_margin`` tokens of the text's end) or at its length limit (``max_seconds``,
        ``max_frames_per_token``).

        Returns:
            ``codes`` (B, K, F), ``frame_lens`` (B,), ``attention`` (B, steps, N) cross-attention of the
            conditional pass (averaged over layers and heads), ``steps`` decoder steps run, ``decoder_passes``
            per step (1 or 2).
        """
        self._built()
        inference = self.cfg.inference
        scale = inference.guidance_scale if guidance_scale is None else guidance_scale
        temperature = inference.temperature if temperature is None else temperature
        top_k = inference.top_k if top_k is None else top_k
        max_seconds = inference.max_seconds if max_seconds is None else max_seconds
        generator = torch.Generator(device=self.device).manual_seed(seed) if seed is not None else None
        tokens, lens = self.encode_texts(texts)
        batch = len(texts)
        guided = scale != 1.0
        if guided:
            no_text = torch.full_like(tokens, 0)
            no_text[:, 0] = self.no_text_id
            tokens = torch.cat([tokens, no_text])
            lens = torch.cat([lens, torch.ones_like(lens)])
            if speaker_ids is not None:
                speaker_ids = torch.cat([speaker_ids, speaker_ids])
        memory, pad = self.encode_text(tokens, lens)
        stacking, k = self.cfg.frame_stacking, self.num_codebooks
        max_steps = max(1, int(max_seconds * self.codec.frame_rate) // stacking + 1)
        step_limits = (lens[:batch] * inference.max_frames_per_token // stacking + 1).clamp(max=max_steps)
        caches = [{} for _ in self.decoder] if use_cache else None
        inputs = torch.full((memory.shape[0], 1, stacking * k), self.bos, dtype=torch.long, device=self.device)
        history = inputs
        position = torch.zeros(batch, dtype=torch.long, device=self.device)
        frame_lens = torch.full((batch,), -1, dtype=torch.long, device=self.device)
        window, back = self.cfg.prior.inference_window, self.cfg.prior.inference_window_back
        text_positions = torch.arange(memory.shape[1], device=self.device)
        outputs, attention, biases = [], [], []
        frame_lens_floor = 2  # the codec decodes F frames to (F - 1) hops of audio
        for step in range(max_steps):
            bias = None
            if window > 0:
                allowed = (text_positions[None, :] >= (position - back)[:, None]) & (
                    text_positions[None, :] <= (position + window)[:, None]
                )
                bias_cond = torch.zeros(batch, memory.shape[1], device=self.device).masked_fill(~allowed, -1e4)
                bias_rows = [bias_cond] + ([torch.zeros_like(bias_cond)] if guided else [])
                bias = torch.cat(bias_rows)[:, None, None, :]  # (B or 2B, 1, 1, N)
                if not use_cache:  # recomputing every step: each keeps the window it had
                    biases.append(bias)
                    bias = torch.cat(biases, dim=2)
            step_inputs = inputs if use_cache else history
            logits, weights = self.decode_steps(step_inputs, memory, pad, bias, speaker_ids,
                                                start=step if use_cache else 0, caches=caches,
                                                need_weights=True)  # fmt: skip
            logits = logits[:, -1]  # (B or 2B, S, K, V)
            step_attention = torch.stack([w[:batch, -1] for w in weights]).mean(0)  # (B, N)
            attention.append(step_attention)
            position = torch.maximum(position, step_attention.argmax(-1))
            if guided:
                logits = guide_logits(logits[:batch], logits[batch:], scale)
            margin = self.cfg.prior.eos_margin
            if margin >= 0:
                early = position < (lens[:batch] - 1 - margin)
                logits[..., self.eos] = logits[..., self.eos].masked_fill(early[:, None, None], float("-inf"))
            logits[..., self.bos] = float("-inf")  # BOS is never an output
            # TP peers feed the same codes and stop at the same step whatever their random streams.
            codes = parallel_state.same_on_tensor_parallel_ranks(sample_codes(logits, temperature, top_k, generator))
            outputs.append(codes)
            for s in range(stacking):
                ended = (codes[:, s, 0] == self.eos) & (frame_lens < 0)
                frame_lens = torch.where(ended, torch.full_like(frame_lens, step * stacking + s), frame_lens)
            too_long = (frame_lens < 0) & (step + 1 >= step_limits)
            frame_lens = torch.where(too_long, torch.full_like(frame_lens, (step + 1) * stacking), frame_lens)
            if bool((frame_lens >= 0).all()):
                break
            feed = codes.masked_fill(codes == self.eos, self.bos).flatten(1)[:, None]  # (B, 1, S*K)
            if guided:
                feed = torch.cat([feed, feed])
            inputs = feed
            history = torch.cat([history, feed], dim=1)
        steps = len(outputs)
        frame_lens = torch.where(frame_lens < 0, torch.full_like(frame_lens, steps * stacking), frame_lens)
        frame_lens = frame_lens.clamp(min=frame_lens_floor)  # an immediate EOS still decodes (to one frame)
        codes = torch.stack(outputs, dim=1).flatten(1, 2)  # (B, steps*S, K)
        codes = codes.masked_fill(codes >= self.codebook_size, 0).transpose(1, 2)  # specials -> any codeword
        return {"codes": codes[:, :, : int(frame_lens.max())], "frame_lens": frame_lens,
                "attention": torch.stack(attention, dim=1), "text_lens": lens[:batch], "steps": steps,
                "decoder_passes": 2 if guided else 1}  # fmt: skip

    @torch.inference_mode()
    def synthesize(self, texts: list[str], return_details: bool = False, **kwargs: Any) -> Any:
        """Audio for ``texts`` (a list of 1-D float tensors at ``sample_rate``); ``kwargs`` as for
        :meth:`generate_codes`. With ``return_details``, a dict with ``audio``, ``log_mels`` (n_mels, F) and
        ``attention`` (steps, N) per utterance, and the generation's ``steps`` and ``seconds``."""
        was_training = self.training
        self.eval()
        try:
            start = time.perf_counter()
            out = self.generate_codes(texts, **kwargs)
            audio, audio_lens = self.codec.decode(out["codes"], out["frame_lens"])
            seconds = time.perf_counter() - start
        finally:
            self.train(was_training)
        waves = [audio[i, : int(audio_lens[i])].float().cpu() for i in range(len(texts))]
        if not return_details:
            return waves
        mels = self.codec.dequantize(out["codes"])
        lens = out["text_lens"]
        return {"audio": waves, "seconds": seconds, "steps": out["steps"], "decoder_passes": out["decoder_passes"],
                "log_mels": [mels[i, :, : int(out["frame_lens"][i])].cpu() for i in range(len(texts))],
                "attention": [out["attention"][i, :, : int(lens[i])].cpu() for i in range(len(texts))]}  # fmt: skip

    def flops_per_batch(self, batch: dict[str, Any]) -> torch.Tensor:
        """Approximate training FLOPs of one step (forward x 3), for the telemetry's MFU. The telemetry passes only
        ``audio_lens``: text lengths are then estimated at 15 symbols per second of speech."""
        t = self.cfg.transformer
        frames = (batch["audio_lens"] // self.cfg.codec.hop_length + 2) // self.cfg.frame_stacking
        text = batch.get("text_lens")
        if text is None:
            text = (batch["audio_lens"] * 15 // self.cfg.sample_rate).clamp(min=1)
        d, ff = t.d_model, t.d_ff
        encoder = t.encoder_layers * (2 * (6 * d * d + 2 * d * ff) * text + 4 * d * text**2)
        decoder = t.decoder_layers * (2 * (8 * d * d + 2 * d * ff) * frames + 4 * d * (frames**2 + frames * text))
        head = 2 * d * self.cfg.frame_stacking * self.num_codebooks * self.entries * frames
        return 3 * (encoder + decoder + head).sum()


class _TextEncoder:
    """The loaders' text encoder: the front-end's ids, refusing texts longer than ``max_tokens``."""

    def __init__(self, frontend: TextFrontEnd, max_tokens: int) -> None:
        self.frontend, self.max_tokens = frontend, max_tokens

    def encode(self, text: str) -> list[int]:
        ids = self.frontend.encode(text)
        if len(ids) > self.max_tokens:
            raise ValueError(f"{len(ids)} text symbols exceed model.max_text_tokens={self.max_tokens}")
        return ids


def _image(matrix: torch.Tensor) -> torch.Tensor:
    """(H, W) values -> (1, H, W) in [0, 1] for TensorBoard."""
    matrix = matrix.float()
    low, high = matrix.min(), matrix.max()
    return ((matrix - low) / (high - low).clamp(min=1e-9))[None]
