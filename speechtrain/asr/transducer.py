"""Transducer speech recognisers: RNN-T, TDT and hybrid TDT-CTC on the Conformer / FastConformer encoder.

One model class, :class:`ConformerTransducerModel`, with ``loss: rnnt | tdt`` and a ``hybrid`` flag (a CTC head on
the same encoder, loss ``(1 - ctc_loss_weight) * transducer + ctc_loss_weight * ctc``, NeMo's hybrid models; a
hybrid model takes ``interctc`` too, NeMo's weighting: ``(1 - sum w) * that + sum w_i * CTC(layer i)``). It is
a :class:`~speechtrain.asr.ctc.CTCModel`, so the tokenizer, features, SpecAugment, encoder, data loaders,
validation (WER/CER per set), transcription, archives and fine-tuning are the CTC model's.

Pieces (NeMo's names):

- prediction network: embedding (vocabulary + blank; the blank, a zero vector, starts every transcript) -> LSTM of
  ``pred_rnn_layers`` x ``pred_hidden``;
- joint: ``activation(enc_proj(f) + pred_proj(g))`` -> dropout -> a linear layer to the vocabulary + blank (blank
  last), followed for TDT by the duration logits (one per entry of ``durations``).

Memory: the joint's output would be B x T x (U+1) x (V+1+D) values for a whole batch. It is computed
``joint.fused_batch_size`` utterances at a time and reduced at once to the few log-probabilities the loss needs
(blank, next label, durations); in training each sub-batch is checkpointed, so its full output is recomputed in the
backward pass instead of being kept (``fused_batch_size: 0`` runs the whole batch at once and keeps it). The joint
then takes one sub-batch's ``fused_batch_size x T x (U+1) x (joint_hidden + 2 (V+1+D))`` floats at its peak, plus
``B x T x (U+1) x (2+D)`` kept values; T and U are the batch's longest (no per-step host read to trim them; bucketed
batches hold similar lengths). With sub-batches, what the joint and loss keep for the backward pass is mostly the
loss recursion's, which does not grow with the vocabulary.

Tensor parallelism: the encoder is split over the TP ranks (its output is whole on every rank); the prediction
network and the joint are replicated. Vocabularies of transducers are small (128 to 1024 pieces), so a
vocabulary-parallel output layer would save little compute while adding two all-reduces over B x T x U values
(for the log-softmax) per sub-batch; replicated, every rank computes the same loss and the same gradients.
"""

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.utils.checkpoint import checkpoint

from speechtrain.asr.conformer import conformer_forward_flops, seeded, subsampled_lengths
from speechtrain.asr.ctc import INTERCTC_OFF, ConformerCTCConfig, ConformerCTCModel
from speechtrain.asr.decoding import DecodingConfig
from speechtrain.asr.transducer_decoding import (
    TransducerBeamSearch,
    greedy_batch,
    word_timestamps,
)
from speechtrain.asr.transducer_loss import feasible, rnnt_loss, tdt_loss
from speechtrain.common.config import ConfigError

logger = logging.getLogger(__name__)

LOSSES = ("rnnt", "tdt")
DECODERS = ("transducer", "ctc")
ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "silu": F.silu, "sigmoid": torch.sigmoid}


@dataclass
class PredictionConfig:
    """Prediction network (``model.prediction``): embedding + LSTM, or stateless.

    Attributes:
        pred_hidden: embedding and LSTM width.
        pred_rnn_layers: LSTM layers.
        dropout: dropout on the embedding and the LSTM output.
        context_size: 0: the LSTM, which reads every label so far; k >= 1: stateless (NeMo's
            ``StatelessTransducerDecoder`` and its ``context_size``), the last k labels only, each embedded by its
            own table (offset 1, 2, ..., k), concatenated, projected to ``pred_hidden`` and passed through a ReLU
            (``pred_rnn_layers`` is then unused). A short context cannot learn whole training sentences by heart.
        label_dropout: in training, the probability that each previous label the network reads is replaced by the
            start symbol (blank), drawn per label from the model's RNG like dropout; the loss still
            scores every label. The network then cannot lean on having read the whole sentence before, which a
            decoder trained on few distinct sentences learns by heart. 0: off (NeMo has no such key).
    """

    pred_hidden: int = 640
    pred_rnn_layers: int = 1
    dropout: float = 0.2
    context_size: int = 0
    label_dropout: float = 0.0


