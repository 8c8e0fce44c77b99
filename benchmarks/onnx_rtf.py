"""Offline transcription speed: onnx-asr (ONNX Runtime) on our ONNX export vs our PyTorch transcription, same files,
same batches, greedy decoding, on this machine's CPUs.

    python benchmarks/onnx_rtf.py [--model model.stm] [--train-seconds 150] [--files 24] [--seconds 12] [--record]

Without ``--model``, a small hybrid TDT-CTC FastConformer with NeMo's front-end (``preprocessor.kind=nemo``, 80 mel
bands: what onnx-asr computes) is trained first for ``--train-seconds`` (CPU) on generated DTMF-digit utterances,
so that the transcripts mean something and the transducer emits as many labels as a working model does (greedy
transducer decoding takes a step per label). The test files are other utterances concatenated into files of about
``--seconds`` seconds.

The model is exported with :func:`speechtrain.asr.export_onnx.export_onnx` (fp32, and int8 copies). Then, with
``--threads`` threads on both sides (default: every CPU this process may use), after one warm-up batch each:

- PyTorch: :func:`speechtrain.asr.transcribe.transcribe_paths` (what ``python -m speechtrain.asr.transcribe`` runs),
  batches of at most ``--batch-duration`` seconds, longest first;
- onnx-asr: ``recognize`` on the same batches of files, fp32 and int8;

for the transducer head and (hybrid models) the CTC head; onnx-asr with its NumPy features (its default on a CPU)
and with its ONNX features graph. With ``--size`` (default ``small``), an untrained CTC model of that size is timed
the same way, for the compute of a real model. RTFx is audio seconds per second of transcription (model loading
excluded), as the transcribe command reports it, from the fastest of ``--repeats`` passes (other processes on the
machine only ever add time). The WER of each run against the reference, and between onnx-asr's and PyTorch's
transcripts, is printed beside it. ``--record`` appends the RTFx figures to results/deployment.jsonl.
"""

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def corpus(folder: Path, utterances: int, seed: int, lengths: list[float]) -> list[dict]:
    """DTMF utterances concatenated into 16-bit WAV files of the given lengths (seconds), with their rows."""
    from long_audio import corpus as concatenated

    rows = concatenated(folder, utterances, seed, lengths)
    for row in rows:  # onnx-asr reads PCM WAV: the files are rewritten as 16-bit
        data, rate = sf.read(row["audio_filepath"], dtype="float32")
        sf.write(row["audio_filepath"], data, rate, subtype="PCM_16")
    return rows


