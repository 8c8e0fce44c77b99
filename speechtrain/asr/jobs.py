"""ASR jobs: what the training and fine-tuning scripts do around the model.

The tokenizer and the beam-search LM fitted on the training transcripts when the config names none
(:func:`ensure_tokenizer`, :func:`ensure_lm`), the model class and schema a config selects (:func:`asr_model_class`,
:func:`asr_train_schema`), the fit with its closing validation and decoding report (:func:`fit_and_report`), and the
pretrained model a fine-tune starts from (:func:`restore_for_finetuning`). The model modules never import this one.
"""

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from speechtrain.asr.ctc import ConformerCTCConfig, ConformerCTCModel, CTCModel, resolve_manifest
from speechtrain.asr.ngram import NgramLM, interpolate
from speechtrain.asr.report import choose_decoding, decoding_report, greedy_breakdowns
from speechtrain.asr.transducer import ConformerTransducerConfig, ConformerTransducerModel
from speechtrain.common.fingerprint import file_fingerprint
from speechtrain.common.metrics import format_rate
from speechtrain.common.tokenizers import train_sentencepiece
from speechtrain.core.exp_manager import print_final
from speechtrain.core.model import SpeechModel
from speechtrain.data.manifest import iter_nemo_manifest
from speechtrain.data.nemo_adapters import expand_paths
from speechtrain.lightning import settings
from speechtrain.lightning.fault_tolerance import exit_if_preempted
from speechtrain.lightning.launch import build_on_rank_zero

logger = logging.getLogger(__name__)


def _flat(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str | Path):
        return [str(value)]
    return [item for v in value for item in _flat(v)]


def _training_texts(train_data: Any, what: str, *params: Any) -> tuple[list[tuple[str, Path]], str]:
    """The transcript files of the training data and a cache key of (their paths and contents, ``params``): see
    :func:`~speechtrain.common.fingerprint.file_fingerprint`.

    ``train_data``: a manifest path (or list of them, ``builtin:`` names included), or a dataset config whose
    ``manifest_filepath`` (NeMo manifests; brace patterns for tarred data) and ``cuts_path`` (lhotse cuts) are read,
    and the NeMo manifests and lhotse cuts of its ``input_cfg`` sources. Each file counts once, whatever its weight
    or repeat; a built-in engine view (``builtin:speech/train@piper``) counts as its whole split.
    """
    manifests, cuts, tarred, sources = train_data, None, False, []
    if train_data is not None and not isinstance(train_data, str | Path) and hasattr(train_data, "manifest_filepath"):
        manifests, cuts = train_data.manifest_filepath, getattr(train_data, "cuts_path", None)
        tarred = bool(getattr(train_data, "is_tarred", False))
        sources = list(getattr(train_data, "input_cfg", None) or [])
    manifests, cuts = [(m, tarred) for m in _flat(manifests)], _flat(cuts)
    while sources:  # input_cfg: sources and groups of them
        entry = dict(sources.pop(0))
        sources += list(entry.get("input_cfg") or [])
        if entry.get("type", "nemo") in ("nemo", "nemo_tarred") and entry.get("manifest_filepath"):
            manifests += [(m, tarred or entry.get("type") == "nemo_tarred") for m in _flat(entry["manifest_filepath"])]
        cuts += _flat(entry.get("cuts_path")) if entry.get("type") == "lhotse" else []

    def whole_split(name: str) -> str:
        return name.partition("@")[0] if name.startswith("builtin:") else name

    files = [("nemo", Path(p if t else resolve_manifest(whole_split(p))).resolve())
             for m, t in manifests for p in (expand_paths(m, "manifest_filepath") if t else [m])]  # fmt: skip
    files += [("cuts", Path(c).resolve()) for c in cuts]
    files = list(dict.fromkeys(files))
    if not files:
        raise ValueError(f"There is no train_ds.manifest_filepath, cuts_path or input_cfg manifest to fit {what} on.")
    for kind, path in files:
        if not path.is_file():
            key = "manifest_filepath" if kind == "nemo" else "cuts_path"
            raise FileNotFoundError(f"model.train_ds.{key}={path}: no such file (needed to fit {what}).")
    key = hashlib.sha256(repr([(str(p), file_fingerprint(p), *params) for _, p in files]).encode()).hexdigest()[:12]
    return files, key