def _drop_labels(tokens: torch.Tensor, rate: float, blank: int, training: bool) -> torch.Tensor:
    """``tokens`` with each label replaced by ``blank`` with probability ``rate`` in training (on their device, no
    host read); unchanged otherwise."""
    if not training or rate <= 0.0:
        return tokens
    dropped = torch.rand(tokens.shape, device=tokens.device) < rate
    return tokens.masked_fill(dropped, blank)


@dataclass
class JointConfig:
    """Joint network (``model.joint``).

    Attributes:
        joint_hidden: width of the joint's hidden layer.
        activation: ``relu``, ``tanh``, ``silu`` or ``sigmoid``.
        dropout: dropout after the activation.
        fused_batch_size: utterances whose joint and loss terms are computed at once (0: the whole batch).
        frame_stack: the transducer reads this many consecutive encoder frames as one, concatenated (2 on a 4x
            encoder: an 8x transducer, as NeMo's Parakeet-TDT, with half the joint and loss cost; a hybrid model's
            CTC head keeps the encoder's frames). TDT durations count these frames.
    """

    joint_hidden: int = 640
    activation: str = "relu"
    dropout: float = 0.2
    fused_batch_size: int = 4
    frame_stack: int = 1


@dataclass
class TransducerDecodingConfig(DecodingConfig):
    """CTC's decoding config (``strategy``, beam and LM settings) plus the transducer's own.

    Attributes:
        max_symbols: most labels emitted on one frame (greedy and beam search), NeMo's ``max_symbols``.
    """

    strategy: str = "greedy"
    beam_size: int = 8
    lm_order: int = 0
    lm_weight: float = 0.3
    word_score: float = 1.5
    max_symbols: int = 10


@dataclass
class ConformerTransducerConfig(ConformerCTCConfig):
    """Config of :class:`ConformerTransducerModel`: the CTC model's keys (``ctc_reduction`` is the reduction of the
    whole loss: ``mean_volume`` = per target token, ``mean_batch`` = per utterance) and:

    Attributes:
        loss: ``rnnt`` or ``tdt``.
        durations: TDT's durations in frames (sorted, with 1; 0 lets several labels share a frame).
        sigma: TDT's logit under-normalisation: subtracted from the token log-probabilities in the loss.
        omega: weight of the plain RNN-T loss (on the token log-probabilities) mixed into the TDT loss.
        hybrid: add a CTC head on the encoder (hybrid TDT-CTC / RNNT-CTC).
        ctc_loss_weight: the CTC share of the hybrid loss.
        decoder_type: the head that decodes: ``transducer``, or ``ctc`` (hybrid models only).
        prediction: :class:`PredictionConfig`.
        joint: :class:`JointConfig`.
    """

    loss: str = "tdt"
    durations: list[int] = field(default_factory=lambda: [0, 1, 2, 3, 4])
    sigma: float = 0.02
    omega: float = 0.1
    hybrid: bool = False
    ctc_loss_weight: float = 0.3
    decoder_type: str = "transducer"
    prediction: PredictionConfig = field(default_factory=PredictionConfig)
    joint: JointConfig = field(default_factory=JointConfig)
    decoding: TransducerDecodingConfig = field(default_factory=TransducerDecodingConfig)

    @staticmethod
    def expand_given(config: dict[str, Any]) -> dict[str, Any]:
        """The CTC model's (``size``), less the size's intermediate-CTC taps where there is no CTC head to read them
        (``hybrid`` false)."""
        expanded = ConformerCTCConfig.expand_given(config)
        if not config.get("hybrid") and "interctc" not in config:
            expanded.pop("interctc", None)
        return expanded


