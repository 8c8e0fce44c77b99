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
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from speechtrain.asr.ctc import ConformerCTCConfig, ConformerCTCModel, CTCModel, resolve_manifest
from speechtrain.asr.ngram import NgramLM
from speechtrain.asr.report import decoding_report, greedy_breakdowns
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
    files, key = _training_texts(train_data, "an n-gram LM", decoding_cfg.lm_order)
    folder = settings.SPEECHTRAIN_DATASETS_CACHE / "lms" / f"{decoding_cfg.lm_order}gram-{key}"
    lm_path = folder / "lm.arpa"

    def build() -> None:
        start = time.perf_counter()
        lm = NgramLM.fit(_transcripts(files), order=decoding_cfg.lm_order)
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            lm.write_arpa(Path(tmp) / "lm.arpa")
            os.replace(Path(tmp) / "lm.arpa", lm_path)
        seconds = time.perf_counter() - start
        logger.info("Fitted a %d-gram word LM (%d words) on %s in %.1f s: %s", decoding_cfg.lm_order,
                    len(lm.probs[0]) - 3, ", ".join(str(p) for _, p in files), seconds, lm_path)  # fmt: skip

    build_on_rank_zero(lm_path, build, "the n-gram LM")
    decoding_cfg.lm_path = str(lm_path)


def fit_and_report(trainer: Any, model: CTCModel, log_dir: Any, start: float) -> None:
    """Train, run a closing validation on every validation set, and print its WER/CER (global rank 0). A
    preempted run exits instead (:func:`~speechtrain.lightning.fault_tolerance.exit_if_preempted`)."""
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
    if trainer.is_global_zero:
        metrics = {k: v for r in results for k, v in r.items()}
        shown = ", ".join(
            f"{k}={format_rate(float(v))}" for k, v in sorted(metrics.items()) if "wer" in k or "cer" in k
        )
        normalised = model.text_normalizer.describe()
        seconds = time.perf_counter() - start
        line = f"Final: {shown} (transcripts {normalised}) | {seconds:.0f} s wall | run folder {log_dir}"
        print_final(line)
        if results:
            report = decoding_report(model, metrics, sets, breakdowns)
            print(f"\nDecoding report (greedy = acoustic model alone; beam + LM beside it):\n{report}\n", flush=True)
            if log_dir is not None:
                (Path(log_dir) / "decoding_report.md").write_text(report + "\n", encoding="utf-8")
                # The closing metrics for tools (benchmarks/results.py from-run records make demo's WERs from them).
                closing_metrics = {k: float(v) for k, v in sorted(metrics.items())}
                (Path(log_dir) / "final_metrics.json").write_text(json.dumps(closing_metrics, indent=1) + "\n")


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
