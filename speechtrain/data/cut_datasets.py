"""Datasets that turn a sampled batch of lhotse cuts into padded tensors, for ASR, TTS and speech-LLM (SALM) models.

Every dataset reads audio through :class:`~speechtrain.data.audio_text.UtteranceReader` (files directly, Shar and
in-memory cuts through lhotse; resampled to ``sample_rate``), applies the training augmentations of its loader
config, and never fails on a bad utterance: it is dropped from the batch and reported in ``batch["skipped"]``
(reason -> count) and ``batch["skip_examples"]`` (reason -> first path), so that the training process can add up
what its loader workers skipped (:class:`~speechtrain.data.audio_text.SkipTally`); so are the placeholders that
the readers of lazy manifests and NeMo tarred shards put in place of entries they could not use (a bad manifest
line, a missing, oversized or corrupt tar member), and utterances read only in part (``longer_than_manifest``).
A batch whose utterances were all bad has ``ids == []`` (see :func:`speechtrain.common.batch.is_empty_batch`).

The datasets are given the sampler's :class:`~speechtrain.data.lhotse_loader.CutBatch` (cuts and epoch): the epoch
seeds the augmentations, so a resumed run sees the same augmented audio as the uninterrupted one.
"""

from collections import Counter
from typing import Any

import numpy as np
import torch

from speechtrain.data.audio_text import TextEncoder, UtteranceReader, unusable_reason
from speechtrain.data.augment import AugmentationConfig, Augmenter
from speechtrain.data.lhotse_loader import CutBatch, LoaderConfig


