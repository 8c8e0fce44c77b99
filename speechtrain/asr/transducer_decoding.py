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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from speechtrain.asr.decoding import spell
from speechtrain.asr.ngram import BOS, EOS, UNK, NgramLM


def _select_state(mask: torch.Tensor, new: tuple[torch.Tensor, ...], old: tuple[torch.Tensor, ...]):
    """The prediction network's state (the LSTM's (h, c), each (L, B, H); the stateless network's labels, (1, B, k-1)),
    taken from ``new`` where ``mask`` (B,) is set."""
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
    search = GreedyLabelLooping(prediction, joint, enc.shape[0], blank, durations, max_symbols, enc.device)
    search.extend(enc)
    search.run(lengths)
    return search.hypotheses(), search.steps.cpu()


class GreedyLabelLooping:
    """The state of batched greedy decoding (see the module docstring), fed encoder frames as they come: offline,
    all at once (:func:`greedy_batch`); streaming, chunk by chunk, each :meth:`run` stopping where the frames known
    so far end and the next one going on from there, step for step as one run over all frames would.

    Args:
        prediction, joint, blank, durations, max_symbols: as :func:`greedy_batch`.
        batch: utterances.
        device: where the decoding state lives.
    """

    def __init__(self, prediction: Any, joint: Any, batch: int, blank: int, durations: list[int] | None,
                 max_symbols: int, device: torch.device) -> None:  # fmt: skip
        self.prediction, self.joint, self.blank, self.durations = prediction, joint, blank, durations
        self.max_symbols = max_symbols
        self.rows = torch.arange(batch, device=device)
        self.t = torch.zeros(batch, dtype=torch.long, device=device)
        self.on_frame = torch.zeros(batch, dtype=torch.long, device=device)  # labels emitted on the current frame
        self.steps = torch.zeros(batch, dtype=torch.long, device=device)
        self.duration_values = torch.tensor(durations or [0, 1], device=device)
        pred_out, self.state = prediction.step(torch.full((batch,), blank, dtype=torch.long, device=device), None)
        self.pred_proj = joint.pred_proj(pred_out)
        self.enc_proj: torch.Tensor | None = None  # (B, T, J): the frames from ``base`` on
        self.base = 0
        self.results: list[dict[str, list[int]]] = [{"ids": [], "starts": [], "ends": []} for _ in range(batch)]

    @torch.no_grad()
    def extend(self, enc: torch.Tensor) -> None:
        """Append encoder (joint-input) frames (B, T, D)."""
        proj = self.joint.enc_proj(enc)
        self.enc_proj = proj if self.enc_proj is None else torch.cat([self.enc_proj, proj], dim=1)

    @torch.no_grad()
    def run(self, limit: torch.Tensor | int) -> None:
        """Decode until every utterance's frame pointer reaches ``limit`` ((B,) or one number: its valid frames, or
        those known so far)."""
        if self.enc_proj is None:
            return
        blank, joint, enc_proj, frames = self.blank, self.joint, self.enc_proj, self.enc_proj.shape[1]
        t, on_frame, pred_proj, state = self.t, self.on_frame, self.pred_proj, self.state
        records = []
        active = t < limit
        while bool(active.any()):
            logits = joint(enc_proj[self.rows, (t - self.base).clamp(max=frames - 1)], pred_proj)  # (B, V+1[+D])
            token = logits[:, : blank + 1].argmax(-1)
            is_label = (token != blank) & active
            if self.durations is not None:
                advance = self.duration_values[logits[:, blank + 1 :].argmax(-1)]
                advance = torch.where(token == blank, advance.clamp(min=1), advance)
            else:
                advance = (token == blank).long()
            on_frame = torch.where(is_label, on_frame + 1, on_frame)
            advance = torch.where(is_label & (advance == 0) & (on_frame >= self.max_symbols), 1, advance)
            records.append(torch.stack([is_label.long(), token, t, t + advance.clamp(min=1)]))
            self.steps += active.long()
            t = torch.where(active, t + advance, t)
            on_frame = torch.where(advance > 0, 0, on_frame)
            new_out, new_state = self.prediction.step(torch.where(is_label, token, blank), state)
            state = _select_state(is_label, new_state, state)
            pred_proj = torch.where(is_label[:, None], joint.pred_proj(new_out), pred_proj)
            active = t < limit
        self.t, self.on_frame, self.pred_proj, self.state = t, on_frame, pred_proj, state
        if records:
            table = torch.stack(records).cpu()  # (steps, 4, B): one host transfer per run
            for b, result in enumerate(self.results):
                emitted = table[:, 0, b].bool()
                for key, row in (("ids", 1), ("starts", 2), ("ends", 3)):
                    result[key] += table[emitted, row, b].tolist()

    def forget_decoded_frames(self) -> None:
        """Drop the frames every utterance's pointer has passed (streaming: memory bounded by the chunk)."""
        if self.enc_proj is not None:
            keep = min(int(self.t.min()), self.base + self.enc_proj.shape[1])
            self.enc_proj, self.base = self.enc_proj[:, keep - self.base :], keep

    def hypotheses(self) -> list[dict[str, list[int]]]:
        """Per utterance ``{"ids", "starts", "ends"}`` so far."""
        return self.results


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


