"""Transducer decoding: batched greedy (label looping) for RNN-T and TDT, a beam search with an optional word n-gram
LM, and word timestamps from the alignment.

Greedy: every utterance of the batch keeps a frame pointer ``t``, its last label and its prediction-network state;
each step evaluates the joint once for the whole batch at each utterance's own frame, then

- a label is appended and the prediction network advances for the utterances that emitted one (a masked update of
  the batched state, so all utterances stay in one tensor);
- ``t`` moves on by the predicted duration (TDT), by one frame after a blank (RNN-T), or by one frame after
  ``max_symbols`` labels on the same frame.

The loop ends when every utterance has passed its last frame: its length is the longest utterance's number of
steps, never one loop per utterance. TDT steps over frames (its durations), so it takes fewer steps than RNN-T.
"""

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from speechtrain.asr.ngram import BOS, EOS, NgramLM


def _select_state(mask: torch.Tensor, new: tuple[torch.Tensor, ...], old: tuple[torch.Tensor, ...]):
    """The LSTM state (h, c), each (L, B, H), taken from ``new`` where ``mask`` (B,) is set."""
    return tuple(torch.where(mask[None, :, None], n, o) for n, o in zip(new, old))


@torch.no_grad()
def greedy_batch(
    prediction: Any,
    joint: Any,
    enc: torch.Tensor,
    lengths: torch.Tensor,
    blank: int,
    durations: list[int] | None,
    max_symbols: int = 10,
) -> tuple[list[dict[str, list[int]]], torch.Tensor]:
    """Greedy decoding of a batch.

    Args:
        prediction: the prediction network (``step(tokens (B,), state) -> (B, H), state``).
        joint: the joint network (``enc_proj``, ``pred_proj``, ``forward``).
        enc: (B, T, D) encoder output.
        lengths: (B,) valid frames.
        blank: the blank id (the last output).
        durations: TDT's durations (the joint's last D outputs), or None for RNN-T.
        max_symbols: most labels emitted on one frame.

    Returns:
        Per utterance ``{"ids", "starts", "ends"}`` (labels, and the frames each starts and ends on), and (B,)
        decoder steps (joint evaluations) taken per utterance.
    """
    batch, frames, _ = enc.shape
    device = enc.device
    enc_proj = joint.enc_proj(enc)  # (B, T, J)
    rows = torch.arange(batch, device=device)
    t = torch.zeros(batch, dtype=torch.long, device=device)
    on_frame = torch.zeros(batch, dtype=torch.long, device=device)  # labels emitted on the current frame
    steps = torch.zeros(batch, dtype=torch.long, device=device)
    duration_values = torch.tensor(durations or [0, 1], device=device)
    pred_out, state = prediction.step(torch.full((batch,), blank, dtype=torch.long, device=device), None)
    pred_proj = joint.pred_proj(pred_out)
    records = []
    active = t < lengths
    while bool(active.any()):
        logits = joint(enc_proj[rows, t.clamp(max=frames - 1)], pred_proj)  # (B, V+1[+D])
        token = logits[:, : blank + 1].argmax(-1)
        is_label = (token != blank) & active
        if durations is not None:
            advance = duration_values[logits[:, blank + 1 :].argmax(-1)]
            advance = torch.where(token == blank, advance.clamp(min=1), advance)
        else:
            advance = (token == blank).long()
        on_frame = torch.where(is_label, on_frame + 1, on_frame)
        advance = torch.where(is_label & (advance == 0) & (on_frame >= max_symbols), 1, advance)
        records.append(torch.stack([is_label.long(), token, t, t + advance.clamp(min=1)]))
        steps += active.long()
        t = torch.where(active, t + advance, t)
        on_frame = torch.where(advance > 0, 0, on_frame)
        new_out, new_state = prediction.step(torch.where(is_label, token, blank), state)
        state = _select_state(is_label, new_state, state)
        pred_proj = torch.where(is_label[:, None], joint.pred_proj(new_out), pred_proj)
        active = t < lengths
    hyps: list[dict[str, list[int]]] = [{"ids": [], "starts": [], "ends": []} for _ in range(batch)]
    if records:
        table = torch.stack(records).cpu()  # (steps, 4, B): one host transfer for the whole decode
        for b in range(batch):
            emitted = table[:, 0, b].bool()
            hyps[b] = {"ids": table[emitted, 1, b].tolist(), "starts": table[emitted, 2, b].tolist(),
                       "ends": table[emitted, 3, b].tolist()}  # fmt: skip
    return hyps, steps.cpu()


