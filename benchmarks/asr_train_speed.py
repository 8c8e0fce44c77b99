"""Training throughput of the ASR models on this machine, and transcription speed.

    python benchmarks/asr_train_speed.py                      # debug and small, 1 process and DP=2, RTFx
    python benchmarks/asr_train_speed.py --sizes demo --steps 40 --precisions 32 bf16-mixed
    python benchmarks/asr_train_speed.py --recipe asr_train_hybrid --init-from <make demo archive> --steps 100 \
        --repeats 2 --preload /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4   # a recipe, with/without a preload
    python benchmarks/asr_train_speed.py --recipe asr_train_hybrid --steps 120 --repeats 2 \
        --variant model.encoder.subsampling_conv_channels=32             # a recipe, with/without some overrides

Training: ``examples/asr_train.py`` on the built-in eSpeak corpus for ``--steps`` optimizer steps (no validation),
reading the model's own ``audio_s_per_s`` (audio-seconds per wall-second over all data-parallel ranks) from the
run's metrics.csv, averaged over the second half of the steps. ``demo`` is the default config of the example
(the `make demo-ctc` model); the others are ``model.size=<name>``. The global batch is 60 s of audio either way.

``--recipe``: that config of ``examples/conf`` as ``make demo`` runs it (2 DP processes, 30 s per process), from
``--init-from``'s weights (a trained model runs at its own speed: a transducer's loss lattice, for one, computes
differently once the model is confident), ``--repeats`` runs taking turns with and without ``--preload`` (a library
put in ``LD_PRELOAD``, e.g. tcmalloc), or with and without the ``--variant`` overrides.

Transcription: ``speechtrain.asr.transcribe.transcribe_paths`` on 300 utterances of the corpus's test split,
RTFx = audio seconds / wall seconds (model loading excluded).
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train_speed(size: str | None, devices: int, steps: int, precision: str, recipe: str | None = None,
                init_from: str | None = None, preload: str | None = None, extra: tuple[str, ...] = (),
                batch_duration: float = 60.0, last_interval: dict | None = None) -> float:  # fmt: skip
    """Audio-s/s of one run (``batch_duration``: the global batch in seconds of audio); ``last_interval``, when
    given, receives the run's last telemetry ``train_interval`` record."""
    with tempfile.TemporaryDirectory() as exp:
        overrides = [
            f"trainer.devices={devices}", f"trainer.max_steps={steps}", "trainer.max_time=null",
            f"trainer.precision={precision}", "+trainer.limit_val_batches=0", "trainer.enable_progress_bar=false",
            f"model.train_ds.batch_duration={batch_duration / devices}", f"exp_manager.exp_dir={exp}",
            "trainer.log_every_n_steps=1",
        ]  # fmt: skip
        if recipe:
            overrides += ["--config-name", recipe]
        if init_from:
            overrides.append(f"init_from.path={init_from}")
        if size:
            overrides.append(f"model.size={size}")
        overrides += extra
        if size == "debug":  # 2 layers: too shallow for the demo's intermediate CTC taps and half-rate layers
            from speechtrain.asr.ctc import INTERCTC_OFF, UNET_OFF

            overrides += [*INTERCTC_OFF, *UNET_OFF]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        if preload:
            env["LD_PRELOAD"] = preload
        command = [sys.executable, str(ROOT / "examples" / "asr_train.py"), *overrides]
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-3000:])
        (metrics,) = Path(exp).glob("*/*/metrics.csv")
        with open(metrics) as handle:
            speeds = [float(row["audio_s_per_s"]) for row in csv.DictReader(handle) if row.get("audio_s_per_s")]
        if last_interval is not None:
            (telemetry,) = Path(exp).glob("*/*/telemetry.jsonl")
            records = [json.loads(line) for line in telemetry.read_text().splitlines()]
            last_interval.update([r for r in records if r["event"] == "train_interval"][-1])
        tail = speeds[len(speeds) // 2 :]
        return sum(tail) / len(tail)


def transcription_rtfx(size: str, count: int = 300) -> float:
    import torch
    from omegaconf import OmegaConf

    from speechtrain.asr.ctc import ConformerCTCModel
    from speechtrain.asr.jobs import ensure_tokenizer
    from speechtrain.asr.transcribe import transcribe_paths
    from speechtrain.corpora.builtin import resolve_manifest
    from speechtrain.data.manifest import read_nemo_manifest

    cfg = OmegaConf.load(ROOT / "examples" / "conf" / "asr_train.yaml").model
    cfg.size = size
    ensure_tokenizer(cfg.tokenizer, cfg.train_ds.manifest_filepath)
    torch.manual_seed(0)
    model = ConformerCTCModel(cfg)
    model.configure_model()
    records = read_nemo_manifest(resolve_manifest("builtin:espeak/test"))[:count]
    transcribe_paths(model, records[:20])  # warm-up
    start = time.perf_counter()
    rows = transcribe_paths(model, records)
    wall = time.perf_counter() - start
    return sum(r["duration"] for r in rows) / wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["debug", "demo", "small"])
    parser.add_argument("--devices", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--precisions", nargs="+", default=["32"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--recipe", help="a config of examples/conf, run as make demo runs it (2 processes)")
    parser.add_argument("--init-from", help="start --recipe from this archive's weights")
    parser.add_argument("--preload", help="with --recipe: also run with this library in LD_PRELOAD (e.g. tcmalloc)")
    parser.add_argument("--repeats", type=int, default=1, help="with --recipe: runs per setting, taking turns")
    parser.add_argument(
        "--variant",
        nargs="+",
        default=[],
        metavar="OVERRIDE",
        help="with --recipe: also run with these config overrides (then --preload applies to both)",
    )
    args = parser.parse_args(argv)
    if args.recipe:
        if args.variant:  # the recipe against the recipe with the overrides, both with --preload if given
            settings = [(args.preload, ()), (args.preload, tuple(args.variant))]
        else:  # the recipe without and with --preload
            settings = [(None, ()), (args.preload, ())] if args.preload else [(None, ())]
        print("| recipe | LD_PRELOAD | overrides | run | training audio-s/s |")
        print("|---|---|---|---|---|")
        for run in range(args.repeats):
            for preload, extra in settings:
                speed = train_speed(None, 2, args.steps, "32", args.recipe, args.init_from, preload, extra)
                print(f"| {args.recipe} | {preload or '-'} | {' '.join(extra) or '-'} | {run + 1} | {speed:.1f} |",
                      flush=True)  # fmt: skip
        return
    print("| model | processes | precision | training audio-s/s | transcription RTFx (1 process) |")
    print("|---|---|---|---|---|")
    for size in args.sizes:
        rtfx = transcription_rtfx(size)
        for devices in args.devices:
            for precision in args.precisions:
                speed = train_speed(size, devices, args.steps, precision)
                print(f"| {size} | {devices} | {precision} | {speed:.1f} | {rtfx:.0f} |", flush=True)


if __name__ == "__main__":
    main()
