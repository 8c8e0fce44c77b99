"""Training-step time of speechtrain's Conformer / FastConformer next to NeMo's, on one fixed batch.

    python benchmarks/vs_nemo.py [--nemo-python /work/nemo-venv/bin/python] [--rounds 5] [--steps 10]
    python benchmarks/vs_nemo.py --nemo-python ... --same-allocator  # NeMo keeps freed memory too
    python benchmarks/vs_nemo.py --baseline /tmp/old   # before/after: this checkout vs another (git worktree)

One step = features -> SpecAugment -> encoder -> CTC head -> CTC loss (``mean_volume``) -> backward -> AdamW, in
train mode (dropout 0.1 everywhere NeMo has it), fp32, 2 threads, on a fixed batch of 8 x 8 s of noise with 50
targets each. Each framework runs in its own long-lived worker process (NeMo's in ``--nemo-python``, an environment
with ``nemo-toolkit[asr]``; it is never a dependency of speechtrain). After 3 warm-up steps, each round times
``--steps`` steps per side, the sides taking turns step by step (the side that starts alternates between rounds), so
that the load of a shared machine falls on both alike. The table gives each side's median over all steps, the
ratio speechtrain / NeMo of those medians, the spread (min - max) of the per-round ratios of medians, and the
median of the ratios of paired steps (each step of ours over the NeMo step next to it).

speechtrain's worker keeps freed host memory for reuse, as speechtrain's ``Trainer`` does in every run
(:mod:`speechtrain.common.memory`); NeMo's runs with the default allocator unless ``--same-allocator``, which
compares the models alone.

Models (BPE-128-sized output, 129 classes with the blank, 80 mels):

- ``fastconformer``: 8 layers, d_model 176, 4 heads, ``dw_striding`` 8x with 176 channels, conv kernel 9;
- ``conformer``: the same with 4x ``striding``.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH, SECONDS, TARGETS, VOCAB, MELS = 8, 8.0, 50, 128, 80
MODELS = {
    "fastconformer": {"subsampling": "dw_striding", "subsampling_factor": 8},
    "conformer": {"subsampling": "striding", "subsampling_factor": 4},
}
SHAPE = {"d_model": 176, "num_layers": 8, "num_heads": 4, "conv_kernel_size": 9, "subsampling_conv_channels": 176,
         "ff_expansion_factor": 4, "conv_norm_type": "batch_norm", "dropout": 0.1, "dropout_att": 0.1,
         "xscaling": True, "untie_biases": True}  # fmt: skip


def batch():  # noqa: ANN201
    import torch

    generator = torch.Generator().manual_seed(0)
    samples = int(SECONDS * 16000)
    audio = 0.1 * torch.randn(BATCH, samples, generator=generator)
    tokens = torch.randint(0, VOCAB, (BATCH, TARGETS), generator=generator)
    return audio, torch.full((BATCH,), samples), tokens, torch.full((BATCH,), TARGETS)


def speechtrain_step(model_name: str, compile_layers: bool):  # noqa: ANN201
    import torch

    from speechtrain.asr.ctc import ConformerCTCModel

    vocab = [chr(0x100 + i) for i in range(VOCAB)]
    encoder = {**SHAPE, **MODELS[model_name], **({"compile": True} if compile_layers else {})}
    model = ConformerCTCModel({"tokenizer": {"vocab": vocab}, "preprocessor": {"n_mels": MELS}, "encoder": encoder})
    model.configure_model()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    audio, audio_lens, tokens, token_lens = batch()
    data = {"tokens": tokens, "token_lens": token_lens}

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        log_probs, lengths = model(audio, audio_lens)
        loss = model.ctc_losses(log_probs, lengths, data).sum() / token_lens.sum()
        loss.backward()
        optimizer.step()

    return step, sum(p.numel() for p in model.parameters())


def nemo_step(model_name: str, compile_layers: bool):  # noqa: ANN201
    import torch
    from nemo.collections.asr.losses.ctc import CTCLoss
    from nemo.collections.asr.modules import (
        AudioToMelSpectrogramPreprocessor,
        ConformerEncoder,
        ConvASRDecoder,
        SpectrogramAugmentation,
    )

    torch.manual_seed(0)
    shape = {**SHAPE, **MODELS[model_name]}
    preprocessor = AudioToMelSpectrogramPreprocessor(
        sample_rate=16000, normalize="per_feature", window_size=0.025, window_stride=0.01, features=MELS, n_fft=512,
        dither=1e-5,
    )  # fmt: skip
    augment = SpectrogramAugmentation(freq_masks=2, time_masks=10, freq_width=27, time_width=0.05)
    encoder = ConformerEncoder(
        feat_in=MELS, n_layers=shape["num_layers"], d_model=shape["d_model"], n_heads=shape["num_heads"],
        subsampling=shape["subsampling"], subsampling_factor=shape["subsampling_factor"],
        subsampling_conv_channels=shape["subsampling_conv_channels"], ff_expansion_factor=shape["ff_expansion_factor"],
        self_attention_model="rel_pos", conv_kernel_size=shape["conv_kernel_size"], conv_norm_type="batch_norm",
        dropout=0.1, dropout_pre_encoder=0.1, dropout_emb=0.0, dropout_att=0.1, xscaling=shape["xscaling"],
        untie_biases=shape["untie_biases"],
    )  # fmt: skip
    decoder = ConvASRDecoder(feat_in=shape["d_model"], num_classes=VOCAB)
    loss_fn = CTCLoss(num_classes=VOCAB, zero_infinity=True, reduction="mean_volume")
    modules = torch.nn.ModuleList([preprocessor, augment, encoder, decoder]).train()
    optimizer = torch.optim.AdamW(modules.parameters(), lr=1e-4)
    audio, audio_lens, tokens, token_lens = batch()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        feats, lengths = preprocessor(input_signal=audio, length=audio_lens)
        feats = augment(input_spec=feats, length=lengths)
        encoded, lengths = encoder(audio_signal=feats, length=lengths)
        log_probs = decoder(encoder_output=encoded)
        loss = loss_fn(log_probs=log_probs, targets=tokens, input_lengths=lengths, target_lengths=token_lens)
        loss.backward()
        optimizer.step()

    return step, sum(p.numel() for p in modules.parameters())


def worker(side: str, model_name: str, compile_layers: bool, same_allocator: bool = False) -> None:
    """Build, warm up, then time one step each time a line ``step`` arrives on stdin."""
    import torch

    if side == "speechtrain" or same_allocator:  # speechtrain's Trainer does this; NeMo's side with --same-allocator
        from speechtrain.common.memory import keep_freed_memory

        keep_freed_memory()
    torch.set_num_threads(2)
    step, params = (speechtrain_step if side == "speechtrain" else nemo_step)(model_name, compile_layers)
    for _ in range(3):
        step()
    print(json.dumps({"ready": params}), flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        start = time.perf_counter()
        step()
        print(json.dumps({"seconds": time.perf_counter() - start}), flush=True)


class Worker:
    def __init__(
        self, python: str, side: str, model_name: str, compile_layers: bool, root: Path = ROOT, flags: tuple = ()
    ) -> None:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(root)}
        command = [python, str(root / "benchmarks" / "vs_nemo.py"), "--worker", side, "--model", model_name, *flags]
        if compile_layers:
            command.append("--compile")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
                                        cwd=root)  # fmt: skip
        self.params = self._read()["ready"]

    def _read(self) -> dict:
        while True:
            line = self.process.stdout.readline()
            if not line:
                raise RuntimeError(f"worker exited with {self.process.wait()}")
            if line.startswith("{"):
                return json.loads(line)

    def step(self) -> float:
        self.process.stdin.write("step\n")
        self.process.stdin.flush()
        return self._read()["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nemo-python", help="a python with nemo-toolkit[asr] (NeMo's side is left out without)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action="store_true", help="speechtrain: encoder.compile=true")
    parser.add_argument(
        "--same-allocator",
        action="store_true",
        help="NeMo's worker too keeps freed host memory "
        "(speechtrain.common.memory, which speechtrain's Trainer applies): the models alone compared",
    )
    parser.add_argument("--baseline", type=Path, help="instead of NeMo: speechtrain from this checkout (before/after; "
                        "e.g. `git worktree add /tmp/old <commit>`)")  # fmt: skip
    parser.add_argument("--worker", choices=["speechtrain", "nemo"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.model, args.compile, args.same_allocator)
        return
    other = f"{args.baseline} (baseline)" if args.baseline else "NeMo"
    header = f"model | speechtrain s/step | {other} s/step | ratio (min-max over rounds) | paired-step ratio | params"
    print(f"| {header} (ours / {other}) |")
    print("|---|---|---|---|---|---|")
    for model_name in args.models:
        ours = Worker(sys.executable, "speechtrain", model_name, args.compile)
        if args.baseline:
            theirs = Worker(sys.executable, "speechtrain", model_name, args.compile, args.baseline.resolve())
        else:
            flags = ("--same-allocator",) if args.same_allocator else ()
            theirs = Worker(args.nemo_python, "nemo", model_name, False, flags=flags) if args.nemo_python else None
        rounds: list[dict[str, list[float]]] = []
        for index in range(args.rounds):
            times: dict[str, list[float]] = {"ours": [], "theirs": []}
            pair = [("ours", ours), ("theirs", theirs)] if index % 2 == 0 else [("theirs", theirs), ("ours", ours)]
            for _ in range(args.steps):
                for key, side in pair:
                    if side is not None:
                        times[key].append(side.step())
            rounds.append(times)
        for side in (ours, theirs):
            if side is not None:
                side.close()
        mine = statistics.median(t for r in rounds for t in r["ours"])
        if theirs is None:
            print(f"| {model_name} | {mine:.3f} | - | - | - | {ours.params:,} / - |", flush=True)
            continue
        nemo = statistics.median(t for r in rounds for t in r["theirs"])
        ratios = [statistics.median(r["ours"]) / statistics.median(r["theirs"]) for r in rounds]
        paired = statistics.median(a / b for r in rounds for a, b in zip(r["ours"], r["theirs"], strict=True))
        print(f"| {model_name} | {mine:.3f} | {nemo:.3f} | {mine / nemo:.2f} ({min(ratios):.2f}-{max(ratios):.2f}) "
              f"| {paired:.2f} | {ours.params:,} / {theirs.params:,} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
