"""A real person: Asterisk's English telephone prompts (one speaker, Allison Smith; Debian's
``asterisk-core-sounds-en-wav`` and ``asterisk-core-sounds-en`` for the transcripts, CC BY-SA 3.0), heard zero-shot
and after a short fine-tune on her other prompts.

    apt-get install asterisk-core-sounds-en-wav asterisk-core-sounds-en
    python benchmarks/human_prompts.py --base asr_demo.stm [--minutes 8] [--record] [-- FINE-TUNE OVERRIDES]
    python benchmarks/human_prompts.py --base asr_demo.stm --replay builtin:speech/train [--replay-share 0.5]

The prompts with words in them (563, 25 minutes; digits, letters and phrases; 8 kHz, resampled to 16 kHz once into
the datasets cache) are sorted by name: every fifth is ``test`` (112), every ninth of the rest ``dev`` (50), the
others ``train`` (401). Transcripts go through the built-in corpus's normaliser (numbers spelled out; ``*`` and
``#`` read as "star" and "pound"; bracketed notes such as ``[@]`` dropped).

1. Decodes ``test`` with ``--base``: greedy and beam + LM (the archive's LM).
2. Fine-tunes ``--base`` on ``train`` with ``examples/asr_finetune.py`` for ``--minutes`` on 2 processes, ``dev``
   validating (the closing report chooses the default decoding on it), skipped with ``--tuned``. ``--replay``
   mixes another set into the fine-tune's data (the archive's own training data, say): ``--replay-share`` of the
   utterances drawn come from it.
3. Decodes ``test`` with the fine-tuned model: greedy, beam + LM and the default decoding, and splits greedy's errors
   by word: the share wrong of the words her ``train`` prompts hold and of those they lack; with ``--weights``, also
   dev and test with each LM (:func:`asr_finetune_lm.lm_table`: the archive's, one of the new transcripts, their
   mixes), a domain whose words the archive's LM lacks.

``--record`` appends the test WERs and that split to results/human.jsonl. Nothing here trains a recipe on these
prompts.
"""

import argparse
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from asr_finetune_lm import decode, encoder_outputs, finetune, lm_table  # noqa: E402

from speechtrain.common.metrics import error_rate, reference_hits, word_error_rate  # noqa: E402
from speechtrain.core.model import SpeechModel  # noqa: E402
from speechtrain.corpora.builtin import resolve_manifest  # noqa: E402
from speechtrain.corpora.cache import default_datasets_cache  # noqa: E402
from speechtrain.corpora.sentences import normalize_transcript  # noqa: E402
from speechtrain.data.augment import resample  # noqa: E402
from speechtrain.data.manifest import read_nemo_manifest  # noqa: E402

SOUNDS = Path("/usr/share/asterisk/sounds/en_US_f_Allison")
TRANSCRIPTS = Path("/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
PACKAGES = "asterisk-core-sounds-en-wav asterisk-core-sounds-en"
RATE = 16000


def transcript(text: str) -> str:
    """The normalised words of one line of core-sounds-en.txt (``[...]`` notes dropped, ``*`` / ``#`` read)."""
    text = re.sub(r"\[[^\]]*\]", " ", text).replace("*", " star ").replace("#", " pound ")
    return normalize_transcript(text)


def prompt_sets(cache: Path) -> dict[str, Path]:
    """``train``, ``dev`` and ``test`` manifests of the prompts (16 kHz copies written into ``cache`` once)."""
    if not SOUNDS.is_dir() or not TRANSCRIPTS.is_file():
        raise SystemExit(f"The prompts come from Debian: apt-get install {PACKAGES}")
    audio = cache / "audio"
    audio.mkdir(parents=True, exist_ok=True)
    rows = []
    with gzip.open(TRANSCRIPTS, "rt", encoding="utf-8") as lines:
        for line in lines:
            name, colon, text = line.partition(":")
            words = transcript(text) if colon and not line.startswith(";") else ""
            source = SOUNDS / f"{name.strip()}.wav"
            if not words or not source.is_file():
                continue
            target = audio / (name.strip().replace("/", "__") + ".wav")
            if not target.is_file():
                samples, rate = sf.read(source, dtype="float32")
                sf.write(target, resample(torch.from_numpy(samples), rate, RATE).numpy(), RATE)
            rows.append({"audio_filepath": str(target), "duration": sf.info(target).duration, "text": words})
    rows.sort(key=lambda r: r["audio_filepath"])
    rest = [r for i, r in enumerate(rows) if i % 5 != 4]
    parts = {"train": [r for i, r in enumerate(rest) if i % 9 != 8], "dev": rest[8::9], "test": rows[4::5]}
    paths = {}
    for name, part in parts.items():
        paths[name] = cache / f"{name}.json"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in part), encoding="utf-8")
    return paths


def replay_sources(train: Path, replay: str, share: float) -> list[dict]:
    """``input_cfg`` sources drawing ``train`` and ``replay`` (e.g. the archive's own training data) in the ratio
    ``1 - share : share``: ``train`` repeated so that both run out together."""
    if not 0 < share < 1:
        raise SystemExit(f"--replay-share must lie between 0 and 1, got {share}.")
    mine, theirs = len(read_nemo_manifest(train)), len(read_nemo_manifest(resolve_manifest(replay)))
    repeat = max(1, round((1 - share) * theirs / (share * mine)))
    return [{"manifest_filepath": str(train), "weight": mine * repeat, "repeat": repeat},
            {"manifest_filepath": replay, "weight": theirs}]  # fmt: skip


