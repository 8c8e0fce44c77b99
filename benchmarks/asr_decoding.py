"""Decoding accuracy and speed of ASR archives (CTC or transducer) on a test manifest, per strategy.

    python benchmarks/asr_decoding.py speechtrain_experiments/asr_tdt_demo/*/asr_tdt_demo.stm \\
        speechtrain_experiments/asr_demo/*/asr_demo.stm --audio builtin:espeak/test --strategies greedy beam

Prints one row per (archive, strategy): WER, CER, RTFx (audio seconds per second of transcription, batched by
duration as the transcription CLI does, model loading excluded) and, for transducers' greedy decoding, the mean
encoder frames advanced per decoder step (RNN-T: below 1; TDT: above 1 when it skips frames).
"""

import argparse
import time

from speechtrain.asr import metrics
from speechtrain.asr.ctc import resolve_manifest
from speechtrain.asr.transcribe import transcribe_paths
from speechtrain.core.model import SpeechModel


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+")
    parser.add_argument("--audio", default="builtin:espeak/test", help="a NeMo manifest or builtin:<corpus>/<split>")
    parser.add_argument("--strategies", nargs="+", default=["greedy", "beam"])
    parser.add_argument("--batch-duration", type=float, default=300.0)
    args = parser.parse_args(argv)
    manifest = resolve_manifest(args.audio)
    print("| archive | strategy | WER / CER | RTFx | frames per decoder step |\n|---|---|---|---|---|")
    for archive in args.archives:
        model = SpeechModel.restore_from(archive).eval()
        for strategy in args.strategies:
            model.cfg.decoding.strategy = strategy
            steps = getattr(model, "decode_steps", None)
            if steps is not None:
                steps.zero_()
            start = time.perf_counter()
            rows = transcribe_paths(model, manifest, args.batch_duration, None)
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
