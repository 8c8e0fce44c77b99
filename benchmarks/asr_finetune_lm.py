"""Which beam-search LM after a fine-tune on few new transcripts: the archive's, one fitted on the new transcripts,
their interpolation, or none (greedy).

    python benchmarks/asr_finetune_lm.py --base asr_demo.stm [--minutes 8] [--tuned tuned.stm] [--record]

The small fine-tune set, from the built-in corpus: a voice family the demo never trains on (Flite), 400 utterances of
sentences no other split reads (``builtin:speech/heldout_engine_train``) to fine-tune on, and the 400 Flite
utterances of test sentences (``builtin:speech/heldout_engine``) split in two, alternate rows: ``dev`` (validation,
where the default decoding is chosen) and ``test``. New transcripts and test sentences differ, as a speaker's 450
prompts and her other prompts do.

1. Fine-tunes ``--base`` with ``examples/asr_finetune.py`` for ``--minutes`` on 2 processes (skipped with
   ``--tuned``), with its default LM (what the closing report then says it used).
2. Decodes dev and test with the fine-tuned model: greedy, and beam search without an LM (``none``) and with each LM:
   the archive's, one fitted on the 400 new transcripts alone, and their interpolations (``--weights``: the new
   LM's weight).
3. Prints the WER table; ``--record`` appends greedy and beam + LM test WERs to results/finetune.jsonl.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speechtrain.asr.jobs import mix_weight  # noqa: E402
from speechtrain.asr.ngram import NgramLM, interpolate  # noqa: E402
from speechtrain.common.metrics import word_error_rate  # noqa: E402
from speechtrain.core.model import SpeechModel  # noqa: E402
from speechtrain.corpora.builtin import resolve_manifest  # noqa: E402
from speechtrain.data.manifest import read_nemo_manifest  # noqa: E402

TRAIN = "builtin:speech/heldout_engine_train"
HELD = "builtin:speech/heldout_engine"


def small_set(out: Path) -> dict[str, Path]:
    """dev and test manifests (alternate rows of the held-out engine's test sentences, absolute audio paths)."""
    held = resolve_manifest(HELD)
    rows = [
        dict(r, audio_filepath=str((held.parent / r["audio_filepath"]).resolve())) for r in read_nemo_manifest(held)
    ]
    paths = {}
    for name, part in (("dev", rows[0::2]), ("test", rows[1::2])):
        paths[name] = out / f"{name}.json"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in part))
    return paths


def finetune(base: Path, train: str | Path | list[dict], dev: Path, minutes: float, out: Path, overrides=()) -> Path:
    """``base`` fine-tuned on ``train`` (a manifest, or ``input_cfg`` sources) for ``minutes`` on 2 processes
    (``examples/asr_finetune.py``, ``dev`` validating, ``overrides`` after); prints its decoding report and returns
    its archive."""
    if isinstance(train, list):
        from leave_one_out import hydra_list

        data = f"model.train_ds.input_cfg={hydra_list(train)}"
    else:
        data = f"model.train_ds.manifest_filepath={train}"
    command = [
        sys.executable, str(ROOT / "examples" / "asr_finetune.py"), f"init_from.path={base}",
        data, f"model.validation_ds.manifest_filepath={dev}",
        "trainer.devices=2", f"trainer.max_time={{minutes: {minutes}}}", f"exp_manager.exp_dir={out / 'exp'}",
        "trainer.enable_progress_bar=false", *overrides,
    ]  # fmt: skip
    done = subprocess.run(command, env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}, text=True, check=False,
                          capture_output=True)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-4000:])
    (tuned,) = (out / "exp").glob("*/*/asr_finetune.stm")
    print((tuned.parent / "decoding_report.md").read_text(encoding="utf-8"), flush=True)
    return tuned