def word_timestamps(
    tokenizer: Any, ids: list[int], starts: list[int], ends: list[int], frame_seconds: float
) -> list[dict[str, Any]]:
    """Words with start and end times (seconds) from the tokens' frames: a word starts at its first token's frame
    and ends where its last token ends. Sentencepiece pieces that begin with ``▁`` start words; for a character
    tokenizer, spaces separate them."""
    pieces = tokenizer.vocab
    words: list[dict[str, Any]] = []
    current: list[int] = []
    first = last = 0

    def close() -> None:
        text = tokenizer.decode(current).strip()
        if text:
            words.append(
                {"word": text, "start": round(first * frame_seconds, 3), "end": round(last * frame_seconds, 3)}
            )

    for token, start, end in zip(ids, starts, ends):
        piece = pieces[token]
        if piece.startswith("▁") or piece == " ":
            if current:
                close()
            current, first = [], start
        if piece == " ":
            continue
        if not current:
            first = start
        current.append(token)
        last = end
    if current:
        close()
    return words


@dataclass
class _Hyp:
    score: float
    ids: tuple[int, ...]
    t: int
    on_frame: int
    pred_proj: torch.Tensor
    state: tuple[torch.Tensor, torch.Tensor]
    words: tuple[str, ...] = ()
    partial: list[int] = field(default_factory=list)


