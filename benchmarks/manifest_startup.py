"""Start-up time and peak memory of training data loading from a very large NeMo manifest.

    python benchmarks/manifest_startup.py [--lines 1000000] [--eager-lines 100000]

Writes a manifest of ``--lines`` lines (durations 1-20 s, transcripts of 8-20 words, all pointing at 8 generated
WAV files), then in a fresh process for each measurement builds the training loader as a training job does
(duration bucketing, 30 buckets with bins estimated from the data, 120 s batches, DP rank 0 of 8) and takes the
first batch. Reports the seconds from the start of loading to the first batch, and the process's peak RSS above
what the imports alone take. For comparison, the same for the previous eager reading (the whole manifest read into
a list of cuts first) on ``--eager-lines`` lines.
"""

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = "the of and to a in is was he for it with as his on be at by i this had not are but from".split()


def write_manifest(path: Path, lines: int, audio_dir: Path) -> None:
    import numpy as np
    import soundfile as sf

    audio_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(8):
        file = audio_dir / f"{i}.wav"
        sf.write(file, 0.1 * np.random.default_rng(i).standard_normal(16000 * 20).astype("float32"), 16000)
        files.append(str(file))
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(lines):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 20)))
            record = {"audio_filepath": files[i % 8], "duration": round(rng.uniform(1.0, 20.0), 2), "text": text}
            f.write(json.dumps(record) + "\n")


def measure(manifest: str, eager: bool) -> dict:
    """Runs in a fresh process: loader start-up time and peak RSS."""
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.data.cut_datasets import AsrCutDataset
    from speechtrain.data.lhotse_loader import get_lhotse_dataloader_from_config

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cfg = {"manifest_filepath": manifest, "batch_duration": 120.0, "num_buckets": 30, "max_duration": 20.0}
    cuts = None
    if eager:
        from lhotse import CutSet

        from speechtrain.data.lhotse_loader import loader_config, read_cuts

        cuts = CutSet.from_cuts(list(read_cuts(loader_config(cfg))))
    tokenizer = CharTokenizer([" ", *"abcdefghijklmnopqrstuvwxyz'"])
    loader = get_lhotse_dataloader_from_config(cfg, 0, 8, AsrCutDataset(tokenizer), cuts=cuts)
    batch = next(iter(loader))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "peak_rss_mib": peak / 1024, "above_imports_mib": (peak - base) / 1024,
            "batch": len(batch["ids"])}  # fmt: skip


def run(manifest: Path, eager: bool) -> dict:
    code = f"import json, benchmarks.manifest_startup as m; print(json.dumps(m.measure({str(manifest)!r}, {eager})))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--eager-lines", type=int, default=100_000)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = []
        for lines, eager in ((args.eager_lines, True), (args.eager_lines, False), (args.lines, False)):
            manifest = Path(tmp) / f"manifest_{lines}.json"
            if not manifest.exists():
                start = time.perf_counter()
                write_manifest(manifest, lines, Path(tmp) / "audio")
                size = manifest.stat().st_size / 2**20
                print(f"wrote {lines:,} lines ({size:.0f} MiB) in {time.perf_counter() - start:.0f} s", flush=True)
            result = run(manifest, eager)
            rows.append((lines, "eager (list of cuts)" if eager else "lazy", result))
        print("\n| manifest lines | reading | first batch after | peak RSS | RSS above imports |")
        print("|---|---|---|---|---|")
        for lines, how, r in rows:
            print(f"| {lines:,} | {how} | {r['seconds']:.1f} s | {r['peak_rss_mib']:.0f} MiB | "
                  f"{r['above_imports_mib']:.0f} MiB |")  # fmt: skip


if __name__ == "__main__":
    main()