def _transcripts(files: list[tuple[str, Path]]) -> Any:
    """The transcripts of ``files``, one at a time (manifests and cuts are never held in memory whole)."""
    from lhotse import CutSet

    for kind, path in files:
        if kind == "nemo":
            yield from (r["text"] for r in iter_nemo_manifest(path))
        else:
            yield from (" ".join(s.text or "" for s in cut.supervisions) for cut in CutSet.from_jsonl_lazy(path))


def ensure_tokenizer(tokenizer_cfg: Any, train_data: Any) -> None:
    """Fill in ``tokenizer_cfg.path`` with a sentencepiece model trained on the transcripts of ``train_data`` (see
    :func:`_training_texts`) when the config names no tokenizer. Trained once per (data, type, size), under the
    datasets cache, by global rank 0 while the other ranks of the launch wait for the file
    (:func:`~speechtrain.lightning.launch.build_on_rank_zero`)."""
    if getattr(tokenizer_cfg, "path", None) or getattr(tokenizer_cfg, "vocab", None):
        return
    files, key = _training_texts(train_data, "a tokenizer", tokenizer_cfg.type, tokenizer_cfg.vocab_size)
    folder = (
        settings.SPEECHTRAIN_DATASETS_CACHE / "tokenizers" / f"{tokenizer_cfg.type}{tokenizer_cfg.vocab_size}-{key}"
    )
    model = folder / "tokenizer.model"

    def build() -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            train_sentencepiece(_transcripts(files), tmp, vocab_size=tokenizer_cfg.vocab_size,
                                model_type=tokenizer_cfg.type)  # fmt: skip
            for name in ("tokenizer.vocab", "tokenizer.model"):  # the model last: its presence means done
                os.replace(Path(tmp) / name, folder / name)
        logger.info("Trained a %s tokenizer of %d pieces on %s: %s", tokenizer_cfg.type, tokenizer_cfg.vocab_size,
                    ", ".join(str(p) for _, p in files), model)  # fmt: skip

    build_on_rank_zero(model, build, "the tokenizer")
    tokenizer_cfg.path = str(model)


def ensure_lm(decoding_cfg: Any, train_data: Any) -> None:
    """Fill in ``decoding_cfg.lm_path`` with a word n-gram LM (:mod:`speechtrain.asr.ngram`) of order
    ``lm_order`` fitted on the transcripts of ``train_data`` (see :func:`_training_texts`), when the config asks
    for beam search and names no LM. Fitted once per (data, order), under the datasets cache (seconds for the
    built-in corpus), by global rank 0 while the other ranks wait for the file."""
    if decoding_cfg.strategy != "beam" or decoding_cfg.lm_path or decoding_cfg.lm_order <= 0:
        return
    decoding_cfg.lm_path = str(_fitted_lm(train_data, decoding_cfg.lm_order))


def _fitted_lm(train_data: Any, order: int) -> Path:
    """The cached word ``order``-gram LM of the transcripts of ``train_data`` (fitted by global rank 0 once)."""
    files, key = _training_texts(train_data, "an n-gram LM", order)
    folder = settings.SPEECHTRAIN_DATASETS_CACHE / "lms" / f"{order}gram-{key}"
    lm_path = folder / "lm.arpa"

    def build() -> None:
        start = time.perf_counter()
        lm = NgramLM.fit(_transcripts(files), order=order)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            lm.write_arpa(Path(tmp) / "lm.arpa")
            os.replace(Path(tmp) / "lm.arpa", lm_path)
        seconds = time.perf_counter() - start
        logger.info("Fitted a %d-gram word LM (%d words) on %s in %.1f s: %s", order, len(lm.probs[0]) - 3,
                    ", ".join(str(p) for _, p in files), seconds, lm_path)  # fmt: skip

    build_on_rank_zero(lm_path, build, "the n-gram LM")
    return lm_path


