"""The closing decoding report of a training run: greedy WER first, beam search + LM beside it, for every validation
set; the LM's out-of-vocabulary rate and perplexity on each set's transcripts; and the greedy WER per synthesiser
engine and voice where a manifest records them (``engine`` / ``voice`` keys, as the built-in corpora do).

Greedy decoding is the headline: it is what the acoustic model alone hears. An in-domain LM fitted on the
training transcripts hides mispronunciations and unseen acoustics, so its numbers stand beside, never instead.

Above the table: the default decoding the archive keeps (:func:`choose_decoding`: beam + LM only where it was not
worse than greedy on the first validation set) and which LM the beam search used, and why.
"""

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speechtrain.common.metrics import error_rate, format_rate, word_errors

logger = logging.getLogger(__name__)


@dataclass
class DecodingChoice:
    """The default decoding a model keeps after its closing validation.

    Attributes:
        strategy: ``greedy`` or ``beam``.
        reason: why, with the two WERs compared; empty where nothing was compared (a greedy config, or no figures).
    """

    strategy: str
    reason: str = ""


def choose_decoding(strategy: str, metrics: dict[str, float], set_name: str) -> DecodingChoice:
    """The default decoding after a closing validation that decoded with ``strategy``: where that was beam search
    (+ LM) and its WER (``val_wer``) is above the greedy WER (``val_wer_greedy``) of the first validation set
    (``set_name``), greedy; else ``strategy``. A default is never worse than the model alone on that set."""
    beam, greedy = metrics.get("val_wer"), metrics.get("val_wer_greedy")
    if strategy != "beam" or beam is None or greedy is None or math.isnan(float(beam)) or math.isnan(float(greedy)):
        return DecodingChoice(strategy)
    compared = f"on {set_name}: {format_rate(float(beam))} beam + LM vs {format_rate(float(greedy))} greedy WER"
    if float(beam) > float(greedy):
        return DecodingChoice("greedy", f"beam + LM was worse than greedy {compared}; transcription decodes greedily "
                                        "unless given decoding=beam")  # fmt: skip
    return DecodingChoice("beam", f"beam + LM was not worse than greedy {compared}")


def lm_description(model: Any) -> str:
    """Which LM the model's beam search uses: what the job that set it said (``model.lm_origin``, e.g. the
    fine-tuning rule of :func:`~speechtrain.asr.jobs.finetune_lm`), else its path and size."""
    origin = getattr(model, "lm_origin", None)
    if origin:
        return origin
    lm_path = getattr(model.cfg.decoding, "lm_path", None)
    if not lm_path:
        return "none: beam search without an LM"
    from speechtrain.asr.ngram import NgramLM

    lm = NgramLM.read_arpa(lm_path)
    return f"a {lm.order}-gram of {len(lm.known) - 3:,} words (decoding.lm_path={lm_path})"


def lm_statistics(lm: Any, texts: list[str]) -> tuple[float, float]:
    """(out-of-vocabulary rate, perplexity) of an :class:`~speechtrain.asr.ngram.NgramLM` on ``texts``: the share of
    running words the LM does not know, and 10^(-mean log10 p) over the known words and each sentence end (an
    unknown word is skipped and resets the context, as SRILM's ``-ppl`` does)."""
    known = {g[0] for g in lm.probs[0]}
    words = oov = scored = 0
    log10_sum = 0.0
    for text in texts:
        history = ["<s>"]
        for word in [*text.split(), "</s>"]:
            if word != "</s>":
                words += 1
            if word not in known:
                oov += 1
                history = []
                continue
            log10_sum += lm.log10_prob(word, history)
            scored += 1
            history.append(word)
    return error_rate(oov, words), 10.0 ** (-log10_sum / scored) if scored else math.nan