def encoder_outputs(model, rows: list[dict], batch: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    order = sorted(range(len(rows)), key=lambda i: -rows[i]["duration"])
    outputs = []
    with torch.inference_mode():
        for start in range(0, len(order), batch):
            index = order[start : start + batch]
            padded, lens = next(model._audio_batches([rows[i]["audio_filepath"] for i in index], len(index)))
            outputs.append((index, *model(padded, lens)))
    return outputs


def decode(model, outputs, count: int, strategy: str) -> list[str]:
    texts = [""] * count
    with torch.inference_mode():
        for index, enc, lengths in outputs:
            for i, text in zip(index, model.decode(enc, lengths, strategy), strict=True):
                texts[i] = text
    return texts


def lm_table(base_path: Path, tuned: Path, train: Path, sets: dict[str, Path], weights: str, tmp: Path):
    """WER (%) per set and decoding of ``tuned``: greedy, and beam search with no LM, ``base_path``'s LM, one fitted
    on ``train``'s transcripts and their interpolations (``weights``: the new LM's, comma-separated; ``auto``: the
    fine-tuning rule's); prints the table."""
    base = SpeechModel.restore_from(base_path)  # kept alive: its LM artifact is read below
    archive_lm = NgramLM.read_arpa(base.cfg.decoding.lm_path)
    order = archive_lm.order
    texts = [r["text"] for r in read_nemo_manifest(train)]
    new_lm = NgramLM.fit(texts, order=order)
    lms = {"archive": archive_lm, "new": new_lm}
    sentences = sum(1 for text in texts if text.split())
    for given in [w for w in weights.split(",") if w]:
        weight = mix_weight(sentences) if given == "auto" else float(given)
        name = "auto" if given == "auto" else f"mix{weight:g}".replace(".", "_")
        lms[name] = interpolate([(archive_lm, 1.0 - weight), (new_lm, weight)])
    paths = {"none": None, **{name: lm.write_arpa(tmp / f"{name}.arpa") for name, lm in lms.items()}}
    model = SpeechModel.restore_from(tuned, override_config={"decoding": {"strategy": "beam"}}).eval()
    norm = model.text_normalizer
    table: dict[str, dict[str, float]] = {}
    for name, manifest in sets.items():
        rows = read_nemo_manifest(manifest)
        refs = [norm(r["text"]) for r in rows]
        outputs = encoder_outputs(model, rows)
        results = {"greedy": decode(model, outputs, len(rows), "greedy")}
        for lm_name, path in paths.items():
            model.cfg.decoding.lm_path = str(path) if path else None
            model._beam = model._transducer_beam = None  # the next beam search reads this LM
            start = time.perf_counter()
            results[lm_name] = decode(model, outputs, len(rows), "beam")
            print(f"{name} {lm_name}: {time.perf_counter() - start:.0f} s", flush=True)
        table[name] = {k: 100 * word_error_rate([norm(t) for t in v], refs) for k, v in results.items()}
    words = {"none": 0, **{name: len(lm.known) - 3 for name, lm in lms.items()}}
    print("\n| decoding | LM words | dev WER | test WER |\n|---|---|---|---|")
    for key in table["dev"]:
        lm_words = f"{words[key]:,}" if words.get(key) else ""
        print(f"| {key} | {lm_words} | {table['dev'][key]:.2f}% | {table['test'][key]:.2f}% |")
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, type=Path, help="the archive fine-tuned (make demo's)")
    parser.add_argument("--tuned", type=Path, help="its fine-tuned archive (skips the fine-tune)")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument(
        "--weights",
        default="auto,0.1,0.3,0.5,0.8",
        help="the new-transcript LM's weights in the mixes; auto: the fine-tuning rule's, n / (n + N0)",
    )
    parser.add_argument("--record", action="store_true", help="append the test figures to results/finetune.jsonl")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sets = small_set(tmp)
        extra = ["model.train_ds.batch_duration=30", "trainer.max_epochs=null", "trainer.check_val_every_n_epoch=1000"]
        tuned = args.tuned or finetune(args.base.resolve(), TRAIN, sets["dev"], args.minutes, tmp, extra)
        table = lm_table(args.base, tuned, resolve_manifest(TRAIN), sets, args.weights, tmp)
        if args.record:
            from results import append

            command = f"python benchmarks/asr_finetune_lm.py --base <asr_demo.stm> --minutes {args.minutes:g}"
            note = ("demo archive fine-tuned on 400 Flite utterances (heldout_engine_train), test: 200 Flite "
                    "utterances of other sentences; dev WER ")  # fmt: skip
            for key, value in table["test"].items():
                figure = "finetune.greedy_wer.test" if key == "greedy" else f"finetune.beam_lm_wer.{key}.test"
                append(figure, round(value, 2), "%", command, note + f"{table['dev'][key]:.2f}%")


if __name__ == "__main__":
    main()
