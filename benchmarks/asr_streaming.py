"""Greedy WER of a cache-aware streaming model per trained look-ahead, with the latency each implies.

    python benchmarks/asr_streaming.py --model run/asr_streaming_demo.stm [--manifest builtin:speech/test] \\
        [--limit 200] [--streamed 20] [--record]

For each ``att_context_size`` the model was trained with: the corpus WER of the greedy decode with that context
(offline limited-context decoding, batched), and for the first ``--streamed`` utterances the streaming
transcriber's final hypotheses, which must equal the offline ones (the run stops if one differs). The latency is
:func:`speechtrain.asr.streaming.latency_seconds` with one attention chunk per step. With ``--record``, each
context's WER is appended to results/demo.jsonl as ``demo.streaming.greedy_wer.left<L>_right<R>`` (the latency in
its note).
"""

import argparse
import sys
from pathlib import Path

import soundfile as sf

from speechtrain.asr.ctc import resolve_manifest
from speechtrain.asr.streaming import StreamingTranscriber, latency_seconds
from speechtrain.common.metrics import error_rate, format_rate, word_errors
from speechtrain.core.model import SpeechModel
from speechtrain.data.manifest import read_nemo_manifest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append  # noqa: E402


def _streamed(model, path: str, context: list[int]) -> str:
    stream = StreamingTranscriber(model, context)
    audio, _ = sf.read(path, dtype="float32")
    step = stream.encoder.chunk * stream.encoder.factor * model.preprocessor.hop
    for start in range(0, len(audio), step):
        stream.push(audio[start : start + step])
    return stream.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a streaming model archive (.stm)")
    parser.add_argument("--manifest", default="builtin:speech/test", help="NeMo manifest or builtin:<corpus>/<split>")
    parser.add_argument("--limit", type=int, default=None, help="first N utterances only")
    parser.add_argument("--streamed", type=int, default=20, help="utterances also streamed chunk by chunk")
    parser.add_argument("--record", action="store_true", help="append the WERs to results/demo.jsonl")
    args = parser.parse_args(argv)
    model = SpeechModel.restore_from(args.model).eval()
    rows = read_nemo_manifest(resolve_manifest(args.manifest))[: args.limit]
    files, refs = [r["audio_filepath"] for r in rows], [r["text"] for r in rows]
    norm = model.text_normalizer  # the model's WER normalisation, as its validation uses
    print("| att_context_size | latency (ms) | greedy WER | streamed = offline |")
    print("|---|---|---|---|")
    for context in [list(c) for c in model.encoder.contexts]:
        model.encoder.set_context(context)
        hyps = model.transcribe(files, batch_size=16, strategy="greedy")
        same = sum(_streamed(model, f, context) == h for f, h in zip(files[: args.streamed], hyps))
        if same != min(args.streamed, len(files)):
            sys.exit(f"att_context_size={context}: {same} streamed hypotheses of {args.streamed} equal the offline.")
        errors, words = word_errors([norm(h) for h in hyps], [norm(r) for r in refs])
        wer, latency = 100 * error_rate(errors, words), 1000 * latency_seconds(model)
        print(f"| {context} | {latency:.0f} | {format_rate(wer / 100)} | {same}/{same} |")
        if args.record:
            append(f"demo.streaming.greedy_wer.left{context[0]}_right{context[1]}", round(wer, 2), "%",
                   f"python benchmarks/asr_streaming.py --model <asr_streaming_demo.stm> --manifest {args.manifest}"
                   + (f" --limit {args.limit}" if args.limit else ""),
                   note=f"latency {latency:.0f} ms (one attention chunk per step); {len(files)} utterances; "
                   f"{Path(args.model).parent.name}")  # fmt: skip


if __name__ == "__main__":
    main()
