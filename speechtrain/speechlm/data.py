"""SALM data: lhotse cuts and JSON-lines conversations -> chat-formatted token streams with audio placeholders.

Two sources, mixed freely in one loader:

* **ASR cuts as conversations.** Each cut becomes ``[system] user: <instruction> <audio> | assistant: <answer>``;
  the task (instruction and how the answer is derived from the transcript: the transcript itself, its first or
  last word, its word count) is drawn per cut and epoch from ``tasks`` by weight, deterministically (a resumed
  run sees the same tasks). A cut's custom ``prompt`` field, when present, overrides the instruction.
* **Conversations** (``conversations_path``: JSON lines ``{"conversations": [{"from": "User", "type": "text" |
  "audio", "value": ..., "duration": ...}, ...]}``): each line becomes a cut whose custom field holds the
  conversation; every audio item is read from its file (several per conversation are fine).

Batches are bucketed by *total length* in LLM positions, ``ceil(audio seconds / frame_seconds) + tokens``, with
``batch_tokens`` positions per batch (:class:`TotalLengthConstraint`), so that long audio with a short answer
and short audio with a long prompt are treated alike.
"""

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lhotse.dataset.sampling.base import TokenConstraint

from speechtrain.corpora.sentences import spell_number
from speechtrain.data.cut_datasets import CutDataset, pad_1d
from speechtrain.data.lhotse_loader import LoaderConfig
from speechtrain.speechlm.prompts import Turn, conversation_from_jsonl, get_template
from speechtrain.speechlm.tokenizer import AUDIO_PLACEHOLDER

logger = logging.getLogger(__name__)


@dataclass
class SalmTaskConfig:
    """One instruction the ASR cuts are turned into. ``answer``: ``transcript``, ``first_word``, ``last_word`` or
    ``word_count`` (spelled out, like the transcripts)."""

    name: str = "transcribe"
    instruction: str = "Transcribe the audio."
    answer: str = "transcript"
    weight: float = 1.0


ANSWERS = {
    "transcript": lambda text: text,
    "first_word": lambda text: text.split()[0],
    "last_word": lambda text: text.split()[-1],
    "word_count": lambda text: spell_number(len(text.split())),
}


@dataclass
class SalmLoaderConfig(LoaderConfig):
    """A SALM dataset node: a :class:`LoaderConfig` plus conversations and total-length batching.

    Attributes:
        conversations_path: JSON-lines conversation file(s), read alongside the manifests / cuts.
        batch_tokens: LLM positions (audio frames + tokens) per batch; with bucketing, replaces batch_duration.
        chars_per_token: the tokens of a transcript, estimated from its characters when batching.
        prompt_tokens: tokens of the chat template, system prompt and instruction, estimated, when batching.
    """

    conversations_path: Any = None
    batch_tokens: int | None = None
    chars_per_token: float = 3.0
    prompt_tokens: int = 24


