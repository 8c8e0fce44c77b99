"""Decoding accuracy and speed of ASR archives (CTC or transducer) on a test manifest, per strategy.

    python benchmarks/asr_decoding.py speechtrain_experiments/asr_tdt_demo/*/asr_tdt_demo.stm \\
        speechtrain_experiments/asr_demo/*/asr_demo.stm --audio builtin:espeak/test --strategies greedy beam

    python benchmarks/asr_decoding.py speechtrain_experiments/asr_demo/*/asr_demo.stm --audio builtin:speech/dev \\
        --limit 200 --strategies greedy beam --lm 0.3,1.5,8 1.0,1,4     # an LM weight / word score / beam sweep

    python benchmarks/asr_decoding.py <archive> --audio builtin:speech/train --limit 400 --strategies greedy \\
        --decoder-type ctc        # how well it fits its training data; a hybrid model's CTC head alone

Prints one row per (archive, strategy[, LM setting]): WER, CER, RTFx (audio seconds per second of transcription,
batched by duration as the transcription CLI does, model loading excluded) and, for transducers' greedy decoding,
the mean encoder frames advanced per decoder step (RNN-T: below 1; TDT: above 1 when it skips frames).
"""

import argparse
import time

from speechtrain.asr.ctc import resolve_manifest
from speechtrain.asr.transcribe import collect_inputs, transcribe_paths
from speechtrain.common import metrics
from speechtrain.core.model import SpeechModel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+")
    parser.add_argument("--audio", default="builtin:espeak/test", help="a NeMo manifest or builtin:<corpus>/<split>")
    parser.add_argument("--strategies", nargs="+", default=["greedy", "beam"])
    parser.add_argument("--batch-duration", type=float, default=300.0)
    parser.add_argument("--limit", type=int, default=None, help="only the manifest's first N utterances")
    parser.add_argument("--decoder-type", default=None, choices=["transducer", "ctc"],
                        help="a hybrid archive's head to decode with (default: the archive's own)")  # fmt: skip
    parser.add_argument("--lm", nargs="+", default=[], metavar="WEIGHT,WORD_SCORE,BEAM",
                        help="beam search settings to compare (default: the archive's own)")  # fmt: skip
    args = parser.parse_args(argv)
    inputs = collect_inputs(resolve_manifest(args.audio))[: args.limit]
    settings = [tuple(float(x) for x in spec.split(",")) for spec in args.lm]
    runs = [(s, None) for s in args.strategies if s != "beam" or not settings]
    runs += [("beam", setting) for setting in settings if "beam" in args.strategies]
    print("| archive | strategy | WER / CER | RTFx | frames per decoder step |\n|---|---|---|---|---|")
    for archive in args.archives:
        for strategy, setting in runs:
            decoding = {"strategy": strategy}
            if setting is not None:
                decoding.update(lm_weight=setting[0], word_score=setting[1], beam_size=int(setting[2]))
                strategy = f"beam (LM {setting[0]:g}, word score {setting[1]:g}, beam {int(setting[2])})"
            override = {"decoding": decoding}
            if args.decoder_type:
                override["decoder_type"] = args.decoder_type
            model = SpeechModel.restore_from(archive, override_config=override).eval()
            steps = getattr(model, "decode_steps", None)
            if steps is not None:
                steps.zero_()
            start = time.perf_counter()
            rows = transcribe_paths(model, inputs, args.batch_duration, None)
            seconds = time.perf_counter() - start
            done = [r for r in rows if r["pred_text"] is not None and isinstance(r.get("text"), str)]
            hyps, refs = [r["pred_text"] for r in done], [r["text"] for r in done]
            word_errors, words = metrics.word_errors(hyps, refs)
            char_errors, chars = metrics.char_errors(hyps, refs)
            errors = f"{100 * word_errors / max(words, 1):.2f}% / {100 * char_errors / max(chars, 1):.2f}%"
            rtfx = f"{sum(float(r['duration']) for r in rows if r['pred_text'] is not None) / seconds:.1f}"
            per_step = "-"
            if steps is not None and strategy == "greedy" and getattr(model.cfg, "decoder_type", "") == "transducer":
                per_step = f"{model.decoding_frames_per_step():.2f}"
            print(f"| {archive} | {strategy} | {errors} | {rtfx} | {per_step} |", flush=True)


if __name__ == "__main__":
    main()
