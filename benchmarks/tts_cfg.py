"""Intelligibility and speed of TTS archives with and without classifier-free guidance, judged by an ASR model.

    python benchmarks/tts_cfg.py --asr asr_demo.stm --teacher tts_demo.stm [--student tts_cfg_distill.stm] \
        [--sentences 50] [--manifest builtin:espeak-tts/test] [--scales 1 2.5]

For the teacher at each guidance scale, and the student without guidance, it synthesises the same held-out
sentences (the same seed) and prints a JSON line per case: the ASR's CER and WER against the input texts, the
real-time factor (synthesis seconds per audio second on this machine, codec decoding included) and the decoder
passes per frame (2 with guidance, 1 without).
"""

import argparse
import json
import time

import torch

import speechtrain.tts.model  # noqa: F401  (registers the TTS class the archives name)
from speechtrain.core.model import SpeechModel
from speechtrain.tts.codec import manifest_rows
from speechtrain.tts.synthesize import intelligibility


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--asr", required=True, help="ASR archive that judges the speech")
    parser.add_argument("--teacher", required=True, help="TTS archive (guided)")
    parser.add_argument("--student", help="CFG-distilled TTS archive (run without guidance)")
    parser.add_argument("--manifest", default="builtin:espeak-tts/test")
    parser.add_argument("--sentences", type=int, default=50)
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.5], help="teacher guidance scales")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    asr = SpeechModel.restore_from(args.asr).eval()
    texts = [row["text"] for row in manifest_rows(args.manifest, args.sentences)]
    cases = [("teacher", args.teacher, scale) for scale in args.scales]
    if args.student:
        cases.append(("student", args.student, 1.0))
    for name, path, scale in cases:
        model = SpeechModel.restore_from(path).eval()
        start = time.perf_counter()
        _, report = intelligibility(model, texts, asr, args.batch_size, guidance_scale=scale)
        report.pop("examples", None)
        print(json.dumps({"model": name, "archive": path, "guidance_scale": scale, "threads": torch.get_num_threads(),
                          **{k: round(v, 4) if isinstance(v, float) else v for k, v in report.items()},
                          "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