def pick_task(tasks: list[SalmTaskConfig], cut_id: str, epoch: int, seed: int = 0) -> SalmTaskConfig:
    """The task of ``cut_id`` in ``epoch``: a weighted draw from a stable hash (the same in every process)."""
    if len(tasks) == 1:
        return tasks[0]
    digest = hashlib.sha256(f"{seed}/{epoch}/{cut_id}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2**64 * sum(t.weight for t in tasks)
    for task in tasks:
        point -= task.weight
        if point < 0:
            return task
    return tasks[-1]


def check_tasks(tasks: list[SalmTaskConfig]) -> None:
    if not tasks:
        raise ValueError("model.tasks is empty: give at least one instruction (e.g. the transcription task).")
    for task in tasks:
        if task.answer not in ANSWERS:
            raise ValueError(f"model.tasks[{task.name}].answer={task.answer!r}: expected one of {', '.join(ANSWERS)}.")
        if task.weight <= 0:
            raise ValueError(f"model.tasks[{task.name}].weight must be > 0, got {task.weight}.")


def conversation_cuts(path: str | Path) -> Any:
    """A lhotse CutSet with one cut per JSON line of ``path``: its duration is the conversation's total audio, its
    recording the first audio file, and ``custom["conversation"]`` the raw items. Lines without audio are kept
    (text-only conversations); a malformed line raises an error naming the file and line number."""
    import soundfile as sf
    from lhotse import CutSet, MonoCut, Recording
    from lhotse.audio import AudioSource

    cuts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json.loads(line)
                items = record["conversations"]
                conversation_from_jsonl(items)  # validates roles, types and values now, not mid-training
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{where}: not a conversation record ({type(e).__name__}: {e}).") from e
            audios = [item for item in items if item.get("type") == "audio"]
            duration, recording = 0.0, None
            for item in audios:
                audio_path = str(item["value"])
                if item.get("duration") is not None:
                    duration += float(item["duration"])
                elif Path(audio_path).is_file():
                    duration += sf.info(audio_path).duration
            cut_id = record.get("id") or f"conv-{hashlib.sha1(where.encode()).hexdigest()[:10]}-{number}"
            if audios:
                first = str(audios[0]["value"])
                rate = sf.info(first).samplerate if Path(first).is_file() else 16000
                recording = Recording(id=cut_id, sources=[AudioSource(type="file", channels=[0], source=first)],
                                      sampling_rate=rate, num_samples=max(1, round(duration * rate)),
                                      duration=max(1, round(duration * rate)) / rate)  # fmt: skip
            cuts.append(MonoCut(id=cut_id, start=0.0, duration=recording.duration if recording else 0.0, channel=0,
                                recording=recording, custom={"conversation": items}))  # fmt: skip
    return CutSet.from_cuts(cuts)


def _transcript(cut: Any) -> str:
    return " ".join(s.text or "" for s in cut.supervisions).strip()


class SalmDataset(CutDataset):
    """SALM batches (see the module docstring).

    Batch: ``ids``; ``audio`` (N, T) and ``audio_lens`` (N,): every utterance of the batch, in the order of the
    placeholders (row by row, left to right); ``input_ids`` (B, L) right-padded with ``pad_id``, ``input_lens``,
    ``loss_mask`` (B, L) True on the tokens the model learns to produce; ``prompt_ids`` / ``prompt_lens``: the
    conversation up to the assistant's answer, with the generation prompt (for evaluation); ``answers`` (B str)
    and ``tasks`` (B str).
    """

    def __init__(
        self,
        tokenizer: Any,
        sample_rate: int = 16000,
        *,
        template: str,
        tasks: list[SalmTaskConfig],
        system_prompt: str | None = None,
        max_tokens: int = 512,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, sample_rate, **kwargs)
        check_tasks(tasks)
        self.template = get_template(template)
        self.tasks, self.system_prompt, self.max_tokens = tasks, system_prompt, max_tokens
        self.task_seed = kwargs.get("seed", 0)

    def _asr_conversation(self, cut: Any, epoch: int) -> tuple[list[Turn], str, str]:
        task = pick_task(self.tasks, cut.id, epoch, self.task_seed)
        instruction = (cut.custom or {}).get("prompt", task.instruction)
        answer = ANSWERS[task.answer](_transcript(cut))
        turns = [Turn("system", self.system_prompt)] if self.system_prompt else []
        user = instruction if AUDIO_PLACEHOLDER in instruction else f"{instruction} {AUDIO_PLACEHOLDER}"
        turns += [Turn("user", user), Turn("assistant", answer)]
        return turns, answer, task.name

    def read(self, cut: Any, epoch: int) -> dict[str, Any] | None:
        conversation = (cut.custom or {}).get("conversation")
        if conversation is None:
            text = _transcript(cut)
            if not text:
                return self.reader.skip("empty_text", cut.id, "the transcript is empty")
            item = super().read(cut, epoch)
            if item is None:
                return None
            turns, answer, task = self._asr_conversation(cut, epoch)
            audios = [item["audio"]]
        else:
            turns = conversation_from_jsonl(conversation)
            answer = next((t.content for t in reversed(turns) if t.role == "assistant"), "")
            task, audios = "conversation", []
            for index, entry in enumerate(e for e in conversation if e.get("type") == "audio"):
                record = {"audio_filepath": str(entry["value"]), "offset": 0.0, "duration": entry.get("duration"),
                          "text": None}  # fmt: skip
                audio = self.reader.read(record)
                if audio is None:
                    return None
                if index == 0 and self.augmenter is not None:
                    audio["audio"] = self.augmenter(audio["audio"], epoch, cut.id)
                audios.append(audio["audio"])
            item = {"id": cut.id}
        try:
            input_ids, loss_mask = self.template.encode(turns, self.tokenizer)
            last_answer = max((i for i, t in enumerate(turns) if t.role == "assistant"), default=len(turns))
            prompt_ids, _ = self.template.encode(turns[:last_answer], self.tokenizer, add_generation_prompt=True)
        except (KeyError, ValueError) as e:
            return self.reader.skip("unencodable_text", cut.id, str(e))
        if len(input_ids) > self.max_tokens:
            return self.reader.skip("too_many_tokens", cut.id,
                                    f"{len(input_ids)} tokens > max_tokens={self.max_tokens}")  # fmt: skip
        item.update(audios=audios, answer=answer, task=task,
                    input_ids=torch.tensor(input_ids, dtype=torch.long),
                    loss_mask=torch.tensor(loss_mask, dtype=torch.bool),
                    prompt_ids=torch.tensor(prompt_ids, dtype=torch.long))  # fmt: skip
        return item

    def collate(self, items: list[dict[str, Any]], cuts: list[Any]) -> dict[str, Any]:
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        audios = [audio for item in items for audio in item["audios"]]
        audio, audio_lens = pad_1d(audios) if audios else (torch.zeros(0, 1), torch.zeros(0, dtype=torch.long))
        input_ids, input_lens = pad_1d([item["input_ids"] for item in items], pad)
        loss_mask, _ = pad_1d([item["loss_mask"] for item in items], False)
        prompt_ids, prompt_lens = pad_1d([item["prompt_ids"] for item in items], pad)
        return {"ids": [item["id"] for item in items], "audio": audio, "audio_lens": audio_lens,
                "input_ids": input_ids, "input_lens": input_lens, "loss_mask": loss_mask,
                "prompt_ids": prompt_ids, "prompt_lens": prompt_lens, "input_counts": input_lens.tolist(),
                "audio_rows": [row for row, item in enumerate(items) for _ in item["audios"]],
                "answers": [item["answer"] for item in items], "tasks": [item["task"] for item in items]}  # fmt: skip


@dataclass
class TotalLengthConstraint(TokenConstraint):
    """lhotse's token constraint, measuring a cut in LLM positions: audio frames (at ``frame_seconds``) plus the
    estimated tokens of its text and prompt. Batches hold ``max_tokens`` positions (longest x count)."""

    frame_seconds: float = 0.08
    chars_per_token: float = 3.0
    prompt_tokens: int = 24

    def measure_length(self, example: Any) -> float:
        frames = math.ceil(example.duration / self.frame_seconds)
        conversation = (example.custom or {}).get("conversation")
        if conversation is not None:
            chars = sum(len(str(e.get("value", ""))) for e in conversation if e.get("type") != "audio")
        else:
            chars = len(_transcript(example))
        return frames + math.ceil(chars / self.chars_per_token) + self.prompt_tokens


def total_length_constraint(cfg: SalmLoaderConfig, frame_seconds: float) -> TotalLengthConstraint | None:
    """The total-length constraint of a dataset node, or None when it batches by duration / count."""
    if cfg.batch_tokens is None:
        return None
    return TotalLengthConstraint(max_tokens=cfg.batch_tokens, max_examples=cfg.batch_size, frame_seconds=frame_seconds,
                                 chars_per_token=cfg.chars_per_token, prompt_tokens=cfg.prompt_tokens)  # fmt: skip