def pad_1d(tensors: list[torch.Tensor], pad_value: float = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad 1-D tensors of lengths L_i into (B, max L_i); also returns the lengths (B,) as int64."""
    lengths = torch.tensor([t.shape[0] for t in tensors], dtype=torch.long)
    out = torch.full((len(tensors), int(lengths.max())), pad_value, dtype=tensors[0].dtype)
    for row, tensor in enumerate(tensors):
        out[row, : tensor.shape[0]] = tensor
    return out, lengths


class CutDataset(torch.utils.data.Dataset):
    """Base class: reads, checks and augments each cut of a batch, then :meth:`collate` s the good ones.

    Args:
        tokenizer: Encodes transcripts (``ValueError`` on text it cannot encode).
        sample_rate: Rate the audio is delivered at (other rates are resampled, unless ``resample`` is False).
        resample: False skips audio stored at another rate instead (``wrong_sample_rate``).
        augmentation: Waveform augmentations for training (see :mod:`speechtrain.data.augment`).
        seed: Seeds the augmentations (with the epoch and the cut ID).
        duration_tolerance: Seconds by which audio read whole may exceed its manifest duration (longer audio is
            read up to that duration and counted as ``longer_than_manifest``).
    """

    load_audio = True

    def __init__(
        self,
        tokenizer: TextEncoder,
        sample_rate: int = 16000,
        *,
        resample: bool = True,
        augmentation: AugmentationConfig | None = None,
        seed: int = 0,
        duration_tolerance: float = 1.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.reader = UtteranceReader(tokenizer, sample_rate, resample=resample, duration_tolerance=duration_tolerance)
        enabled = augmentation is not None and augmentation.enabled()
        self.augmenter = Augmenter(augmentation, sample_rate, seed) if enabled else None

    @classmethod
    def from_config(cls, tokenizer: TextEncoder, cfg: LoaderConfig, **kwargs: Any) -> "CutDataset":
        """The dataset for a loader config: its ``sample_rate``, ``resample``, ``augmentation``, ``seed`` and
        ``duration_tolerance``."""
        return cls(tokenizer, cfg.sample_rate, resample=cfg.resample, augmentation=cfg.augmentation, seed=cfg.seed,
                   duration_tolerance=cfg.duration_tolerance, **kwargs)  # fmt: skip

    def read(self, cut: Any, epoch: int) -> dict[str, Any] | None:
        """One checked (and augmented) utterance, or None if it is bad."""
        item = self.reader.read_cut(cut, load_audio=self.load_audio)
        if item is not None and self.augmenter is not None and "audio" in item:
            item["audio"] = self.augmenter(item["audio"], epoch, cut.id)
        return item

    def collate(self, items: list[dict[str, Any]], cuts: list[Any]) -> dict[str, Any]:
        """The batch of the good ``items`` (non-empty), in the order of their ``cuts``."""
        raise NotImplementedError

    def __getitem__(self, batch: Any) -> dict[str, Any]:
        cuts, epoch = (batch.cuts, batch.epoch) if isinstance(batch, CutBatch) else (batch, 0)
        self.reader.events.clear()
        items, kept = [], []
        for cut in cuts:
            unusable = unusable_reason(cut)
            if unusable is not None:  # a placeholder for a bad manifest line or tar member
                self.reader.skip(*unusable, "the reader could not use this entry")
                continue
            item = self.read(cut, epoch)
            if item is not None:
                items.append(item)
                kept.append(cut)
        skipped: Counter[str] = Counter(reason for reason, _ in self.reader.events)
        examples: dict[str, str] = {}
        for reason, path in self.reader.events:
            examples.setdefault(reason, path)
        out = self.collate(items, kept) if items else {"ids": []}
        if isinstance(out.get("audio_lens"), torch.Tensor):  # host-side: the step reads these without waiting
            out["audio_seconds"] = float(out["audio_lens"].sum()) / self.reader.sample_rate
            out.setdefault("audio_samples", out["audio_lens"].tolist())
        out["skipped"] = dict(skipped)
        out["skip_examples"] = examples
        return out


class AsrCutDataset(CutDataset):
    """ASR batches: ``ids`` (B str), ``audio`` (B, T) zero-padded float32, ``audio_lens`` (B,), ``tokens`` (B, U)
    padded with 0, ``token_lens`` (B,), and the lengths as lists of ints (``audio_samples``, ``token_counts``)."""

    def collate(self, items: list[dict[str, Any]], cuts: list[Any]) -> dict[str, Any]:
        audio, audio_lens = pad_1d([item["audio"] for item in items])
        tokens, token_lens = pad_1d([item["tokens"] for item in items])
        # The token counts also as Python ints (``audio_samples`` too, added by ``__getitem__``): a step that needs
        # them on the host (CTC's lengths) reads them without waiting for the device.
        return {"ids": [item["id"] for item in items], "audio": audio, "audio_lens": audio_lens, "tokens": tokens,
                "token_lens": token_lens, "token_counts": token_lens.tolist()}  # fmt: skip


class TtsCutDataset(CutDataset):
    """TTS batches: text (or phoneme) ids in, audio or codec codes out, with speaker and optional context audio.

    Args:
        tokenizer: Text or phoneme tokenizer for the transcripts.
        speakers: Speaker name -> id. When given, ``speaker_ids`` (B,) is returned and a cut whose speaker is not
            listed is skipped (``unknown_speaker``); the speaker is the supervision's ``speaker`` (a NeMo manifest's
            ``speaker`` key). Without it, ``speakers`` (B names or None) is returned.
        codes_field: Custom field holding the path of a ``.npy`` array of codec codes (Q, T) (precomputed by a
            codec). When set, audio is not loaded and the batch holds ``codes`` (B, Q, T) padded with
            ``codes_pad_id`` and ``code_lens`` (B,) instead of ``audio``/``audio_lens``.
        context_field: Custom field holding the path of a context (reference voice) audio file, returned as
            ``context_audio`` (B, C) and ``context_audio_lens`` (B,); a missing or unreadable context file skips the
            cut (``missing_context``).
        **kwargs: As for :class:`CutDataset`.

    Text fields: ``text_tokens`` (B, U) padded with 0, ``text_lens`` (B,), ``texts`` (B str).
    """

    def __init__(
        self,
        tokenizer: TextEncoder,
        sample_rate: int = 16000,
        *,
        speakers: dict[str, int] | None = None,
        codes_field: str | None = None,
        codes_pad_id: int = 0,
        context_field: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, sample_rate, **kwargs)
        self.speakers = dict(speakers) if speakers is not None else None
        self.codes_field = codes_field
        self.codes_pad_id = codes_pad_id
        self.context_field = context_field
        self.load_audio = codes_field is None
        # Context files are read apart, so that their failures are counted once, as ``missing_context``.
        self._context_reader = UtteranceReader(tokenizer, sample_rate, resample=self.reader.resample)

    def read(self, cut: Any, epoch: int) -> dict[str, Any] | None:
        item = super().read(cut, epoch)
        if item is None:
            return None
        speaker = next((s.speaker for s in cut.supervisions if s.speaker is not None), None)
        if self.speakers is not None:
            if speaker not in self.speakers:
                return self.reader.skip("unknown_speaker", cut.id, f"speaker {speaker!r} is not in the speaker table")
            item["speaker_id"] = self.speakers[speaker]
        item["speaker"] = speaker
        custom = cut.custom or {}
        if self.codes_field is not None:
            path = custom.get(self.codes_field)
            try:
                codes = np.load(path) if path is not None else None
            except (OSError, ValueError) as e:
                return self.reader.skip("missing_codes", str(path), f"{type(e).__name__}: {e}")
            if codes is None or codes.ndim != 2 or codes.shape[1] == 0:
                detail = f"no (Q, T) code array in field {self.codes_field!r}"
                return self.reader.skip("missing_codes", str(path), detail)
            item["codes"] = torch.from_numpy(codes.astype(np.int64))
        if self.context_field is not None:
            path = custom.get(self.context_field)
            context = None
            if path is not None:
                record = {"audio_filepath": str(path), "offset": 0.0, "duration": None, "text": None}
                context = self._context_reader.read(record, load_audio=True)
            if context is None or "audio" not in context:
                return self.reader.skip("missing_context", str(path), "no readable context audio")
            item["context_audio"] = context["audio"]
        return item

    def collate(self, items: list[dict[str, Any]], cuts: list[Any]) -> dict[str, Any]:
        text_tokens, text_lens = pad_1d([item["tokens"] for item in items])
        out: dict[str, Any] = {"ids": [item["id"] for item in items], "texts": [item["text"] for item in items],
                               "text_tokens": text_tokens, "text_lens": text_lens}  # fmt: skip
        if self.codes_field is not None:
            code_lens = torch.tensor([item["codes"].shape[1] for item in items], dtype=torch.long)
            num_codebooks = {item["codes"].shape[0] for item in items}
            if len(num_codebooks) != 1:
                raise ValueError(f"codec code arrays in one batch have different codebook counts: {num_codebooks}")
            codes = torch.full((len(items), num_codebooks.pop(), int(code_lens.max())), self.codes_pad_id)
            for row, item in enumerate(items):
                codes[row, :, : item["codes"].shape[1]] = item["codes"]
            out["codes"], out["code_lens"] = codes, code_lens
        else:
            out["audio"], out["audio_lens"] = pad_1d([item["audio"] for item in items])
        if self.speakers is not None:
            out["speaker_ids"] = torch.tensor([item["speaker_id"] for item in items], dtype=torch.long)
        else:
            out["speakers"] = [item["speaker"] for item in items]
        if self.context_field is not None:
            out["context_audio"], out["context_audio_lens"] = pad_1d([item["context_audio"] for item in items])
        return out


class SalmCutDataset(CutDataset):
    """Speech-LLM batches: audio plus one token stream per utterance, ``[bos] prompt <audio> answer [eos]``.

    The answer is the cut's transcript; the prompt is the cut's ``prompt_field`` custom field, or ``prompt``.
    ``<audio>`` is a single ``audio_locator_id`` token that the model replaces with the encoded audio frames.

    Batch: ``audio`` (B, T), ``audio_lens`` (B,), ``input_ids`` (B, L) padded with ``pad_id``, ``input_lens`` (B,),
    ``loss_mask`` (B, L) bool, True exactly on the answer tokens and ``eos`` (the tokens the model learns to
    predict), ``audio_positions`` (B,) index of ``<audio>`` in each row.
    """

    def __init__(
        self,
        tokenizer: TextEncoder,
        sample_rate: int = 16000,
        *,
        audio_locator_id: int,
        bos_id: int | None,
        eos_id: int,
        pad_id: int = 0,
        prompt: str = "Transcribe the audio.",
        prompt_field: str = "prompt",
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, sample_rate, **kwargs)
        self.audio_locator_id, self.bos_id, self.eos_id, self.pad_id = audio_locator_id, bos_id, eos_id, pad_id
        self.prompt, self.prompt_field = prompt, prompt_field

    def read(self, cut: Any, epoch: int) -> dict[str, Any] | None:
        item = super().read(cut, epoch)
        if item is None:
            return None
        prompt = (cut.custom or {}).get(self.prompt_field, self.prompt)
        try:
            prompt_ids = list(self.tokenizer.encode(prompt)) if prompt else []
        except ValueError as e:
            return self.reader.skip("unencodable_text", cut.id, f"prompt: {e}")
        context = ([self.bos_id] if self.bos_id is not None else []) + prompt_ids
        answer = item["tokens"].tolist() + [self.eos_id]
        item["audio_position"] = len(context)
        item["input_ids"] = torch.tensor([*context, self.audio_locator_id, *answer], dtype=torch.long)
        item["loss_mask"] = torch.tensor([False] * (len(context) + 1) + [True] * len(answer))
        return item

    def collate(self, items: list[dict[str, Any]], cuts: list[Any]) -> dict[str, Any]:
        audio, audio_lens = pad_1d([item["audio"] for item in items])
        input_ids, input_lens = pad_1d([item["input_ids"] for item in items], self.pad_id)
        loss_mask, _ = pad_1d([item["loss_mask"] for item in items], False)
        positions = torch.tensor([item["audio_position"] for item in items], dtype=torch.long)
        return {"ids": [item["id"] for item in items], "audio": audio, "audio_lens": audio_lens,
                "input_ids": input_ids, "input_lens": input_lens, "loss_mask": loss_mask,
                "audio_positions": positions, "input_counts": input_lens.tolist(),
                "audio_rows": list(range(len(items)))}  # fmt: skip
