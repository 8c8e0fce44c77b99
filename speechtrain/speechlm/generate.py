"""Ask a SALM archive about audio: one file with a prompt, or every utterance of a NeMo manifest.

    python -m speechtrain.speechlm.generate model_path=salm.stm audio=clip.wav prompt="Transcribe the audio."
    python -m speechtrain.speechlm.generate model_path=salm.stm audio=test_manifest.json \\
        [prompt=...] [task=transcribe] [output=answers.json] [limit=null] [batch_size=16] \\
        [greedy=true] [temperature=1.0] [top_k=0] [max_new_tokens=64] [seed=0]

The prompt is the user's text; the audio placeholder is appended to it (or put where ``<|audioplaceholder|>``
appears in it). With a manifest and ``task`` (one of the model's tasks), the prompt is that task's instruction and
the reference answer is derived from the manifest's ``text`` the way the task defines it: the WER (transcription)
or exact-match accuracy (other tasks) is printed. Output: JSON lines, one per utterance, with ``answer``.
"""

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from speechtrain.common.cli import fail, parse_key_values
from speechtrain.common.config import ConfigError
from speechtrain.common.metrics import word_errors

logger = logging.getLogger(__name__)


@dataclass
class GenerateConfig:
    """Command-line options of ``python -m speechtrain.speechlm.generate``.

    Attributes:
        model_path: a SALM archive (``.stm``).
        audio: an audio file, a NeMo manifest (``.json``/``.jsonl``) or a ``builtin:`` corpus split.
        prompt: the user's text (default: the task's instruction).
        task: one of the model's tasks (manifest input: its reference answers are scored).
        output: JSON-lines answers of a manifest (default ``<manifest stem>_answers.json``).
        limit: at most this many utterances of the manifest.
        batch_size: utterances answered together.
        greedy: greedy decoding (false: sampling with ``temperature`` and ``top_k``).
        temperature: sampling temperature.
        top_k: sampling top-k (0: all tokens).
        max_new_tokens: longest answer.
        seed: sampling seed.
    """

    model_path: str | None = None
    audio: str | None = None
    prompt: str | None = None
    task: str | None = None
    output: str | None = None
    limit: int | None = None
    batch_size: int = 16
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    seed: int = 0


def _manifest_cuts(manifest: str, sample_rate: int, limit: int | None) -> Any:
    from lhotse import CutSet

    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.data.lhotse_loader import cuts_from_nemo_manifest

    cuts = cuts_from_nemo_manifest(str(resolve_manifest(manifest)), sample_rate)
    return CutSet.from_cuts(list(cuts)[:limit] if limit else cuts)


def _file_cuts(path: str, prompt: str) -> Any:
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment

    recording = Recording.from_file(path)
    cut = MonoCut(id=Path(path).stem, start=0.0, duration=recording.duration, channel=0, recording=recording,
                  supervisions=[SupervisionSegment(id=Path(path).stem, recording_id=recording.id, start=0.0,
                                                   duration=recording.duration, text="?")],
                  custom={"prompt": prompt})  # fmt: skip
    return CutSet.from_cuts([cut])


def answer_cuts(model: Any, cuts: Any, task: Any, batch_size: int = 16, **generation: Any) -> list[dict[str, Any]]:
    """Generated answers for ``cuts`` under ``task`` (a :class:`~speechtrain.speechlm.data.SalmTaskConfig`), with
    the reference answer from each cut's transcript; skipped (unreadable) utterances are reported, not fatal."""
    from speechtrain.speechlm.data import SalmDataset

    dataset = SalmDataset(model.tokenizer, model.cfg.sample_rate, template=model.cfg.prompt_format, tasks=[task],
                          system_prompt=model.cfg.system_prompt, max_tokens=10**6)  # fmt: skip
    cut_list = sorted(cuts, key=lambda c: c.duration)
    rows = []
    for start in range(0, len(cut_list), batch_size):
        chunk = cut_list[start : start + batch_size]
        batch = dataset[chunk]
        for reason, count in batch["skipped"].items():
            logger.warning("skipped %d utterance(s): %s (e.g. %s)", count, reason, batch["skip_examples"][reason])
        if not batch["ids"]:
            continue
        answers = model.answer(batch, **generation)
        rows += [{"id": i, "reference": r, "answer": a} for i, r, a in zip(batch["ids"], batch["answers"], answers)]
    return rows