@dataclass
class FinetuneLMConfig:
    """The beam-search LM of a fine-tuned model (``lm`` in ``asr_finetune.yaml``), when its decoding is beam search
    with ``decoding.lm_order > 0`` and the job names new training data (:func:`finetune_lm`).

    Attributes:
        use: ``auto``: the archive's LM interpolated with one fitted on the new transcripts (``mix``) when the
            archive has an LM, else the new one; ``mix``; ``archive`` (the archive's, unchanged); ``new`` (fitted on
            the new transcripts alone); ``none`` (beam search without an LM).
        new_weight: the new transcripts' LM's weight in the mix; None: :func:`mix_weight` of their number.
    """

    use: str = "auto"
    new_weight: float | None = None


LM_USES = ("auto", "mix", "archive", "new", "none")
# mix_weight's prior: the mix gives the new transcripts' LM the weight n / (n + MIX_PRIOR_SENTENCES) (docs/asr.md).
MIX_PRIOR_SENTENCES = 4000


def mix_weight(sentences: int) -> float:
    """The weight of an LM fitted on ``sentences`` new transcripts, interpolated with the archive's: n / (n + N0),
    N0 = :data:`MIX_PRIOR_SENTENCES` (docs/asr.md: how it was measured). Few new transcripts, little weight: their
    LM knows few words and its n-grams are unreliable; many, and the mix tends to the new LM alone."""
    return sentences / (sentences + MIX_PRIOR_SENTENCES)


def _lm_words(path: str | Path) -> int:
    return len(NgramLM.read_arpa(path).known - {"<s>", "</s>", "<unk>"})


def finetune_lm(decoding_cfg: Any, train_data: Any, archive_lm: str | None, rule: FinetuneLMConfig) -> str:
    """Set ``decoding_cfg.lm_path`` of a model fine-tuned on ``train_data`` (new training data) by ``rule`` and
    return what it chose and why (the closing report prints it). ``archive_lm``: the pretrained archive's LM (None
    when it has none). Nothing changes unless the decoding is beam search with ``lm_order > 0``; an ``lm_path``
    already set in ``decoding_cfg`` (given on the command line) is used as it is.

    Raises:
        ValueError: an unknown ``rule.use``, ``use: mix`` or ``archive`` without an archive LM, or a
            ``new_weight`` outside (0, 1); each names the key.
    """
    if rule.use not in LM_USES:
        raise ValueError(f"lm.use={rule.use}: expected one of {', '.join(LM_USES)}.")
    if rule.new_weight is not None and not 0.0 < rule.new_weight < 1.0:
        raise ValueError(f"lm.new_weight={rule.new_weight}: the new LM's weight in the mix must be in (0, 1).")
    if decoding_cfg.strategy != "beam" or decoding_cfg.lm_order <= 0:
        return ""
    if decoding_cfg.lm_path:
        return f"decoding.lm_path={decoding_cfg.lm_path} ({_lm_words(decoding_cfg.lm_path):,} words), as given"
    use = rule.use
    if use in ("mix", "archive") and not archive_lm:
        raise ValueError(f"lm.use={use}: the pretrained archive has no LM; use lm.use=new or lm.use=none.")
    if use == "auto":
        use = "mix" if archive_lm else "new"
    if use == "none":
        decoding_cfg.lm_path, decoding_cfg.lm_order = None, 0
        return "none (lm.use=none): beam search without an LM"
    if use == "archive":
        decoding_cfg.lm_path = archive_lm
        return f"the archive's ({_lm_words(archive_lm):,} words), kept (lm.use=archive)"
    order = decoding_cfg.lm_order
    files, _ = _training_texts(train_data, "an n-gram LM", order)
    sentences = sum(1 for text in _transcripts(files) if text.split())
    new_lm = _fitted_lm(train_data, order)
    fitted = f"a {order}-gram fitted on the {sentences:,} new transcripts ({_lm_words(new_lm):,} words)"
    if use == "new":
        decoding_cfg.lm_path = str(new_lm)
        why = "lm.use=new" if rule.use == "new" else "the archive has no LM"
        return f"{fitted}, alone ({why})"
    weight = rule.new_weight if rule.new_weight is not None else mix_weight(sentences)
    key = hashlib.sha256(repr((file_fingerprint(archive_lm), file_fingerprint(new_lm), round(weight, 6))).encode())
    folder = settings.SPEECHTRAIN_DATASETS_CACHE / "lms" / f"finetune-mix-{key.hexdigest()[:12]}"
    mixed = folder / "lm.arpa"

    def build() -> None:
        lm = interpolate([(NgramLM.read_arpa(archive_lm), 1.0 - weight), (NgramLM.read_arpa(new_lm), weight)])
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            lm.write_arpa(Path(tmp) / "lm.arpa")
            os.replace(Path(tmp) / "lm.arpa", mixed)
        logger.info("Interpolated the archive's LM (weight %.3g) with %s (weight %.3g): %s", 1.0 - weight, fitted,
                    weight, mixed)  # fmt: skip

    build_on_rank_zero(mixed, build, "the interpolated n-gram LM")
    decoding_cfg.lm_path = str(mixed)
    why = "lm.use=mix" if rule.use == "mix" else "lm.use=auto: the archive has an LM and there are new transcripts"
    how = (f"weight {weight:.3g} on the new, lm.new_weight" if rule.new_weight is not None else
           f"weight {weight:.3g} on the new = n / (n + {MIX_PRIOR_SENTENCES:,})")  # fmt: skip
    return (
        f"the archive's ({_lm_words(archive_lm):,} words) interpolated with {fitted}, {how}; its lexicon is "
        f"both LMs' words, {_lm_words(mixed):,} ({why})"
    )