class TransducerBeamSearch:
    """Beam search for RNN-T and TDT, one utterance at a time, with optional shallow fusion of a word n-gram LM.

    Hypotheses live at their own frames. Each round expands the hypotheses on the earliest frame: the blank with
    each duration (RNN-T: one frame), and the ``beam_size`` best labels with each duration (RNN-T: none); the
    expansions and the waiting hypotheses are merged (same labels on the same frame: the best is kept) and the
    ``beam_size`` best stay. With an LM, each word is scored when the next one starts (and the last with ``</s>``
    at the end): ``lm_weight * ln p(word | history) + word_score``.

    Args:
        prediction, joint: the model's networks.
        tokenizer: its tokenizer (to find word starts and spell words).
        blank: the blank id.
        durations: TDT's durations, or None for RNN-T.
        cfg: a :class:`~speechtrain.asr.transducer.TransducerDecodingConfig` (``beam_size``, ``lm_path``,
            ``lm_weight``, ``word_score``, ``max_symbols``).
    """

    def __init__(self, prediction: Any, joint: Any, tokenizer: Any, blank: int, durations: list[int] | None,
                 cfg: Any) -> None:  # fmt: skip
        self.prediction, self.joint, self.tokenizer, self.blank = prediction, joint, tokenizer, blank
        self.durations = durations
        self.cfg = cfg
        self.lm = NgramLM.read_arpa(cfg.lm_path) if cfg.lm_path else None
        pieces = tokenizer.vocab
        self._word_start = [p.startswith("▁") or p == " " for p in pieces]

    @functools.lru_cache(maxsize=100_000)  # noqa: B019 (one decoder per model; the cache is its LM's)
    def _lm(self, word: str, history: tuple[str, ...]) -> float:
        return self.cfg.lm_weight * self.lm.log10_prob(word, history) * math.log(10) + self.cfg.word_score

    def _close_word(self, hyp: _Hyp) -> tuple[tuple[str, ...], float]:
        word = self.tokenizer.decode(hyp.partial).strip()
        if not word or self.lm is None:
            return hyp.words, 0.0
        history = (BOS, *hyp.words)
        return (*hyp.words, word), self._lm(word, history[-(self.lm.order - 1) :] if self.lm.order > 1 else ())

    @torch.no_grad()
    def __call__(self, enc: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        """Best label sequence of each utterance: enc (B, T, D), lengths (B,)."""
        return [self._search(self.joint.enc_proj(enc[b, : int(lengths[b])])) for b in range(enc.shape[0])]

    def _search(self, enc_proj: torch.Tensor) -> list[int]:
        frames, beam, blank = enc_proj.shape[0], self.cfg.beam_size, self.blank
        durations = self.durations or [0, 1]
        device = enc_proj.device
        out, state = self.prediction.step(torch.tensor([blank], device=device), None)
        hyps = [_Hyp(0.0, (), 0, 0, self.joint.pred_proj(out)[0], state)]
        done: list[_Hyp] = []
        while hyps:
            t = min(h.t for h in hyps)
            now = [h for h in hyps if h.t == t]
            waiting = [h for h in hyps if h.t != t]
            logits = self.joint(enc_proj[t][None], torch.stack([h.pred_proj for h in now]))  # (H, V+1[+D])
            token_lp = logits[:, : blank + 1].log_softmax(-1).cpu()
            dur_lp = logits[:, blank + 1 :].log_softmax(-1).cpu() if self.durations else None
            candidates = []
            for i, h in enumerate(now):
                for k, d in enumerate(durations):
                    d_lp = float(dur_lp[i, k]) if dur_lp is not None else 0.0
                    if d >= 1 and (self.durations or d == 1):
                        candidates.append((h.score + float(token_lp[i, blank]) + d_lp, h, None, d))
                    if self.durations is None and d != 0:
                        continue
                    if d == 0 and h.on_frame >= self.cfg.max_symbols:
                        continue
                    values, labels = token_lp[i, :blank].topk(min(beam, blank))
                    for value, label in zip(values.tolist(), labels.tolist()):
                        candidates.append((h.score + value + d_lp, h, label, d))
            candidates.sort(key=lambda c: -c[0])
            expanded = self._expand(candidates[: beam * 2], device)
            merged: dict[tuple, _Hyp] = {}
            for h in expanded + waiting:
                key = (h.ids, h.t)
                if key not in merged or merged[key].score < h.score:
                    merged[key] = h
            ranked = sorted(merged.values(), key=lambda h: -h.score)[:beam]
            done += [h for h in ranked if h.t >= frames]
            hyps = [h for h in ranked if h.t < frames]
            if len(done) >= beam and hyps and max(h.score for h in hyps) < max(h.score for h in done):
                break
        finals = []
        for h in done:
            words, score = self._close_word(h)
            if self.lm is not None:
                history = (BOS, *words)
                score += self._lm(EOS, history[-(self.lm.order - 1) :] if self.lm.order > 1 else ())
            finals.append((h.score + score, h.ids))
        return list(max(finals)[1]) if finals else []

    def _expand(self, candidates: list[tuple], device: torch.device) -> list[_Hyp]:
        """New hypotheses from (score, parent, label or None, duration); labels advance the prediction network in
        one batched step, and the LM scores the word a label closes."""
        out: list[_Hyp] = []
        labelled = [c for c in candidates if c[2] is not None]
        if labelled:
            tokens = torch.tensor([c[2] for c in labelled], device=device)
            states = tuple(torch.cat([c[1].state[j] for c in labelled], dim=1) for j in range(2))
            new_out, new_state = self.prediction.step(tokens, states)
            new_proj = self.joint.pred_proj(new_out)
        index = 0
        for score, h, label, d in candidates:
            t = h.t + d
            if label is None:
                out.append(_Hyp(score, h.ids, t, 0, h.pred_proj, h.state, h.words, h.partial))
                continue
            words, partial = h.words, [*h.partial, label]
            if self._word_start[label] and h.partial:
                words, lm_score = self._close_word(h)
                partial = [label]
                score += lm_score
            state = tuple(s[:, index : index + 1] for s in new_state)
            out.append(_Hyp(score, (*h.ids, label), t, h.on_frame + 1 if d == 0 else 0, new_proj[index], state,
                            words, partial))  # fmt: skip
            index += 1
        return out