def greedy_by_group(model: Any, records: list[dict], hyps: list[str]) -> dict[str, tuple[float, int]]:
    """Greedy WER of the transcripts ``hyps`` of a NeMo manifest's records (which record an ``engine``) per engine
    (and per ``voice`` of engines with at most eight voices): {group: (WER, utterances)}, on transcripts normalised
    as ``model`` normalises them."""
    norm = model.text_normalizer
    voices_of: dict[str, set] = defaultdict(set)
    for r in records:
        voices_of[r.get("engine", "?")].add(r.get("voice", "?"))
    groups: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for r, h in zip(records, hyps, strict=True):
        pair = (norm(h), norm(r["text"]))
        engine = r.get("engine", "?")
        groups[engine].append(pair)
        if 1 < len(voices_of[engine]) <= 8:
            groups[f"{engine} / {r.get('voice', '?')}"].append(pair)
    return {g: (error_rate(*word_errors(*zip(*pairs))), len(pairs)) for g, pairs in sorted(groups.items())}


def greedy_transcripts(model: Any, records: list[dict], batch_size: int = 16) -> list[str]:
    """The model's greedy transcripts (:meth:`~speechtrain.asr.ctc.CTCModel.transcribe`) of ``records``, in their
    order. Decoded longest first, so that each batch pads little (a manifest in file order mixes 2 s and 15 s)."""
    order = sorted(range(len(records)), key=lambda i: -float(records[i].get("duration") or 0.0))
    texts = model.transcribe([records[i]["audio_filepath"] for i in order], batch_size, strategy="greedy")
    hyps = [""] * len(records)
    for i, text in zip(order, texts, strict=True):
        hyps[i] = text
    return hyps


def validation_transcripts(path: Path, records: list[dict], shares: list[dict[str, str]]) -> list[str] | None:
    """The greedy transcripts of the NeMo manifest ``path``'s ``records``, in their order, from a validation's
    ({cut id: text}, one dict per data-parallel replica; the IDs :func:`~speechtrain.data.nemo_adapters.
    manifest_cut_ids` gives its lines), or None unless the shares hold every record's ID and nothing else, once."""
    from speechtrain.data.nemo_adapters import manifest_cut_ids

    merged = {cut_id: text for share in shares for cut_id, text in share.items()}
    ids = manifest_cut_ids(path, records)
    if sum(len(share) for share in shares) != len(ids) or merged.keys() != set(ids):
        return None
    return [merged[cut_id] for cut_id in ids]


def greedy_breakdowns(
    model: Any, sets: list[tuple[str, Path]], decoded: list[dict[str, str]] | None = None
) -> dict[str, dict[str, tuple[float, int]]]:
    """:func:`greedy_by_group` of each validation set that records engines: {set name: {group: (WER, utterances)}}
    ({} for a set that does not).

    ``decoded``: per set, this rank's share of the closing validation's greedy transcripts ({cut id: text}, see
    :func:`validation_transcripts`). Gathered over the data-parallel group, they spare a second greedy pass over the
    set where they hold all its utterances (none was skipped).

    Else it runs the model, shared out over the data-parallel replicas: replica ``r`` of ``n`` decodes every ``n``-th
    utterance from the ``r``-th (all the ranks of a replica together, each with its own tensor-parallel shards), and
    one ``all_gather_object`` per set over the data-parallel group gives every rank all the transcripts. So every
    rank calls it, and issues the same collectives in the same order whatever the data (rather than the first
    replica decoding everything while the others wait). A file a rank
    cannot read is sent in place of its share, so every rank leaves that set's breakdown out (with a warning naming
    it) instead of waiting for the failed rank."""
    import torch

    from speechtrain.data.manifest import read_nemo_manifest
    from speechtrain.lightning import parallel_state

    gather = torch.distributed.is_available() and torch.distributed.is_initialized()
    size, rank = (parallel_state.data_parallel_world_size(), parallel_state.data_parallel_rank()) if gather else (1, 0)
    out = {}
    for position, (name, path) in enumerate(sets):
        if not path.is_file():
            continue
        records = read_nemo_manifest(path)
        if not any("engine" in r for r in records):
            out[name] = {}
            continue
        if decoded is not None:
            shares = [decoded[position]]
            if size > 1:
                shares = [None] * size
                torch.distributed.all_gather_object(
                    shares, decoded[position], group=parallel_state.data_parallel_group()
                )
            hyps = validation_transcripts(path, records, shares)  # the same shares, so the same answer, on every rank
            if hyps is not None:
                out[name] = greedy_by_group(model, records, hyps)
                continue
        mine = range(rank, len(records), size)
        try:
            share: list | str = list(zip(mine, greedy_transcripts(model, [records[i] for i in mine]), strict=True))
        except (OSError, RuntimeError, ValueError) as error:  # an unreadable file (soundfile's errors among them)
            share = f"{type(error).__name__}: {error}"  # sent as the share: the other ranks must not wait for it
        shares = [share]
        if size > 1:
            shares = [None] * size
            torch.distributed.all_gather_object(shares, share, group=parallel_state.data_parallel_group())
        failed = [part for part in shares if isinstance(part, str)]
        if failed:
            logger.warning("The per-engine breakdown of %s is left out: %s (%s)", name, failed[0], path)
            out[name] = {}
            continue
        pairs = sorted(pair for part in shares for pair in part)
        out[name] = greedy_by_group(model, records, [text for _, text in pairs])
    return out