def train_model(folder: Path, seconds: float) -> Path:
    """A small hybrid TDT-CTC FastConformer (NeMo's 80-band front-end) trained on DTMF files of 2-12 s."""
    from long_audio import write_manifest

    from speechtrain.asr.ctc import INTERCTC_OFF, UNET_OFF
    from speechtrain.asr.transducer import ConformerTransducerConfig
    from speechtrain.common.tokenizers import CharTokenizer
    from speechtrain.core.hydra_runner import compose_config
    from speechtrain.core.job import train_job_schema
    from speechtrain.lightning import CallbackGroup

    rng = np.random.default_rng(0)
    train = write_manifest(corpus(folder / "train", 2400, 1, list(rng.uniform(2, 12, 300))), folder / "train.json")
    dev = write_manifest(corpus(folder / "dev", 200, 2, list(rng.uniform(2, 12, 20))), folder / "dev.json")
    tokenizer = folder / "digits.json"
    CharTokenizer([" ", *"0123456789"]).save(tokenizer)
    budget = f"00:{int(seconds) // 3600:02d}:{int(seconds) % 3600 // 60:02d}:{int(seconds) % 60:02d}"  # DD:HH:MM:SS
    overrides = [
        f"exp_manager.exp_dir={folder / 'exp'}", "trainer.precision=32", f"trainer.max_time={budget}",
        "trainer.enable_progress_bar=false", "trainer.num_sanity_val_steps=0", f"model.tokenizer.path={tokenizer}",
        f"model.train_ds.manifest_filepath={train}", f"model.validation_ds.manifest_filepath={dev}",
        "model.train_ds.input_cfg=null", "model.hybrid=true", "model.joint.frame_stack=1",
        "model.preprocessor.kind=nemo", "model.preprocessor.n_mels=80", "model.spec_augment=null",
        "model.encoder.d_model=64", "model.encoder.num_layers=2", "model.encoder.num_heads=2",
        *INTERCTC_OFF,
        *UNET_OFF,
        "model.encoder.conv_kernel_size=15", "model.encoder.subsampling_conv_channels=32",
        "model.encoder.subsampling_factor=8", "model.prediction.pred_hidden=64", "model.joint.joint_hidden=64",
        "model.decoding.strategy=greedy", "model.decoding.lm_order=0", "model.train_ds.batch_duration=120",
        "model.train_ds.max_duration=30", "model.train_ds.num_workers=1", "model.optim.lr=3e-3",
        "model.optim.sched.warmup_steps=50", "name=onnx",
    ]  # fmt: skip
    cfg = compose_config(EXAMPLES / "conf", "asr_train_tdt", overrides, train_job_schema(ConformerTransducerConfig))
    import importlib.util

    spec = importlib.util.spec_from_file_location("asr_train", EXAMPLES / "asr_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(cfg)
    CallbackGroup.get_instance().callbacks.clear()
    return next((folder / "exp" / "onnx").glob("*/onnx.stm"))


def describe(model) -> str:
    """``hybrid TDT-CTC``, ``RNN-T`` ... and the encoder's width and depth."""
    cfg = model.cfg
    kind = "CTC" if "loss" not in cfg else {"tdt": "TDT", "rnnt": "RNN-T"}[cfg.loss] + ("-CTC" if cfg.hybrid else "")
    hybrid = "hybrid " if cfg.get("hybrid") else ""
    return f"{hybrid}{kind} Conformer (d_model {cfg.encoder.d_model}, {cfg.encoder.num_layers} layers)"


def timed(run, batches: list[list[dict]], repeats: int) -> tuple[float, list[str]]:
    """The fewest seconds ``run`` takes over ``batches`` in ``repeats`` passes (after one warm-up call on the first
    batch: other processes on the machine only ever add time) and its transcripts in row order."""
    run(batches[0])
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        texts = [text for batch in batches for text in run(batch)]
        best = min(best, time.perf_counter() - start)
    return best, texts


def _rate(hypotheses: list[str], references: list[str]) -> str:
    """The WER of ``hypotheses`` against ``references`` as a percentage (``-`` when the references have no word)."""
    from speechtrain.common import metrics

    if not any(r.split() for r in references):
        return "-"
    return f"{100 * metrics.word_error_rate(hypotheses, references):.2f}%"


# onnx-asr's two NeMo feature implementations: NumPy (its default on a CPU) and its ONNX graph
FEATURES = {"numpy": {"use_numpy_preprocessors": True}, "onnx": {"use_numpy_preprocessors": False}}
RUNS = [(None, "numpy"), (None, "onnx"), ("int8", "onnx")]  # (quantization, features) of the onnx-asr runs


def measure(model, folder: Path, batches: list[list[dict]], threads: int, repeats: int, name: str) -> list[tuple]:
    """Time ``model`` (PyTorch) and its export in ``folder`` (onnx-asr, :data:`RUNS`) on ``batches``, for each head;
    rows ``(label, figure, seconds, transcripts, PyTorch's transcripts or None)``."""
    import onnx_asr
    import onnxruntime as ort

    from speechtrain.asr.transcribe import transcribe_paths

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads

    def pytorch(batch: list[dict]) -> list[str]:
        out = transcribe_paths(model, [dict(r) for r in batch], batch_duration=None, chunk_len=None)
        return [r["pred_text"] for r in out]

    results = []
    for head in ["transducer", "ctc"] if model.cfg.get("hybrid") else [None]:
        if head:
            model.cfg.decoder_type = head
        kind = "ctc" if head == "ctc" or "loss" not in model.cfg else model.cfg.loss
        seconds, torch_texts = timed(pytorch, batches, repeats)
        results.append((f"{name}: PyTorch, {kind}", f"{name}.{kind}.pytorch", seconds, torch_texts, None))
        for quantization, features in RUNS:
            features_config = dict(FEATURES[features])
            asr = onnx_asr.load_model(f"nemo-conformer-{kind}", folder, quantization=quantization,
                                      sess_options=options, preprocessor_config=features_config)  # fmt: skip

            def onnx(batch: list[dict], asr=asr) -> list[str]:
                return asr.recognize([r["audio_filepath"] for r in batch])

            seconds, texts = timed(onnx, batches, repeats)
            weights = quantization or "fp32"
            label = f"{name}: onnx-asr {weights}, {features} features, {kind}"
            results.append((label, f"{name}.{kind}.onnx_asr_{weights}_{features}_features", seconds, texts,
                            torch_texts))  # fmt: skip
    return results


def untrained(size: str):
    """An untrained CTC Conformer of ``size`` (``model.size``) with NeMo's 80-band front-end: the compute of a real
    model (greedy CTC decoding costs the same whatever the weights)."""
    from speechtrain.asr.ctc import ConformerCTCModel

    torch.manual_seed(0)
    config = {"size": size, "tokenizer": {"vocab": [" ", *"0123456789"]},
              "preprocessor": {"kind": "nemo", "n_mels": 80}, "decoding": {"strategy": "greedy"}}  # fmt: skip
    model = ConformerCTCModel(config)
    model.configure_model()
    return model.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="an archive with preprocessor.kind=nemo (default: train one)")
    parser.add_argument("--train-seconds", type=float, default=150.0)
    parser.add_argument("--size", default="small", help="also time an untrained CTC model of this size ('' : none)")
    parser.add_argument("--files", type=int, default=24, help="test files")
    parser.add_argument("--seconds", type=float, default=12.0, help="length of each test file")
    parser.add_argument("--batch-duration", type=float, default=60.0, help="most seconds of audio per batch")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeats", type=int, default=5, help="timed passes over the files (the fastest counts)")
    parser.add_argument("--record", action="store_true", help="append the RTFx figures to results/deployment.jsonl")
    args = parser.parse_args(argv)
    from speechtrain.asr.export_onnx import export_onnx
    from speechtrain.asr.transcribe import plan_batches
    from speechtrain.core.model import SpeechModel

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = Path(args.model) if args.model else train_model(folder, args.train_seconds)
        models = [("trained", SpeechModel.restore_from(path, override_config={"decoding": {"strategy": "greedy"}}))]
        if args.size:
            models.append((f"untrained_{args.size}", untrained(args.size)))
        rows = corpus(folder / "test", int(args.files * args.seconds / 0.8) + 50, 11, [args.seconds] * args.files)
        order = plan_batches([r["duration"] for r in rows], args.batch_duration, None)
        batches = [[rows[i] for i in batch] for batch in order]
        refs = [rows[i]["text"] for batch in order for i in batch]
        audio = sum(r["duration"] for r in rows)
        results, notes = [], {}
        for name, model in models:
            model.eval()
            export_onnx(model, folder / name, quantize="int8")
            results += measure(model, folder / name, batches, args.threads, args.repeats, name)
            notes[name] = f"{model.num_parameters / 1e6:.2f}M-parameter {describe(model)}"
            print(f"{name}: {notes[name]}", flush=True)
        print(f"\n{len(rows)} files, {audio:.0f} s of audio, batches of at most {args.batch_duration:g} s, "
              f"{args.threads} threads; greedy decoding\n")  # fmt: skip
        print("| run | RTFx | WER | WER against PyTorch's transcripts |\n|---|---|---|---|")
        for label, _, seconds, texts, reference in results:
            agree = "" if reference is None else _rate(texts, reference)
            print(f"| {label} | {audio / seconds:.1f} | {_rate(texts, refs)} | {agree} |")
        if args.record:
            from results import append

            command = "python benchmarks/onnx_rtf.py" + (" --model <archive>" if args.model else "")
            for label, figure, seconds, texts, reference in results:
                note = (f"{notes[figure.split('.')[0]]}; {label.split(': ')[1]} greedy; {len(rows)} x "
                        f"{args.seconds:g} s files, batches of <= {args.batch_duration:g} s, {args.threads} "
                        "threads")  # fmt: skip
                if reference is not None:
                    note += f"; WER against PyTorch's transcripts {_rate(texts, reference)}"
                append(f"deployment.rtfx.{figure}", round(audio / seconds, 1), "RTFx", command, note)
        print(json.dumps({"model": str(path), "audio_seconds": round(audio, 1)}))


if __name__ == "__main__":
    main()
