"""Cache-aware streaming recognition with a limited-context Conformer (NeMo's cache-aware streaming FastConformer).

A streaming model is trained with ``encoder.att_context_size`` (a finite left context; ``chunked_limited`` style, or
``regular`` with no right context), ``conv_context_size: causal`` and ``preprocessor.normalize: none`` (per-utterance
statistics are not known before the utterance ends); ``causal_downsampling: true`` removes the subsampling's
look-ahead. Audio then goes in chunk by chunk, and every stage keeps what the next chunk needs:

- features: the samples of windows not yet complete (and the last one, for NeMo's pre-emphasis);
- subsampling: the feature frames its next output frames read (a window of two output frames' worth before them);
- each Conformer layer: its attention input of the last ``left`` frames (keys and values of the next chunk) and
  its depthwise convolution's input of the last ``kernel - 1`` frames;
- the decoder: CTC's last label (repeats merge across chunks); the transducer's greedy search state (prediction
  network state, frame pointer: a TDT duration may step into the next chunk).

Each step runs one chunk of encoder frames (``chunk``: a multiple of ``right + 1`` for ``chunked_limited``), and
gives the same frames as the offline encoder run with the same context, so the final hypothesis equals the offline
greedy decode, label for label. Partial hypotheses are the labels decoded so far.

Latency (:func:`latency_seconds`): the first frame of a chunk waits for the rest of it, ``(chunk - 1) x
subsampling_factor x window_stride`` seconds (NeMo's look-ahead figure, ``right`` frames for
``chunk = right + 1``), and the front end adds half an analysis window (``n_fft / 2`` samples) and, without causal
subsampling, ``(subsampling_factor - 1) x window_stride``; the greedy decoders add none (a transducer reading
stacked frames, ``joint.frame_stack`` k, waits for the k-th).
"""

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from speechtrain.asr.conformer import ConformerEncoder, context_allowed
from speechtrain.nn.transformer import relative_positions


def check_streamable(model: Any) -> None:
    """Raise ValueError, naming the key, if ``model`` cannot stream (see the module docstring)."""
    encoder = getattr(model, "encoder", None)
    if not isinstance(encoder, ConformerEncoder):
        raise ValueError(f"Streaming needs a Conformer encoder; {type(model).__name__} has {type(encoder).__name__}.")
    problems = []
    if getattr(model.preprocessor, "normalize", None) != "none":
        problems.append("preprocessor.normalize=none (per-utterance normalisation needs the whole utterance)")
    if encoder.reduced:
        problems.append("encoder.time_reduce_idx=-1 (the temporal U-Net does not stream)")
    if encoder.layers and encoder.layers[0].conv.padding[1] != 0:
        problems.append("encoder.conv_context_size=causal (a symmetric convolution reads future frames)")
    left, right = encoder.context
    if left < 0:
        problems.append(f"a finite left context in encoder.att_context_size (it is {list(encoder.context)})")
    if encoder.context_style == "regular" and right != 0:
        problems.append(f"encoder.att_context_style=chunked_limited, or right context 0 (att_context_size "
                        f"{list(encoder.context)}: a regular right context grows with every layer)")  # fmt: skip
    if problems:
        raise ValueError(f"{type(model).__name__} cannot stream; it needs " + "; ".join(problems) + ".")