class PredictionNetwork(torch.nn.Module):
    """Embedding + LSTM over the previous labels; the blank id is the start symbol (a zero embedding)."""

    def __init__(self, vocab_size: int, blank: int, cfg: PredictionConfig) -> None:
        super().__init__()
        self.blank = blank
        self.embed = torch.nn.Embedding(vocab_size + 1, cfg.pred_hidden, padding_idx=blank)
        self.lstm = torch.nn.LSTM(cfg.pred_hidden, cfg.pred_hidden, cfg.pred_rnn_layers, batch_first=True)
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.label_dropout = cfg.label_dropout

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, U) -> outputs (B, U+1, H): position u has seen the start symbol and ``tokens[:, :u]``."""
        tokens = _drop_labels(tokens, self.label_dropout, self.blank, self.training)
        start = torch.full_like(tokens[:, :1], self.blank)
        x = self.dropout(self.embed(torch.cat([start, tokens], dim=1)))
        return self.dropout(self.lstm(x)[0])

    def step(
        self, tokens: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One label per utterance: tokens (B,), state ((L, B, H), (L, B, H)) or None -> (B, H), new state."""
        out, state = self.lstm(self.embed(tokens)[:, None], state)
        return out[:, 0], state


class StatelessPredictionNetwork(torch.nn.Module):
    """The last ``context_size`` labels (blank before the first): an embedding per offset, concatenated, a linear
    layer to ``pred_hidden`` and a ReLU. Its state is the last ``context_size - 1`` labels, a (1, B, k-1) tensor in
    a 1-tuple, so the decoders batch and select it along dim 1 as they do the LSTM's (h, c)."""

    def __init__(self, vocab_size: int, blank: int, cfg: PredictionConfig) -> None:
        super().__init__()
        self.blank, self.context = blank, cfg.context_size
        self.embed = torch.nn.Embedding(self.context * (vocab_size + 1), cfg.pred_hidden)
        self.proj = torch.nn.Linear(self.context * cfg.pred_hidden, cfg.pred_hidden)
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.label_dropout = cfg.label_dropout
        # where each offset's table starts (the newest label: table 0); a buffer, so it moves with the model and no
        # decoding step makes a tensor
        offsets = torch.arange(self.context - 1, -1, -1, device=self.embed.weight.device) * (vocab_size + 1)
        self.register_buffer("offsets", offsets, persistent=False)

    def _features(self, context: torch.Tensor) -> torch.Tensor:
        """context (..., k) labels, oldest first -> (..., H)."""
        x = self.embed(context + self.offsets)  # (..., k, H)
        return torch.relu(self.proj(self.dropout(x).flatten(-2)))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, U) -> outputs (B, U+1, H): position u reads ``tokens[:, u-k:u]`` (blank before the start)."""
        tokens = _drop_labels(tokens, self.label_dropout, self.blank, self.training)
        padded = F.pad(tokens, (self.context, 0), value=self.blank)  # (B, U+k)
        context = padded.unfold(1, self.context, 1)  # (B, U+1, k)
        return self.dropout(self._features(context))

    def step(
        self, tokens: torch.Tensor, state: tuple[torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor]]:
        """One label per utterance: tokens (B,), state ((1, B, k-1),) or None -> (B, H), new state."""
        if state is None:
            state = (torch.full((1, tokens.shape[0], self.context - 1), self.blank, dtype=tokens.dtype,
                                device=tokens.device),)  # fmt: skip
        context = torch.cat([state[0][0], tokens[:, None]], dim=1)  # (B, k)
        return self._features(context), (context[None, :, 1:],)


def prediction_network(vocab_size: int, blank: int, cfg: PredictionConfig) -> torch.nn.Module:
    """The LSTM prediction network, or the stateless one when ``cfg.context_size`` >= 1."""
    if cfg.context_size < 0:
        raise ValueError(f"model.prediction.context_size must be >= 0 (0: LSTM), got {cfg.context_size}.")
    if not 0.0 <= cfg.label_dropout < 1.0:
        raise ValueError(f"model.prediction.label_dropout must be in [0, 1), got {cfg.label_dropout}.")
    if cfg.context_size:
        return StatelessPredictionNetwork(vocab_size, blank, cfg)
    return PredictionNetwork(vocab_size, blank, cfg)


class JointNetwork(torch.nn.Module):
    """``activation(enc_proj(f) + pred_proj(g))`` -> dropout -> vocabulary + blank (+ durations) logits."""

    def __init__(self, enc_width: int, pred_width: int, outputs: int, cfg: JointConfig) -> None:
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(
                f"model.joint.activation must be one of {', '.join(ACTIVATIONS)}, got {cfg.activation!r}."
            )
        self.enc_proj = torch.nn.Linear(enc_width, cfg.joint_hidden)
        self.pred_proj = torch.nn.Linear(pred_width, cfg.joint_hidden)
        self.activation = ACTIVATIONS[cfg.activation]
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.out = torch.nn.Linear(cfg.joint_hidden, outputs)

    def forward(self, enc: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """Projected enc (..., J) and pred (..., J), broadcastable -> logits (..., outputs)."""
        return self.out(self.dropout(self.activation(enc + pred)))


class ConformerTransducerModel(ConformerCTCModel):
    """Conformer / FastConformer encoder with an RNN-T or TDT decoder (and, hybrid, a CTC head)."""

    Config = ConformerTransducerConfig
    MUON_ADAMW_MODULES = (*ConformerCTCModel.MUON_ADAMW_MODULES, "joint.out")  # and the joint's output layer

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        cfg = self.cfg
        if cfg.interctc.apply_at_layers and not cfg.hybrid:
            raise ConfigError(f"model.interctc.apply_at_layers={list(cfg.interctc.apply_at_layers)}: intermediate CTC "
                              "reads the CTC head of a hybrid model; set model.hybrid=true, or turn it off: "
                              f"{' '.join(INTERCTC_OFF)}.")  # fmt: skip
        if cfg.loss not in LOSSES:
            raise ValueError(f"model.loss must be one of {', '.join(LOSSES)}, got {cfg.loss!r}.")
        durations = list(cfg.durations)
        if cfg.loss == "tdt" and (durations != sorted(set(durations)) or 1 not in durations or durations[0] < 0):
            raise ValueError(f"model.durations must be sorted distinct frame counts >= 0 that include 1, got "
                             f"{durations}.")  # fmt: skip
        if cfg.decoder_type not in DECODERS or (cfg.decoder_type == "ctc" and not cfg.hybrid):
            raise ValueError(f"model.decoder_type must be 'transducer' (or 'ctc' for hybrid models), got "
                             f"{cfg.decoder_type!r}.")  # fmt: skip
        if not isinstance(cfg.joint.frame_stack, int) or cfg.joint.frame_stack < 1:
            raise ValueError(f"model.joint.frame_stack must be an integer >= 1, got {cfg.joint.frame_stack!r}.")
        self.durations = durations if cfg.loss == "tdt" else [0, 1]
        self._transducer_beam: TransducerBeamSearch | None = None
        self.decode_steps = torch.zeros(2, dtype=torch.float64)  # (frames, decoder steps) of transducer decoding
        self._infeasible: torch.Tensor | None = None

    # ---------------------------------------------------------------------------------------------- layers
    def build_layers(self) -> None:
        super().build_layers()  # preprocessor, SpecAugment, encoder and a CTC head (``decoder``)
        cfg = self.cfg
        vocab = self.tokenizer.vocab_size
        width = self.decoder.in_features
        if not cfg.hybrid:
            del self.decoder
            self.decoder = None
        extra = len(self.durations) if cfg.loss == "tdt" else 0
        with seeded(self._init_seed + 200_000):
            self.prediction = prediction_network(vocab, self.blank, OmegaConf.to_object(cfg.prediction))
            self.joint = JointNetwork(width * cfg.joint.frame_stack, cfg.prediction.pred_hidden, vocab + 1 + extra,
                                      OmegaConf.to_object(cfg.joint))  # fmt: skip

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The encoder output itself: ``forward`` gives (B, F', D) frames and lengths for the joint (and, in a hybrid
        model, :meth:`ctc_log_probs`); with ``interctc``, ``forward_step`` adds the taps' CTC log-probabilities."""
        return x

    def every_parameter_gets_a_gradient(self) -> bool:
        """Every parameter but a hybrid's CTC head when its loss weight is 0."""
        return not self.cfg.hybrid or self.cfg.ctc_loss_weight > 0

    def joint_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """(B,) transducer frames of utterances of ``lengths`` encoder frames (see :meth:`joint_frames`)."""
        k = self.cfg.joint.frame_stack
        return lengths if k == 1 else (lengths + k - 1) // k

    def joint_frames(self, enc: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The transducer's input: enc (B, F', D) -> (B, ceil(F' / k), k * D), each frame ``k = joint.frame_stack``
        consecutive encoder frames side by side, and its lengths. Frames past each length are zeroed first, so a
        batched utterance gives what it gives alone."""
        k = self.cfg.joint.frame_stack
        if k == 1:
            return enc, lengths
        batch, frames, width = enc.shape
        valid = torch.arange(frames, device=enc.device)[None, :] < lengths[:, None]
        enc = F.pad(enc * valid[..., None].to(enc.dtype), (0, 0, 0, (-frames) % k))
        return enc.reshape(batch, -1, k * width), self.joint_lengths(lengths)

    def ctc_log_probs(self, enc: torch.Tensor) -> torch.Tensor:
        """(B, F', V+1) fp32 log-probabilities of the hybrid model's CTC head."""
        return self.log_probs(enc)

    # -------------------------------------------------------------------------------------------------- loss
    def _joint_terms(
        self, enc_proj: torch.Tensor, pred_proj: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One sub-batch: enc_proj (b, T, J), pred_proj (b, U+1, J), targets (b, U) -> log P(blank) (b, T, U+1),
        log P(next label) (b, T, U+1), log P(duration) (b, T, U+1, D) (empty D for RNN-T), fp32."""
        logits = self.joint(enc_proj[:, :, None], pred_proj[:, None]).float()  # (b, T, U+1, V+1+D)
        vocab1 = self.tokenizer.vocab_size + 1
        token_lp = logits[..., :vocab1].log_softmax(-1)
        next_label = torch.cat([targets, targets[:, :1]], dim=1)  # (b, U+1); row U is never used by the loss
        index = next_label[:, None, :, None].expand(-1, token_lp.shape[1], -1, 1)
        label_lp = torch.gather(token_lp, 3, index)[..., 0]
        return token_lp[..., -1], label_lp, logits[..., vocab1:].log_softmax(-1)

    def transducer_losses(self, enc: torch.Tensor, lengths: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """(B,) fp32 transducer losses; utterances with no possible alignment give 0 (and are counted, see
        :meth:`loss_step`). The joint runs ``joint.fused_batch_size`` utterances at a time."""
        tokens, token_lens = batch["tokens"], batch["token_lens"]
        ok = self.alignable(lengths, token_lens)
        enc, lengths = self.joint_frames(enc, lengths)
        # An impossible utterance is computed as an empty transcript over >= 1 frame (finite), then zeroed.
        frame_lens, label_lens = lengths.clamp(min=1), torch.where(ok, token_lens, 0)
        enc_proj = self.joint.enc_proj(enc)
        pred_proj = self.joint.pred_proj(self.prediction(tokens))
        step = self.cfg.joint.fused_batch_size or enc.shape[0]
        terms: list[list[torch.Tensor]] = [[], [], []]
        for start in range(0, enc.shape[0], step):
            rows = slice(start, start + step)
            args = (enc_proj[rows], pred_proj[rows], tokens[rows])
            if torch.is_grad_enabled() and self.cfg.joint.fused_batch_size:
                chunk = checkpoint(self._joint_terms, *args, use_reentrant=False)
            else:
                chunk = self._joint_terms(*args)
            for kept, value in zip(terms, chunk):
                kept.append(value)
        blank, label, dur = (torch.cat(kept) for kept in terms)
        losses = self._loss_from_terms(blank, label, dur, frame_lens, label_lens)
        return torch.where(ok, losses, 0.0)

    def alignable(self, lengths: torch.Tensor, token_lens: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the transcript can be aligned with the frames (by the transducer, and for a hybrid model by
        CTC too, which needs a frame per label); the others are skipped."""
        ok = feasible(self.joint_lengths(lengths), token_lens, self.durations)
        return ok & (lengths >= token_lens) if self.cfg.hybrid else ok

    def _loss_from_terms(self, blank: torch.Tensor, label: torch.Tensor, dur: torch.Tensor, frame_lens: torch.Tensor,
                         label_lens: torch.Tensor) -> torch.Tensor:  # fmt: skip
        cfg = self.cfg
        if cfg.loss == "rnnt":
            return rnnt_loss(blank, label, frame_lens, label_lens)
        # TDT with sigma, and omega x RNN-T: one recursion over both lattices (transducer_loss.tdt_loss)
        return tdt_loss(blank, label, dur, self.durations, frame_lens, label_lens, sigma=cfg.sigma, omega=cfg.omega)

    def utterance_losses(self, enc: torch.Tensor, lengths: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
        """(B,) losses of the whole model: transducer, or the hybrid's weighted sum with CTC."""
        losses = self.transducer_losses(enc, lengths, batch)
        if self.cfg.hybrid:
            w = self.cfg.ctc_loss_weight
            ctc = self.ctc_losses(self.ctc_log_probs(enc), lengths, batch)
            losses = torch.where(self.alignable(lengths, batch["token_lens"]), (1 - w) * losses + w * ctc, 0.0)
        return losses

    def loss_step(
        self, batch: dict[str, Any], output: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss sum, count) as in CTC; utterances whose transcript cannot be aligned with their frames add 0 to
        both, and are counted on the device (reported at the end of each epoch, no per-step host read). With
        intermediate CTC (``output`` from :meth:`forward_step` in training), NeMo's hybrid weighting: ``(1 - sum w) x
        the hybrid loss + sum w_i x CTC(layer i)``."""
        enc, lengths = output[:2]
        losses = self.utterance_losses(enc, lengths, batch)
        ok = self.alignable(lengths, batch["token_lens"])
        if len(output) == 3:  # NeMo's hybrid weighting: (1 - sum w) * (transducer-CTC mix) + sum w_i * CTC(layer i)
            weights = self.cfg.interctc.loss_weights
            losses = (1.0 - sum(weights)) * losses
            for weight, layer_log_probs in zip(weights, output[2], strict=True):
                losses = losses + weight * self.ctc_losses(layer_log_probs, lengths, batch)
            losses = torch.where(ok, losses, 0.0)
        bad = (~ok).sum()
        self._infeasible = bad if self._infeasible is None else self._infeasible + bad
        if self.cfg.ctc_reduction == "mean_batch":
            return losses.sum(), ok.sum()
        return losses.sum(), torch.where(ok, batch["token_lens"], 0).sum()

    def on_train_epoch_end(self) -> None:
        if self._infeasible is not None:
            count = int(self._infeasible)
            self._infeasible = None
            if count:
                self._skips.add("transcript_longer_than_frames", "(checked by the model)", count)
        super().on_train_epoch_end()

    # ---------------------------------------------------------------------------------------------- decoding
    def greedy_hypotheses(self, enc: torch.Tensor, lengths: torch.Tensor) -> list[dict[str, list[int]]]:
        """Batched greedy (label-looping) decoding: per utterance ``ids``, ``starts`` and ``ends`` (frames)."""
        durations = self.durations if self.cfg.loss == "tdt" else None
        enc, lengths = self.joint_frames(enc, lengths)
        hyps, steps = greedy_batch(
            self.prediction, self.joint, enc, lengths, self.blank, durations, self.cfg.decoding.max_symbols
        )
        self.decode_steps += torch.tensor([float(lengths.sum()), float(steps.sum())], dtype=torch.float64)
        return hyps

    def greedy_decode(self, enc: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        if self.cfg.decoder_type == "ctc":
            return super().greedy_decode(self.ctc_log_probs(enc), lengths)
        return [self.tokenizer.decode(h["ids"]) for h in self.greedy_hypotheses(enc, lengths)]

    def decode(self, enc: torch.Tensor, lengths: torch.Tensor, strategy: str | None = None) -> list[str]:
        strategy = strategy or self.cfg.decoding.strategy
        if strategy == "greedy":
            return self.greedy_decode(enc, lengths)
        if self.cfg.decoder_type == "ctc":
            return super().decode(self.ctc_log_probs(enc), lengths, strategy)
        if self._transducer_beam is None:
            decoding = self.cfg.decoding
            self._transducer_beam = TransducerBeamSearch(
                self.prediction, self.joint, self.tokenizer, self.blank,
                self.durations if self.cfg.loss == "tdt" else None, OmegaConf.to_object(decoding),
            )  # fmt: skip
        return [self.tokenizer.decode(ids) for ids in self._transducer_beam(*self.joint_frames(enc, lengths))]

    @torch.inference_mode()
    def transcribe_with_timestamps(self, audio: list[Any], batch_size: int = 16) -> list[dict[str, Any]]:
        """Greedy transcripts with word timestamps (audio as for :meth:`transcribe`): per input
        ``{"text", "words": [{"word", "start", "end"}]}``, times in seconds from the start of the audio."""
        self._built()
        was_training = self.training
        self.eval()
        frame_seconds = self.cfg.preprocessor.window_stride * self.cfg.encoder.subsampling_factor
        frame_seconds *= self.cfg.joint.frame_stack
        results = []
        try:
            for padded, lens in self._audio_batches(audio, batch_size):
                enc, lengths = self(padded, lens)
                results += [{"text": self.tokenizer.decode(h["ids"]),
                             "words": word_timestamps(self.tokenizer, h["ids"], h["starts"], h["ends"], frame_seconds)}
                            for h in self.greedy_hypotheses(enc, lengths)]  # fmt: skip
        finally:
            self.train(was_training)
        return results

    # --------------------------------------------------------------------------------------------- telemetry
    def flops_per_batch(self, batch: dict[str, Any]) -> torch.Tensor:
        """Training FLOPs of one step: encoder (as CTC), CTC head (hybrid), prediction network (LSTM over U+1
        positions) and joint (projections, and the output layer over every (frame, position) cell), forward x 3.
        Without ``token_lens`` in ``batch``, transcripts are taken as 1 token per 4 encoder frames."""
        self._built()
        cfg = self.cfg
        enc_cfg = OmegaConf.to_object(cfg.encoder)
        frames = self.preprocessor.frame_lengths(batch["audio_lens"])
        out_frames = subsampled_lengths(frames, enc_cfg.subsampling_factor)
        labels = batch.get("token_lens")
        labels = (out_frames // 4) if labels is None else labels.to(out_frames.device)
        forward = conformer_forward_flops(enc_cfg, cfg.preprocessor.n_mels, frames)
        vocab1, d = self.tokenizer.vocab_size + 1, enc_cfg.d_model
        if cfg.hybrid:
            forward = forward + 2 * out_frames.sum() * d * vocab1
        h, layers, k = cfg.prediction.pred_hidden, cfg.prediction.pred_rnn_layers, cfg.prediction.context_size
        if k:
            forward = forward + 2 * (labels + 1).sum() * k * h * h  # the stateless network's projection
        else:
            forward = forward + 2 * (labels + 1).sum() * layers * 4 * (2 * h * h)  # LSTM gates: input + recurrent
        j = cfg.joint.joint_hidden
        outputs = self.joint.out.out_features
        joint_frames = self.joint_lengths(out_frames)
        cells = (joint_frames * (labels + 1)).sum()
        forward = forward + 2 * joint_frames.sum() * self.joint.enc_proj.in_features * j
        forward = forward + 2 * (labels + 1).sum() * h * j + 2 * cells * j * outputs
        return 3 * forward

    def decoding_frames_per_step(self) -> float:
        """Mean transducer frames advanced per decoder step over the greedy decodes so far (RNN-T: < 1; TDT: more when
        it skips frames)."""
        frames, steps = self.decode_steps.tolist()
        return frames / max(steps, 1.0)