def decoding_report(
    model: Any,
    metrics: dict[str, float],
    sets: list[tuple[str, Path]],
    breakdowns: dict[str, dict[str, tuple[float, int]]] | None = None,
    choice: DecodingChoice | None = None,
) -> str:
    """The report's text. ``metrics``: the closing validation's (``val_wer_<set>``, ``val_wer_greedy_<set>``, ...);
    ``sets``: (name, resolved manifest) of each validation set; ``breakdowns``: :func:`greedy_breakdowns` (computed
    here when None: a collective under data parallelism, so then every rank calls this); ``choice``: the default
    decoding kept (:func:`choose_decoding`), said above the table with the LM that beam search used."""
    from speechtrain.asr.ngram import NgramLM
    from speechtrain.data.manifest import read_nemo_manifest

    breakdowns = greedy_breakdowns(model, sets) if breakdowns is None else breakdowns
    # Beam search ran where the closing validation logged greedy figures beside its own (the config's strategy may
    # since have become greedy: choose_decoding).
    beam = any(k.startswith("val_wer_greedy") for k in metrics)
    lm_path = getattr(model.cfg.decoding, "lm_path", None)
    lm = NgramLM.read_arpa(lm_path) if beam and lm_path else None
    single = len(sets) == 1
    lines = []
    if choice is not None and choice.reason:
        label = "greedy" if choice.strategy == "greedy" else "beam + LM" if lm_path else "beam search"
        lines.append(f"Default decoding: {label} ({choice.reason}).")
    if beam:
        lines.append(f"LM: {lm_description(model)}.")
    if lines:
        lines.append("")
    lines += ["set | greedy WER | greedy CER | beam+LM WER | beam+LM CER | LM OOV | LM perplexity",
              "--- | --- | --- | --- | --- | --- | ---"]  # fmt: skip
    breakdown = []
    for name, manifest in sets:
        suffix = "" if single else f"_{name}"
        greedy_wer = metrics.get(f"val_wer_greedy{suffix}" if beam else f"val_wer{suffix}", math.nan)
        greedy_cer = metrics.get(f"val_cer_greedy{suffix}" if beam else f"val_cer{suffix}", math.nan)
        beam_wer = metrics.get(f"val_wer{suffix}", math.nan) if beam else math.nan
        beam_cer = metrics.get(f"val_cer{suffix}", math.nan) if beam else math.nan
        records = read_nemo_manifest(manifest) if manifest.is_file() else []
        oov, ppl = math.nan, math.nan
        if lm is not None and records:
            oov, ppl = lm_statistics(lm, [model.text_normalizer(r["text"]) for r in records])
        cells = [format_rate(greedy_wer), format_rate(greedy_cer), format_rate(beam_wer), format_rate(beam_cer),
                 format_rate(oov), "n/a" if math.isnan(ppl) else f"{ppl:.1f}"]  # fmt: skip
        lines.append(" | ".join([name, *cells]))
        if records:
            for group, (wer, count) in breakdowns.get(name, {}).items():
                breakdown.append(f"{name} | {group} | {format_rate(wer)} | {count}")
    text = "\n".join(lines)
    if breakdown:
        text += "\n\nset | engine / voice | greedy WER | utterances\n--- | --- | --- | ---\n" + "\n".join(breakdown)
    return text