def score(rows: list[dict[str, Any]], task: Any) -> dict[str, float]:
    """WER (transcript answers) or exact-match accuracy (other tasks) of ``rows``."""
    hyps, refs = [r["answer"] for r in rows], [r["reference"] for r in rows]
    result = {"utterances": float(len(rows))}
    if task.answer == "transcript":
        errors, words = word_errors(hyps, refs)
        result["wer"] = errors / max(words, 1)
    result["accuracy"] = sum(h.split() == r.split() for h, r in zip(hyps, refs)) / max(len(rows), 1)
    return result


def evaluate(model: Any, manifest: str, limit: int | None = None, batch_size: int = 16) -> dict[str, dict]:
    """Every task of ``model`` on the utterances of ``manifest``: ``{task: {"wer"?, "accuracy", ...}}``."""
    cuts = _manifest_cuts(manifest, model.cfg.sample_rate, limit)
    report = {}
    for task in model.cfg.tasks:
        task = OmegaConf.to_object(task) if OmegaConf.is_config(task) else task
        start = time.perf_counter()
        rows = answer_cuts(model, cuts, task, batch_size)
        report[task.name] = {**score(rows, task), "seconds": time.perf_counter() - start}
    return report


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    from speechtrain.core.model import SpeechModel
    from speechtrain.speechlm.backbone import ensure_parallel_state
    from speechtrain.speechlm.data import SalmTaskConfig

    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_key_values(argv, GenerateConfig, __doc__)
    try:
        missing = [k for k in ("model_path", "audio") if not getattr(cfg, k)]
        if missing:
            raise ConfigError(f"Missing {' and '.join(f'{k}=...' for k in missing)}.")
        for key in ("model_path", "audio"):
            if not Path(getattr(cfg, key)).exists() and not str(getattr(cfg, key)).startswith("builtin:"):
                raise FileNotFoundError(f"{key}={getattr(cfg, key)}: no such file.")
    except (ConfigError, ValueError, FileNotFoundError) as e:
        fail(str(e))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ensure_parallel_state(cfg.seed)
    torch.manual_seed(cfg.seed)
    model = SpeechModel.restore_from(cfg.model_path).eval()
    tasks = {t.name: t for t in model.cfg.tasks}
    if cfg.task is not None and cfg.task not in tasks:
        fail(f"task={cfg.task}: the model knows {', '.join(tasks)}.")
    task = OmegaConf.to_object(tasks[cfg.task]) if cfg.task else SalmTaskConfig()
    if cfg.prompt:
        task.instruction = cfg.prompt
    generation = {"greedy": cfg.greedy, "temperature": cfg.temperature, "top_k": cfg.top_k,
                  "max_new_tokens": cfg.max_new_tokens}  # fmt: skip
    is_manifest = cfg.audio.startswith("builtin:") or cfg.audio.endswith((".json", ".jsonl"))
    cuts = (
        _manifest_cuts(cfg.audio, model.cfg.sample_rate, cfg.limit)
        if is_manifest
        else _file_cuts(cfg.audio, task.instruction)
    )
    start = time.perf_counter()
    rows = answer_cuts(model, cuts, task, cfg.batch_size, **generation)
    seconds = time.perf_counter() - start
    if not is_manifest:
        for row in rows:
            print(row["answer"])
        return
    output = Path(cfg.output or f"{Path(cfg.audio).stem.replace(':', '_').replace('/', '_')}_answers.json")
    with open(output, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(json.dumps({task.name: score(rows, task), "seconds": round(seconds, 1)}))
    print(f"Wrote {len(rows)} answers to {output}.")


if __name__ == "__main__":
    main()