def test_wers(archive: Path, manifest: Path, train: Path) -> dict[str, float]:
    """Greedy, beam + LM and the archive's default decoding's WER (%) on ``manifest``; and the share (%) of its
    reference words that greedy decoding gets wrong (substituted or deleted) among the words of ``train`` (the
    fine-tune's transcripts) and among the others: whether a fine-tune fails on her voice or on words it never
    heard her say."""
    model = SpeechModel.restore_from(archive).eval()
    default = model.cfg.decoding.strategy
    rows = read_nemo_manifest(manifest)
    refs = [model.text_normalizer(r["text"]) for r in rows]
    seen = {word for r in read_nemo_manifest(train) for word in model.text_normalizer(r["text"]).split()}
    outputs = encoder_outputs(model, rows)
    wers = {}
    for strategy in ("greedy", "beam"):
        hyps = [model.text_normalizer(t) for t in decode(model, outputs, len(rows), strategy)]
        wers[strategy] = 100 * word_error_rate(hyps, refs)
        if strategy == "greedy":
            wers |= word_errors_by_seen(hyps, refs, seen)
    wers["default"] = wers[default]
    print(f"{archive.name}: greedy {wers['greedy']:.2f}%, beam + LM {wers['beam']:.2f}% (default: {default}); greedy "
          f"gets {wers['seen_words']:.1f}% of the words her train prompts hold wrong, {wers['unseen_words']:.1f}% of "
          "the others")  # fmt: skip
    return wers


def word_errors_by_seen(hyps: list[str], refs: list[str], seen: set[str]) -> dict[str, float]:
    """``seen_words`` / ``unseen_words``: % of the reference words in / not in ``seen`` that ``hyps`` substitute or
    delete (insertions belong to no reference word)."""
    wrong, total = {True: 0, False: 0}, {True: 0, False: 0}
    for hyp, ref in zip(hyps, refs, strict=True):
        words = ref.split()
        for word, hit in zip(words, reference_hits(hyp.split(), words)[0], strict=True):
            total[word in seen] += 1
            wrong[word in seen] += not hit
    return {f"{'seen' if key else 'unseen'}_words": 100 * error_rate(wrong[key], total[key]) for key in (True, False)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="the archive heard zero-shot and fine-tuned")
    parser.add_argument("--tuned", type=Path, help="its fine-tuned archive (skips the fine-tune)")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--weights", default="", help="the new LM's weights to compare (e.g. auto,0.3,0.5,0.8)")
    parser.add_argument("--replay", help="a manifest (or builtin: name) mixed into the fine-tune's data")
    parser.add_argument("--replay-share", type=float, default=0.5, help="its share of the utterances drawn")
    parser.add_argument("--keep", type=Path, help="a folder to keep the fine-tune's run in (default: deleted)")
    parser.add_argument("--tag", default="", help="names the fine-tune's figures (with overrides)")
    parser.add_argument("--base-tag", default="", help="names the zero-shot figures (another base's recipe)")
    parser.add_argument("--record", action="store_true", help="append the test WERs to results/human.jsonl")
    parser.add_argument("overrides", nargs="*", help="after --: overrides of the fine-tune")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    sets = prompt_sets(default_datasets_cache() / "asterisk-en-allison")
    print({name: len(read_nemo_manifest(path)) for name, path in sets.items()}, flush=True)
    zero_shot = test_wers(args.base, sets["test"], sets["train"])
    with tempfile.TemporaryDirectory() as tmp:
        train, dev = sets["train"], sets["dev"]
        data = replay_sources(train, args.replay, args.replay_share) if args.replay else train
        out = args.keep.resolve() if args.keep else Path(tmp)
        tuned = args.tuned or finetune(args.base.resolve(), data, dev, args.minutes, out, args.overrides)
        tuned_wers = test_wers(tuned, sets["test"], sets["train"])
        parts = {name: sets[name] for name in ("dev", "test")}
        lms = lm_table(args.base, tuned, sets["train"], parts, args.weights, Path(tmp)) if args.weights else {}
    if args.record:
        from results import append

        tail = " ".join(["--", *args.overrides]) if args.overrides else ""
        weights = f"--weights {args.weights} " if args.weights else ""
        command = f"python benchmarks/human_prompts.py --base <asr_demo.stm> --minutes {args.minutes:g} "
        if args.replay:
            command += f"--replay {args.replay} --replay-share {args.replay_share:g} "
        named = (("tag", args.tag), ("base-tag", args.base_tag))
        command += "".join(f"--{flag} {value} " for flag, value in named if value)
        command += weights + tail
        note = ("Asterisk's prompts (one speaker, 8 kHz telephone prompts): test 112 prompts; fine-tuned on 401 "
                f"of her other prompts, 2 processes, {args.minutes:g} min; base {args.base.name}")  # fmt: skip
        if args.replay:
            note += f"; {args.replay} replayed, {args.replay_share:.0%} of the utterances drawn"
        tag = f".{args.tag}" if args.tag else ""
        names = {"greedy": "greedy", "beam": "beam_lm", "default": "default"}
        words = {"seen_words": "greedy_word_errors.seen", "unseen_words": "greedy_word_errors.unseen"}
        base = f".{args.base_tag}" if args.base_tag else ""
        for key, value in zero_shot.items():
            if key in ("greedy", "beam"):
                append(f"human.prompts.zero_shot{base}.{names[key]}_wer", round(value, 2), "%", command.strip(), note)
        for key, value in tuned_wers.items():
            name = f"{names[key]}_wer" if key in names else words[key]
            append(f"human.prompts.finetuned{tag}.{name}", round(value, 2), "%", command.strip(), note)
        for key, value in lms.get("test", {}).items():
            if key != "greedy":
                dev = f"; dev WER {lms['dev'][key]:.2f}%"
                append(f"human.prompts.finetuned{tag}.lm.{key}_wer", round(value, 2), "%", command.strip(), note + dev)


if __name__ == "__main__":
    main()