LN10 = math.log(10.0)


class LexiconLM:
    """A word n-gram LM applied token by token through a lexicon trie, with look-ahead (for transducer beam search).

    The LM's words are spelled with the model's tokenizer into a prefix tree. A hypothesis sits on a node of it (the
    tokens of its unfinished word). Each label moves it to a child; a label that starts a word (a sentencepiece
    ``▁`` piece, or any label after a character tokenizer's space) first closes the word it was spelling. Labels
    that leave the tree end the hypothesis: as in CTC beam search, only the LM's words can be recognised.

    While a word is unfinished it carries a look-ahead score, the best ``ln p(w | history)`` over the words below
    its node (exact for the history, not a unigram estimate), so the LM's verdict arrives with each token instead
    of all at once when the next word starts. Without it a beam that must keep its best few prefers whichever
    hypotheses have not yet paid for their last word: it delays and drops words, more so the heavier the LM. When
    the word closes, the look-ahead is replaced by the word's own probability, plus ``word_score``.
    """

    def __init__(self, lm: NgramLM, tokenizer: Any, weight: float, word_score: float) -> None:
        self.lm, self.order = lm, lm.order
        self.weight, self.word_score = weight * LN10, word_score  # weight of a log10 probability
        pieces = tokenizer.vocab
        piece_id = {p: i for i, p in enumerate(pieces)}
        self.space = piece_id.get(" ", -1)  # a character tokenizer's word separator
        self.word_start = [p.startswith("▁") for p in pieces]
        spelled = []
        for word in lm.vocabulary:
            names = None if word in (BOS, EOS, UNK) else spell(tokenizer, word)
            if names:
                spelled.append((tuple(piece_id[n] for n in names), word))
        if not spelled:
            raise ValueError("The LM has no word the tokenizer can spell: beam search with it would find nothing.")
        spelled.sort()  # the words below each node of the tree are then one contiguous range
        self.words = [w for _, w in spelled]
        index = {w: i for i, w in enumerate(self.words)}
        self.children: list[dict[int, int]] = [{}]
        self.ranges = [[0, len(spelled)]]
        self.ends = [-1]
        for i, (ids, _) in enumerate(spelled):
            node = 0
            for token in ids:
                child = self.children[node].get(token)
                if child is None:
                    child = self.children[node][token] = len(self.children)
                    self.children.append({})
                    self.ranges.append([i, i + 1])
                    self.ends.append(-1)
                self.ranges[child][1] = i + 1
                node = child
            if self.ends[node] < 0:
                self.ends[node] = i
        # The n-grams seen after each history, as (word indices, log10 probs), for the distribution vectors.
        self._seen: list[dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]]] = [{} for _ in range(self.order)]
        for n in range(2, self.order + 1):
            grouped: dict[tuple[str, ...], list[tuple[int, float]]] = {}
            for gram, logp in lm.probs[n - 1].items():
                if gram[-1] in index:
                    grouped.setdefault(gram[:-1], []).append((index[gram[-1]], logp))
            for history, pairs in grouped.items():
                cols, values = zip(*pairs)
                self._seen[n - 1][history] = (np.array(cols), np.array(values))
        self._unigrams = np.array([lm.probs[0][(w,)] for w in self.words])
        # Per-instance LRU caches (a decoder lives as long as its model); ~80 MB of distributions for 5,000 words.
        self._dist = functools.lru_cache(maxsize=2048)(self._distribution)
        self._best_below = functools.lru_cache(maxsize=1_000_000)(self._best_below_uncached)
        self._eos = functools.lru_cache(maxsize=100_000)(functools.partial(lm.log10_prob, EOS))

    def history(self, words: tuple[str, ...]) -> tuple[str, ...]:
        return (BOS, *words)[-(self.order - 1) :] if self.order > 1 else ()

    def _distribution(self, history: tuple[str, ...]) -> np.ndarray:
        """log10 p(w | history) of every lexicon word, by ARPA back-off (read through the cache ``_dist``)."""
        if not history:
            return self._unigrams
        dist = self._dist(history[1:]) + self.lm.backoffs[len(history) - 1].get(history, 0.0)
        seen = self._seen[len(history)].get(history)
        if seen is not None:
            dist[seen[0]] = seen[1]  # (the sum above made a new array)
        return dist

    def _best_below_uncached(self, node: int, history: tuple[str, ...]) -> float:
        lo, hi = self.ranges[node]
        return float(self._dist(history)[lo:hi].max())

    def _close(self, words: tuple[str, ...], node: int, held: float) -> tuple[tuple[str, ...], float] | None:
        """The closed words and the score added when the word spelled up to ``node`` ends (None: no word ends
        there); nothing to close at the root."""
        if not node:
            return words, 0.0
        word = self.ends[node]
        if word < 0:
            return None
        added = self.weight * self._dist(self.history(words))[word] + self.word_score - held
        return (*words, self.words[word]), added

    def advance(self, state: tuple[tuple[str, ...], int, float], label: int) -> tuple[tuple, float] | None:
        """The state (closed words, node, look-ahead score held) after ``label`` and the score it adds, or None
        if the label leaves the lexicon."""
        words, node, held = state
        added = 0.0
        separator = label == self.space
        if node and (separator or self.word_start[label]):
            closed = self._close(words, node, held)
            if closed is None:
                return None
            (words, added), node, held = closed, 0, 0.0
        if separator:
            return (words, 0, 0.0), added
        child = self.children[node].get(label)
        if child is None:
            return None
        ahead = self.weight * self._best_below(child, self.history(words))
        return (words, child, ahead), added + ahead - held

    def finish(self, state: tuple[tuple[str, ...], int, float]) -> float | None:
        """The score the end of the utterance adds (its last word, then ``</s>``), or None if a word is unfinished."""
        closed = self._close(*state)
        if closed is None:
            return None
        words, added = closed
        return added + self.weight * self._eos(self.history(words))


