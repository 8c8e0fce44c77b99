"""The moving average of the weights against the live weights of the same run (``exp_manager.ema``): greedy WER
(no LM, no lexicon) of the run's archive, which holds the average, and of its last checkpoint, which holds the
live weights of the same step, on the same sets.

    python benchmarks/asr_ema.py --run speechtrain_experiments/asr_demo/<run folder> \
        [--sets builtin:speech/dev builtin:speech/test builtin:speech/heldout_engine]

One process, with torch's default threads; run it when no training is running.
"""

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run folder trained with exp_manager.ema.enable=true")
    sets = ["builtin:speech/dev", "builtin:speech/test", "builtin:speech/heldout_engine"]
    parser.add_argument("--sets", nargs="+", default=sets)
    args = parser.parse_args(argv)

    from speechtrain.asr.ctc import resolve_manifest
    from speechtrain.asr.jobs import restore_for_finetuning
    from speechtrain.asr.report import greedy_transcripts
    from speechtrain.common.metrics import error_rate, format_rate, word_errors
    from speechtrain.core.model import SpeechModel
    from speechtrain.data.manifest import read_nemo_manifest

    run = Path(args.run)
    (archive,) = run.glob("*.stm")
    (last,) = (run / "checkpoints").glob("*--last.ckpt")
    models = {"moving average (archive)": SpeechModel.restore_from(archive), "live weights (last.ckpt)":
              restore_for_finetuning(last)}  # fmt: skip
    sets = [(name.split("/")[-1], read_nemo_manifest(Path(resolve_manifest(name)))) for name in args.sets]
    print(f"run {run}\n\n| weights | " + " | ".join(name for name, _ in sets) + " |")
    print("|---" * (len(sets) + 1) + "|")
    for label, model in models.items():
        model.eval()
        norm = model.text_normalizer
        cells = []
        for _, records in sets:
            hyps = greedy_transcripts(model, records)
            refs = [norm(r["text"]) for r in records]
            cells.append(format_rate(error_rate(*word_errors([norm(h) for h in hyps], refs))))
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