class FeatureStream:
    """The model's log-mel front-end, fed audio in pieces: the frames of :meth:`push` and :meth:`finish` together
    equal the offline features of the whole audio (not normalised).

    Args:
        preprocessor: :class:`~speechtrain.asr.features.LogMelFeatures` or ``NemoMelFeatures``, eval mode.
    """

    def __init__(self, preprocessor: torch.nn.Module) -> None:
        self.pre = preprocessor
        self.n_fft, self.hop = preprocessor.n_fft, preprocessor.hop
        self.buffer: torch.Tensor | None = None  # (B, N) samples from the next frame's window start on
        self.previous: torch.Tensor | None = None  # (B, 1) the last raw sample (pre-emphasis)
        self.samples = 0
        self.frames = 0

    @torch.no_grad()
    def push(self, audio: torch.Tensor) -> torch.Tensor:
        """(B, N) samples -> (B, n_mels, F) the frames whose windows are now complete (F may be 0)."""
        audio = audio.float()
        if self.buffer is None:  # the offline features centre the first window on sample 0: zeros before it
            self.buffer = audio.new_zeros(audio.shape[0], self.n_fft // 2)
            self.previous = audio.new_zeros(audio.shape[0], 1)
        emphasised = self.pre.emphasis(audio, self.previous)
        if audio.shape[1]:
            self.previous = audio[:, -1:]
        self.samples += audio.shape[1]
        self.buffer = torch.cat([self.buffer, emphasised], dim=1)
        return self._frames(None)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """The last frames (the offline features pad the end with half a window of zeros)."""
        if self.buffer is None:
            raise ValueError("FeatureStream.finish: no audio was pushed.")
        self.buffer = F.pad(self.buffer, (0, self.n_fft // 2))
        total = int(self.pre.frame_lengths(torch.tensor(self.samples)))
        return self._frames(total)

    def _frames(self, total: int | None) -> torch.Tensor:
        count = max(0, (self.buffer.shape[1] - self.n_fft) // self.hop + 1)
        if total is not None:
            count = min(count, total - self.frames)
        if count == 0:
            return self.buffer.new_zeros(self.buffer.shape[0], self._n_mels(), 0)
        feats = self.pre.log_mel_frames(self.buffer[:, : (count - 1) * self.hop + self.n_fft])
        self.buffer = self.buffer[:, count * self.hop :]
        self.frames += count
        return feats

    def _n_mels(self) -> int:
        """Mel bands of the front-end."""
        fb = getattr(self.pre, "fb", None)
        return int(fb.shape[1]) if fb is not None else int(self.pre.mel.mel_scale.n_mels)


class EncoderStream:
    """The Conformer encoder, fed feature frames in pieces, run ``chunk`` encoder frames at a time with caches: the
    frames of :meth:`push` and :meth:`finish` together equal (within float rounding) the offline encoder's output
    with the encoder's current context (:meth:`ConformerEncoder.set_context`).

    Args:
        encoder: a streamable :class:`ConformerEncoder` (:func:`check_streamable`), eval mode.
        chunk: encoder frames per step (None: one attention chunk, ``right + 1``).
        condition: self-conditioning (``forward_with_layers``'s) applied after the layers ``capture``.
        capture: 0-based layers after which ``condition`` is applied.
    """

    def __init__(self, encoder: ConformerEncoder, chunk: int | None = None, condition: Any = None,
                 capture: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.encoder = encoder
        left, right = encoder.context
        size = right + 1 if encoder.context_style == "chunked_limited" else 1
        self.chunk = chunk or size
        if self.chunk < 1 or self.chunk % size:
            raise ValueError(f"chunk={self.chunk}: streaming runs whole attention chunks, a multiple of right + 1 = "
                             f"{size} encoder frames (att_context_size {list(encoder.context)}).")  # fmt: skip
        self.memory = (left // size) * size  # cached frames: all that any query of a chunk may attend to before it
        self.factor = 2 ** len(encoder.subsampling.convs)
        self.ahead = encoder.subsampling.receptive_field()[1]
        self.condition, self.capture = condition, capture
        self.feats: torch.Tensor | None = None  # (B, n_mels, F): feature frames from ``feat_start`` on
        self.feat_start = 0
        self.feat_total = 0
        self.done = 0  # encoder frames given out
        self.caches: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def push(self, feats: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, F) feature frames -> (B, T, D) the encoder frames of the chunks now complete (T may be 0)."""
        self.feats = feats if self.feats is None else torch.cat([self.feats, feats], dim=2)
        self.feat_total += feats.shape[2]
        outputs = []
        while self._ready() - self.done >= self.chunk:
            outputs.append(self._step(self.chunk, final=False))
        return self._joined(outputs)

    @torch.no_grad()
    def finish(self) -> torch.Tensor:
        """The remaining encoder frames, the last chunk possibly shorter (the end of the audio is known)."""
        total = int(self.encoder.output_lengths(torch.tensor(self.feat_total)))
        outputs = []
        while self.done < total:
            outputs.append(self._step(min(self.chunk, total - self.done), final=True))
        return self._joined(outputs)

    def _ready(self) -> int:
        """Encoder frames whose features are all in: frame t reads features up to ``factor * t + ahead``."""
        last = self.feat_total - 1 - self.ahead
        return last // self.factor + 1 if last >= 0 else 0

    def _joined(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        if outputs:
            return torch.cat(outputs, dim=1)
        width = self.encoder.layers[0].out_norm.normalized_shape[0]
        return self.feats.new_zeros(self.feats.shape[0], 0, width)

    def _subsample(self, count: int, final: bool) -> torch.Tensor:
        """Encoder frames ``done .. done + count - 1`` after the subsampling: (B, count, D). It runs on a window
        starting two output frames earlier (on the stride grid), enough for its padding never to reach them."""
        start = self.factor * max(self.done - 2, 0)
        end = self.feat_total if final else self.factor * (self.done + count - 1) + self.ahead + 1
        window = self.feats[:, :, start - self.feat_start : end - self.feat_start]
        lengths = torch.full((window.shape[0],), window.shape[2], device=window.device)
        x, _ = self.encoder.subsampling(window, lengths)
        first = self.done - start // self.factor
        keep_from = self.factor * max(self.done + count - 2, 0)  # the next window's start
        self.feats, self.feat_start = self.feats[:, :, keep_from - self.feat_start :], keep_from
        return x[:, first : first + count]

    def _step(self, count: int, final: bool) -> torch.Tensor:
        encoder = self.encoder
        x = self._subsample(count, final) * encoder.xscale
        batch, _, width = x.shape
        if not self.caches:  # zeros: the offline convolution's padding; the attention masks the cache's start
            kernel = encoder.layers[0].conv.depthwise.kernel_size[0]
            self.caches = [(x.new_zeros(batch, self.memory, width), x.new_zeros(batch, kernel - 1, width))
                           for _ in encoder.layers]  # fmt: skip
        queries = self.done + torch.arange(count, device=x.device)
        keys = self.done - self.memory + torch.arange(self.memory + count, device=x.device)
        allowed = context_allowed(queries, keys, encoder.context, encoder.context_style) & (keys >= 0)[None, :]
        positions = relative_positions(count, width, x.device, past=self.memory)
        for index, layer in enumerate(encoder.layers):
            x, self.caches[index] = layer.stream(x, positions, allowed, self.caches[index])
            if index in self.capture:
                x = x + self.condition(x)
        self.done += count
        return x


class CTCGreedyStream:
    """Greedy CTC over encoder frames as they come: labels merge across chunk boundaries as within them."""

    def __init__(self, model: Any) -> None:
        self.model, self.blank = model, model.blank
        self.previous: int | None = None
        self.ids: list[int] = []

    def push(self, enc: torch.Tensor) -> None:
        """(1, T, D) encoder frames."""
        for label in self.model.log_probs(enc)[0].argmax(-1).tolist():
            if label != self.blank and label != self.previous:
                self.ids.append(label)
            self.previous = label

    def finish(self) -> None:
        """Nothing is held back."""


class TransducerGreedyStream:
    """Greedy RNN-T / TDT decoding over encoder frames as they come (``joint.frame_stack`` k: frames are grouped
    by k as they arrive, the last group zero-padded at the end, as offline)."""

    def __init__(self, model: Any) -> None:
        from speechtrain.asr.transducer_decoding import GreedyLabelLooping

        self.model, self.stack = model, model.cfg.joint.frame_stack
        durations = model.durations if model.cfg.loss == "tdt" else None
        self.search = GreedyLabelLooping(model.prediction, model.joint, 1, model.blank, durations,
                                         model.cfg.decoding.max_symbols, model.device)  # fmt: skip
        self.pending: torch.Tensor | None = None  # encoder frames of an incomplete group
        self.frames = 0

    @property
    def ids(self) -> list[int]:
        """Labels decoded so far."""
        return self.search.hypotheses()[0]["ids"]

    def push(self, enc: torch.Tensor) -> None:
        """(1, T, D) encoder frames."""
        if self.pending is not None:
            enc = torch.cat([self.pending, enc], dim=1)
        whole = enc.shape[1] // self.stack * self.stack
        self.pending = enc[:, whole:]
        self._decode(enc[:, :whole])

    def finish(self) -> None:
        """Decode the last, zero-padded group."""
        if self.pending is not None and self.pending.shape[1]:
            self._decode(F.pad(self.pending, (0, 0, 0, self.stack - self.pending.shape[1])))
        self.pending = None

    def _decode(self, enc: torch.Tensor) -> None:
        if not enc.shape[1]:
            return
        batch, frames, width = enc.shape
        self.search.extend(enc.reshape(batch, frames // self.stack, self.stack * width))
        self.frames += frames // self.stack
        self.search.run(self.frames)
        self.search.forget_decoded_frames()


class StreamingTranscriber:
    """Transcribe one audio stream chunk by chunk with a streamable CTC, transducer or hybrid model (greedy).

    ``push`` audio as it arrives (any number of samples at the model's rate); each call returns the partial
    hypothesis; ``finish`` returns the final one, the offline greedy decode of the whole audio by the same model
    with the same context, label for label.

    Args:
        model: a streamable model (:func:`check_streamable`), moved to its device; it is put in eval mode.
        att_context_size: which of the trained contexts ``[left, right]`` to run (None: the encoder's current one);
            it becomes the model's evaluation context too (:meth:`ConformerEncoder.set_context`).
        chunk: encoder frames per step (None: one attention chunk, ``right + 1``).
        decoder_type: ``ctc`` or ``transducer`` for a hybrid model (None: the model's ``decoder_type``).
    """

    def __init__(self, model: Any, att_context_size: list[int] | None = None, chunk: int | None = None,
                 decoder_type: str | None = None) -> None:  # fmt: skip
        model.eval()
        model._built()
        if att_context_size is not None:
            model.encoder.set_context(att_context_size)
        check_streamable(model)
        self.model = model
        interctc = model.cfg.get("interctc")
        capture = tuple(interctc.apply_at_layers) if interctc is not None and interctc.self_conditioning else ()
        condition = model._condition if capture else None
        self.features = FeatureStream(model.preprocessor)
        self.encoder = EncoderStream(model.encoder, chunk, condition, capture)
        kind = decoder_type or model.cfg.get("decoder_type") or "ctc"
        if not hasattr(model, "prediction"):
            kind = "ctc"
        self.decoder = TransducerGreedyStream(model) if kind == "transducer" else CTCGreedyStream(model)

    @property
    def ids(self) -> list[int]:
        """Labels decoded so far."""
        return self.decoder.ids

    @torch.inference_mode()
    def push(self, audio: np.ndarray | torch.Tensor) -> str:
        """Feed 1-D samples; returns the partial hypothesis."""
        audio = torch.as_tensor(audio, dtype=torch.float32, device=self.model.device).reshape(1, -1)
        self.decoder.push(self.encoder.push(self.features.push(audio)))
        return self.model.tokenizer.decode(self.ids)

    @torch.inference_mode()
    def finish(self) -> str:
        """End of the stream: the final hypothesis."""
        self.decoder.push(self.encoder.push(self.features.finish()))
        self.decoder.push(self.encoder.finish())
        self.decoder.finish()
        return self.model.tokenizer.decode(self.ids)


def latency_seconds(model: Any, chunk: int | None = None) -> float:
    """The algorithmic latency of streaming ``model`` with ``chunk`` encoder frames per step (see the module
    docstring): how long after a chunk's first frame its output can be computed, the front end's look-ahead
    included."""
    encoder, pre = model.encoder, model.preprocessor
    left, right = encoder.context
    size = right + 1 if encoder.context_style == "chunked_limited" else 1
    factor = 2 ** len(encoder.subsampling.convs)
    hop = pre.hop / model.cfg.sample_rate
    ahead = encoder.subsampling.receptive_field()[1]
    return (((chunk or size) - 1) * factor + ahead) * hop + pre.n_fft / 2 / model.cfg.sample_rate
