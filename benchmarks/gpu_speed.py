"""Training throughput of the demo ASR models on one GPU: fp32 against bf16-mixed, at the CPU demo's global batch
(60 s of audio) and at a GPU-sized one.

    python benchmarks/gpu_speed.py [--recipes asr_train_hybrid asr_train] [--batch-durations 60 600] [--steps 60]

The CPU figures in the README come from the built-in speech corpus, which needs eSpeak NG, Piper and Festival; a GPU
node without a package registry has none of them. Here the utterances are DTMF digits concatenated into 2-10 s files
(``benchmarks/long_audio.py``'s corpus), about the speech corpus's lengths, with a 12-symbol character vocabulary:
the step's cost depends on the frames and the label lengths, not on what the audio says (the speech recipes' 64 BPE
pieces make a slightly wider joint than 12 characters). Each setting runs ``examples/asr_train.py`` (that recipe,
one process, no validation) for ``--steps`` optimizer steps and reports the model's own audio-seconds per second
(the mean over the second half of the steps, as ``benchmarks/asr_train_speed.py``), the step time that implies and the
peak GPU memory of the run (telemetry's ``gpu_max_memory_gib``). ``--accelerator cpu`` runs the same on the CPU.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from asr_train_speed import train_speed  # noqa: E402
from long_audio import corpus, write_manifest  # noqa: E402


def speed_data(folder: Path, files: int, accelerator: str, num_workers: int, seed: int = 0) -> tuple[str, ...]:
    """``files`` DTMF files of 2-10 s (uniform) and a character tokenizer written to ``folder``, and the
    ``examples/asr_train.py`` overrides that train on them with greedy decoding on ``accelerator``."""
    from speechtrain.common.tokenizers import CharTokenizer

    lengths = np.random.default_rng(seed).uniform(2.0, 10.0, size=files).tolist()
    pieces = int(sum(lengths) / 1.2) + 50  # a DTMF utterance and its pause: ~1.4 s
    manifest = write_manifest(corpus(folder, pieces, seed, lengths), folder / "manifest.json")
    tokenizer = folder / "chars.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    return (f"model.train_ds.manifest_filepath={manifest}", "model.train_ds.input_cfg=null",
            f"model.validation_ds.manifest_filepath={manifest}", f"model.tokenizer.path={tokenizer}",
            f"trainer.accelerator={accelerator}", f"model.train_ds.num_workers={num_workers}",
            "model.decoding.strategy=greedy")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=["asr_train_hybrid", "asr_train"])
    parser.add_argument("--precisions", nargs="+", default=["32", "bf16-mixed"])
    parser.add_argument("--batch-durations", nargs="+", type=float, default=[60.0, 600.0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--files", type=int, default=600, help="files in the generated corpus (~6 s each)")
    parser.add_argument("--num-workers", type=int, default=4, help="data loader workers")
    parser.add_argument("--accelerator", default="gpu")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        data = speed_data(Path(folder), args.files, args.accelerator, args.num_workers)
        print("| recipe | precision | global batch (s of audio) | training audio-s/s | step (ms) | peak GPU GiB |")
        print("|---|---|---|---|---|---|")
        for recipe in args.recipes:
            for batch in args.batch_durations:
                for precision in args.precisions:
                    last: dict = {}
                    try:
                        speed = train_speed(None, 1, args.steps, precision, recipe, extra=data, batch_duration=batch,
                                            last_interval=last)  # fmt: skip
                    except RuntimeError as error:  # one setting failing (memory, say) leaves the others to run
                        print(f"| {recipe} | {precision} | {batch:.0f} | failed: {str(error)[-300:]!r} | | |")
                        continue
                    memory = last.get("gpu_max_memory_gib", "-")
                    print(f"| {recipe} | {precision} | {batch:.0f} | {speed:.0f} | {1000 * batch / speed:.0f} | "
                          f"{memory} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