@dataclass
class _Hyp:
    score: float
    ids: tuple[int, ...]
    t: int
    on_frame: int
    pred_proj: torch.Tensor
    state: tuple[torch.Tensor, ...]
    lm_state: tuple = ((), 0, 0.0)  # LexiconLM's (closed words, trie node, look-ahead held)


class TransducerBeamSearch:
    """Beam search for RNN-T and TDT, with optional shallow fusion of a word n-gram LM.

    Each utterance keeps its own beam. Its hypotheses live at their own frames; each round expands the hypotheses on
    the earliest frame: the blank with each duration (RNN-T: one frame), and the ``beam_size`` best labels with each
    duration (RNN-T: none); the expansions and the waiting hypotheses are merged (same labels on the same frame: the
    best is kept) and the ``beam_size`` best stay. With an LM (:class:`LexiconLM`), each label adds ``lm_weight``
    times its change of the LM score (look-ahead within a word, the word's probability when it closes) and each
    word ``word_score``; labels that spell no LM word are not followed.

    The utterances of a batch are searched together: each utterance's search is a generator that asks for its
    round's joint evaluation and prediction-network step, and :meth:`__call__` runs every utterance's requests of a
    round as one batched call (one joint, one ``log_softmax``, one ``topk``, one host transfer, one LSTM step),
    instead of a few dozen small calls per utterance per round. Each utterance's search is the one it would be
    alone; only the scoring is shared.

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
        self.prediction, self.joint, self.blank = prediction, joint, blank
        self.durations = durations
        self.cfg = cfg
        lm = NgramLM.read_arpa(cfg.lm_path) if cfg.lm_path else None
        self.lm = LexiconLM(lm, tokenizer, cfg.lm_weight, cfg.word_score) if lm is not None else None

    @torch.no_grad()
    def __call__(self, enc: torch.Tensor, lengths: torch.Tensor) -> list[list[int]]:
        """Best label sequence of each utterance: enc (B, T, D), lengths (B,)."""
        batch, device = enc.shape[0], enc.device
        if batch == 0:
            return []
        enc_proj = self.joint.enc_proj(enc)  # (B, T, J)
        out, state = self.prediction.step(torch.full((batch,), self.blank, dtype=torch.long, device=device), None)
        start = self.joint.pred_proj(out)
        searches = {
            b: self._search(enc_proj[b, :length], start[b], tuple(s[:, b : b + 1] for s in state))
            for b, length in enumerate(lengths.tolist())
        }
        results: list[list[int]] = [[] for _ in range(batch)]
        requests = {b: self._advance(search, None, results, b) for b, search in searches.items()}
        while requests := {b: r for b, r in requests.items() if r is not None}:
            replies = {**self._score({b: r for b, r in requests.items() if r[0] == "joint"}),
                       **self._step({b: r for b, r in requests.items() if r[0] == "step"}, device)}  # fmt: skip
            requests = {b: self._advance(searches[b], replies[b], results, b) for b in requests}
        return results

    @staticmethod
    def _advance(search, reply, results: list, b: int):
        """The search's next request after ``reply`` (None: it has finished and put its result in ``results``)."""
        try:
            return search.send(reply)
        except StopIteration as stop:
            results[b] = stop.value
            return None

    def _score(self, requests: dict[int, tuple]) -> dict[int, tuple]:
        """("joint", frame (J,), pred_proj (H, J)) of several searches -> per search the host lists (top-k labels'
        log-probs, their labels, the blank's log-prob, the durations' log-probs or None), one row per hypothesis."""
        if not requests:
            return {}
        blank, k = self.blank, min(self.cfg.beam_size, self.blank)
        frames = torch.cat([frame[None].expand(len(pred), -1) for _, frame, pred in requests.values()])
        logits = self.joint(frames, torch.cat([pred for _, _, pred in requests.values()]))  # (sum H, V+1[+D])
        token_lp = logits[:, : blank + 1].log_softmax(-1)
        values, labels = token_lp[:, :blank].topk(k, dim=-1)
        columns = [values, labels, token_lp[:, blank : blank + 1]]  # labels as floats: exact below 2**24
        if self.durations:
            columns.append(logits[:, blank + 1 :].log_softmax(-1))
        table = torch.cat([c.float() for c in columns], dim=1).cpu().tolist()  # one host transfer for the round
        replies, row = {}, 0
        for b, (_, _, pred) in requests.items():
            rows = table[row : row + len(pred)]
            row += len(pred)
            durations = [r[2 * k + 1 :] for r in rows] if self.durations else None
            replies[b] = ([r[:k] for r in rows], [[int(x) for x in r[k : 2 * k]] for r in rows],
                          [r[2 * k] for r in rows], durations)  # fmt: skip
        return replies

    def _step(self, requests: dict[int, tuple], device: torch.device) -> dict[int, tuple]:
        """("step", labels, per-hypothesis states) of several searches -> per search (pred_proj (n, J), state with n
        columns): one prediction-network step for all of them."""
        if not requests:
            return {}
        tokens = torch.tensor([t for _, labels, _ in requests.values() for t in labels], device=device)
        states = tuple(torch.cat(parts, dim=1) for parts in zip(*(s for _, _, hs in requests.values() for s in hs)))
        new_out, new_state = self.prediction.step(tokens, states)
        new_proj = self.joint.pred_proj(new_out)
        replies, column = {}, 0
        for b, (_, labels, _) in requests.items():
            end = column + len(labels)
            replies[b] = (new_proj[column:end], tuple(s[:, column:end] for s in new_state))
            column = end
        return replies

    def _search(self, enc_proj: torch.Tensor, start: torch.Tensor, state: tuple[torch.Tensor, ...]):
        """One utterance's search (a generator: it yields its requests to :meth:`__call__` and returns the best
        labels); ``start`` and ``state``: the prediction network after the start symbol."""
        frames, beam = enc_proj.shape[0], self.cfg.beam_size
        if frames == 0:
            return []
        durations = self.durations or [0, 1]
        hyps = [_Hyp(0.0, (), 0, 0, start, state)]
        done: list[_Hyp] = []
        while hyps:
            t = min(h.t for h in hyps)
            now = [h for h in hyps if h.t == t]
            waiting = [h for h in hyps if h.t != t]
            top_lp, top_labels, blank_lp, dur_lp = yield (
                "joint",
                enc_proj[t],
                torch.stack([h.pred_proj for h in now]),
            )
            candidates = []  # (score, parent, label or None, duration, LM state)
            for i, h in enumerate(now):
                labels = []  # (log-prob + LM score, label, LM state), the LM's part once for all durations
                for score, label in zip(top_lp[i], top_labels[i]):
                    lm_state = h.lm_state
                    if self.lm is not None:
                        moved = self.lm.advance(h.lm_state, label)
                        if moved is None:
                            continue
                        lm_state, score = moved[0], score + moved[1]
                    labels.append((score, label, lm_state))
                for k, d in enumerate(durations):
                    d_lp = dur_lp[i][k] if dur_lp is not None else 0.0
                    if d >= 1 and (self.durations or d == 1):
                        candidates.append((h.score + blank_lp[i] + d_lp, h, None, d, h.lm_state))
                    if self.durations is None and d != 0:
                        continue
                    if d == 0 and h.on_frame >= self.cfg.max_symbols:
                        continue
                    for score, label, lm_state in labels:
                        candidates.append((h.score + score + d_lp, h, label, d, lm_state))
            candidates.sort(key=lambda c: -c[0])
            candidates = candidates[: beam * 2]
            labelled = [c for c in candidates if c[2] is not None]
            new_proj = new_state = None
            if labelled:
                new_proj, new_state = yield ("step", [c[2] for c in labelled], [c[1].state for c in labelled])
            expanded = self._expand(candidates, new_proj, new_state)
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
            closing = self.lm.finish(h.lm_state) if self.lm is not None else 0.0
            if closing is not None:
                finals.append((h.score + closing, h.ids))
        if not finals and done:  # every hypothesis ends inside a word the LM lacks: the acoustically best one
            finals = [(h.score, h.ids) for h in done]
        return list(max(finals)[1]) if finals else []

    @staticmethod
    def _expand(candidates: list[tuple], new_proj: torch.Tensor | None, new_state: tuple | None) -> list[_Hyp]:
        """New hypotheses from (score, parent, label or None, duration, LM state); the labelled ones, in order, take
        the columns of the prediction network's step ``new_proj`` / ``new_state``."""
        out: list[_Hyp] = []
        index = 0
        for score, h, label, d, lm_state in candidates:
            t = h.t + d
            if label is None:
                out.append(_Hyp(score, h.ids, t, 0, h.pred_proj, h.state, lm_state))
                continue
            state = tuple(s[:, index : index + 1] for s in new_state)
            out.append(_Hyp(score, (*h.ids, label), t, h.on_frame + 1 if d == 0 else 0, new_proj[index], state,
                            lm_state))  # fmt: skip
            index += 1
        return out