def fit_and_report(trainer: Any, model: CTCModel, log_dir: Any, start: float) -> None:
    """Train, run a closing validation on every validation set, and print its WER/CER (global rank 0). A
    preempted run exits instead (:func:`~speechtrain.lightning.fault_tolerance.exit_if_preempted`).

    When the closing validation ran beam search + LM and it was worse than greedy decoding on the first validation
    set, the model's default decoding (``decoding.strategy``, which transcription follows) becomes greedy and the
    final archive is written again with it (:func:`~speechtrain.asr.report.choose_decoding`); the report says so."""
    trainer.fit(model)
    exit_if_preempted(trainer)
    results = trainer.validate(model, verbose=False) if model.val_dataloader() else []
    indexed = [(index, name, Path(resolve_manifest(cfg.manifest_filepath)))
               for index, (name, cfg) in enumerate(model._validation_sets())
               if isinstance(cfg.manifest_filepath, str)]  # fmt: skip
    sets = [(name, path) for _, name, path in indexed]
    # The report's per-engine greedy WER reads the closing validation's greedy transcripts, gathered over the
    # data-parallel replicas (or decodes a set again, shared out over them, where they lack an utterance): every
    # rank takes part (global rank 0 alone would wait for its tensor-parallel peers forever).
    closing = model.closing_greedy
    decoded = None if closing is None else [closing.get(index, {}) for index, _, _ in indexed]
    breakdowns = greedy_breakdowns(model, sets, decoded) if results else None
    metrics = {k: v for r in results for k, v in r.items()}  # the same on every rank (reduced before logging)
    names = [name for name, _ in model._validation_sets()]
    choice = choose_decoding(model.cfg.decoding.strategy, metrics, names[0] if names else "val")
    if choice.strategy != model.cfg.decoding.strategy:
        model.cfg.decoding.strategy = choice.strategy
        _rewrite_archive(trainer, model)  # every rank: the archive gathers tensor-parallel shards
    if trainer.is_global_zero:
        shown = ", ".join(
            f"{k}={format_rate(float(v))}" for k, v in sorted(metrics.items()) if "wer" in k or "cer" in k
        )
        normalised = model.text_normalizer.describe()
        seconds = time.perf_counter() - start
        decoding = ""
        if choice.reason:  # the closing validation compared beam + LM with greedy on the first set
            worse = f" (beam + LM was worse than greedy on {names[0]})" if choice.strategy == "greedy" else " + LM"
            decoding = f" | default decoding: {choice.strategy}{worse}"
        line = f"Final: {shown} (transcripts {normalised}){decoding} | {seconds:.0f} s wall | run folder {log_dir}"
        print_final(line)
        if results:
            report = decoding_report(model, metrics, sets, breakdowns, choice)
            print(f"\nDecoding report (greedy = acoustic model alone; beam + LM beside it):\n{report}\n", flush=True)
            if log_dir is not None:
                (Path(log_dir) / "decoding_report.md").write_text(report + "\n", encoding="utf-8")
                # The closing metrics for tools (benchmarks/results.py from-run records make demo's WERs from them).
                closing_metrics = {k: float(v) for k, v in sorted(metrics.items())}
                (Path(log_dir) / "final_metrics.json").write_text(json.dumps(closing_metrics, indent=1) + "\n")
                # The per-engine (and per-voice) greedy WERs: {set: {group: [WER, utterances]}}, for tools
                # (benchmarks/leave_one_out.py reads the left-out engine's WER from it).
                if breakdowns:
                    (Path(log_dir) / "greedy_breakdown.json").write_text(json.dumps(breakdowns, indent=1) + "\n")


def _rewrite_archive(trainer: Any, model: Any) -> None:
    """Write the run's final archive again (its decoding changed after training), where training wrote one (the
    checkpoint callback's ``archive_path``; a preempted run has exited before)."""
    for callback in trainer.callbacks:
        path = getattr(callback, "archive_path", None)
        if path is not None:
            model.save_to(path)
            if trainer.is_global_zero:
                logger.info("Rewrote %s with decoding.strategy=%s", path, model.cfg.decoding.strategy)


def restore_for_finetuning(path: str | Path) -> SpeechModel:
    """The pretrained model a fine-tuning job starts from: a model archive (``.stm``), or a Lightning checkpoint
    (``.ckpt``) of a training run, whose model config is read from the run folder's ``config.yaml``.

    Raises:
        FileNotFoundError: a checkpoint outside a run folder (no ``config.yaml`` two folders up).
    """
    path = Path(path)
    if path.suffix != ".ckpt":
        return SpeechModel.restore_from(path)
    if not path.is_file():
        raise FileNotFoundError(f"init_from.path={path}: no such checkpoint.")
    config = path.resolve().parent.parent / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(
            f"init_from.path={path} is a Lightning checkpoint; its model config comes from the run folder's "
            f"config.yaml, which is not at {config}. Pass the run's model archive (<run folder>/<name>.stm) instead."
        )
    job = OmegaConf.load(config)
    ensure_tokenizer(job.model.tokenizer, job.model.train_ds)
    ensure_lm(job.model.decoding, job.model.train_ds)
    model = asr_model_class(job.model)(job.model)
    report = model.init_from_pretrained(path)
    if report.missing or report.mismatched:
        raise ValueError(f"init_from.path={path} does not hold the weights of the model in {config}: {report}")
    return model


def asr_model_class(model_cfg: Any) -> type:
    """The model class of an ASR training config's ``model`` node: a transducer when it sets ``loss``, else CTC."""
    return ConformerTransducerModel if "loss" in model_cfg else ConformerCTCModel


def asr_model_schema(cfg: Any) -> type:
    """The ``model`` schema of a composed ASR training config (before validation): a transducer's when its
    ``model`` node sets ``loss`` (``asr_train_rnnt``, ``asr_train_tdt``, ``asr_train_hybrid``, a NeMo transducer
    YAML), else a CTC model's."""
    model = cfg.get("model") if hasattr(cfg, "get") else None
    return ConformerTransducerConfig if model is not None and "loss" in model else ConformerCTCConfig
