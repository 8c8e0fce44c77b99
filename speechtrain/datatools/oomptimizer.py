"""Find, per duration bucket, the largest batch size whose training step fits a memory budget (NeMo's OOMptimizer).

    python -m speechtrain.datatools.oomptimizer --model speechtrain.asr.conv_ctc:ConvCTCModel --config model.yaml \\
        --bins 2 4 8 --max-duration 16 --memory-gib 6
    python -m speechtrain.datatools.oomptimizer --model speechtrain.asr.conv_ctc:ConvCTCModel \\
        --config examples/conf/asr_train.yaml --buckets 8 --inputs train.json --max-duration 20 --memory-gib 70

Stdout gets the two lines to paste under ``train_ds`` (progress goes to stderr)::

    bucket_duration_bins: [2, 4, 8]
    bucket_batch_size: [212, 104, 50, 24]

Bucket ``i`` holds utterances up to its upper edge ``bins[i]`` (the last bucket's edge is ``--max-duration``; set
``train_ds.max_duration`` to it so that nothing longer arrives), so its worst case is a batch of utterances that
long. A trial runs real training steps on such a batch: forward, loss, backward and an AdamW step, twice, because
the optimizer states only exist from the first step on and the second step's backward runs alongside them.
``--config`` is the model's config, or a training config with a ``model:`` node.

The model contract: the class is built as ``ModelClass(config)`` (then ``configure_model()``) and provides

- ``example_batch(batch_size, duration) -> batch``: a synthetic worst case on the model's device (every
  utterance ``duration`` seconds, the longest plausible transcript; see ``ConvCTCModel.example_batch``);
- ``forward_step(batch) -> output`` and ``loss_step(batch, output)`` returning a scalar loss or
  ``(loss_sum, count)`` (the Megatron bridge's step contract, :mod:`speechtrain.lightning.megatron_parallel`).

Measurement:

- GPU: in this process, ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats`` (the weights count,
  as they stay on the device); a ``torch.cuda.OutOfMemoryError`` means "does not fit". The CUDA context and the
  caching allocator's slack are not counted: leave them as headroom in ``--memory-gib``.
- CPU: every trial runs in a fresh subprocess with one torch thread, and its peak resident set size (``VmHWM``)
  is the measure. It includes the Python/torch baseline, which a training process pays too. (Not ``ru_maxrss``
  from ``wait4``: Linux carries the parent's peak across ``exec`` into the child's.) A child killed by SIGKILL
  (the OOM killer) or failing to allocate counts as "does not fit".

The search assumes memory grows with the batch size and with the duration. Buckets are searched from the longest
to the shorter ones: a shorter bucket fits at least the longer one's batch, which is taken without a trial. Within
a bucket the largest fitting size is bracketed, ``lo`` fits and ``hi`` does not, and probes land where a line
through the measured peaks meets the budget (the first one from the longer bucket's line, its slope scaled by the
duration ratio), falling back to doubling or bisection; while nothing has failed a probe grows at most 8x, so a
noisy slope cannot launch a huge batch. The answer is exact: the search ends when ``lo + 1`` was tried and did not
fit (or ``lo`` is ``--max-batch-size``). A memory linear in the batch size takes five or six trials for the longest
bucket (1, 2, growth, the estimate and the size past it) and two for each other one.
"""

import argparse
import dataclasses
import gc
import importlib
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

GIB = 1024**3
OOM_EXIT_CODE = 3  # a trial child's exit status for "could not allocate"
_PEAK_MARKER = "oomptimizer-peak-bytes="
_GROWTH_CAP = 8

MeasureFn = Callable[[int, float], float | None]
"""``measure(batch_size, duration)``: peak bytes of a training step on that batch, or None if it ran out of memory."""


# ------------------------------------------------------------------------------------------------ the model
def resolve_model_class(target: str) -> type:
    """The class named ``module.path:ClassName`` or ``module.path.ClassName``."""
    module_name, sep, name = target.partition(":") if ":" in target else target.rpartition(".")
    if not sep or not module_name or not name:
        raise ValueError(f"--model {target!r}: expected 'module.path:ClassName' or 'module.path.ClassName'.")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise ValueError(f"--model {target!r}: module {module_name} has no attribute {name!r}.")
    return getattr(module, name)


def require_step_contract(model_cls: type) -> None:
    """Raise a TypeError naming what ``model_cls`` lacks for the oomptimizer (see module docstring)."""
    if not callable(getattr(model_cls, "example_batch", None)):
        raise TypeError(
            f"{model_cls.__name__} has no example_batch(batch_size, duration) method. The oomptimizer needs it to "
            "return a synthetic worst-case training batch on the model's device: every utterance `duration` seconds "
            "long, with the longest plausible transcript, in the format forward_step and loss_step take "
            "(see speechtrain.asr.conv_ctc.ConvCTCModel.example_batch)."
        )
    missing = [name for name in ("forward_step", "loss_step") if not callable(getattr(model_cls, name, None))]
    if missing:
        raise TypeError(
            f"{model_cls.__name__} lacks {' and '.join(missing)}: the oomptimizer runs forward_step(batch) -> output "
            "and loss_step(batch, output) -> loss or (loss_sum, count)."
        )


def load_model_config(path: str | Path, model_cls: type | None = None) -> dict[str, Any]:
    """The model config in a YAML file: the whole file, or its ``model`` node if it is a training config."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--config: no file at {path}.")
    cfg = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if not isinstance(cfg, dict):
        raise ValueError(f"--config {path}: expected a mapping of config keys, got a {type(cfg).__name__}.")
    schema = getattr(model_cls, "Config", None)
    own_keys = {f.name for f in dataclasses.fields(schema)} if dataclasses.is_dataclass(schema) else set()
    if isinstance(cfg.get("model"), dict) and "model" not in own_keys:
        cfg = cfg["model"]
    return cfg


def build_model(target: str, config: dict[str, Any]) -> torch.nn.Module:
    """``ModelClass(config)`` after checking the step contract, with its layers built (``configure_model``)."""
    model_cls = resolve_model_class(target)
    require_step_contract(model_cls)
    model = model_cls(config)
    if callable(getattr(model, "configure_model", None)):
        model.configure_model()
    return model


def run_training_steps(model: torch.nn.Module, batch_size: int, duration: float, steps: int = 2) -> None:
    """``steps`` AdamW training steps of ``model`` on its ``example_batch(batch_size, duration)``."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    batch = model.example_batch(batch_size, duration)
    for _ in range(steps):
        loss = model.loss_step(batch, model.forward_step(batch))
        if isinstance(loss, tuple | list):
            loss_sum, count = loss
            loss = loss_sum / count.clamp(min=1) if isinstance(count, torch.Tensor) else loss_sum / max(count, 1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


# -------------------------------------------------------------------------------------------- measurement
class CudaMeasure:
    """Peak ``torch.cuda.max_memory_allocated`` of training steps in this process (None on CUDA OOM).

    Args:
        model: the model, already on the GPU; it stays there between trials.
        steps: training steps per trial.
    """

    def __init__(self, model: torch.nn.Module, steps: int = 2) -> None:
        self.model = model
        self.steps = steps

    def __call__(self, batch_size: int, duration: float) -> float | None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        try:
            run_training_steps(self.model, batch_size, duration, self.steps)
            peak = torch.cuda.max_memory_allocated()
        except torch.cuda.OutOfMemoryError:
            peak = None
        # The failed step's tensors are referenced from its traceback until here.
        self.model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return peak


class SubprocessMeasure:
    """Peak resident memory of a fresh CPU process running training steps (None if it could not allocate).

    Args:
        target: the model class, ``module.path:ClassName``.
        config: the model config (JSON-serialisable; it reaches the child on stdin).
        steps: training steps per trial.
    """

    def __init__(self, target: str, config: dict[str, Any], steps: int = 2) -> None:
        self.target = target
        self.config = json.dumps(config)
        self.steps = steps

    def __call__(self, batch_size: int, duration: float) -> int | None:
        command = [sys.executable, "-m", "speechtrain.datatools.oomptimizer", "--model", self.target]
        command += ["--trial-batch-size", str(batch_size), "--trial-duration", repr(duration)]
        command += ["--trial-steps", str(self.steps)]
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        return run_trial_process(command, self.config, env)


def run_trial_process(command: list[str], stdin: str, env: dict[str, str] | None = None) -> int | None:
    """Run a trial child: its reported peak bytes, or None if it ran out of memory or was killed (SIGKILL).

    Raises:
        RuntimeError: the child failed otherwise (a broken model or config), with the end of its stderr.
    """
    proc = subprocess.run(command, input=stdin, capture_output=True, text=True, env=env)
    if proc.returncode in (OOM_EXIT_CODE, -signal.SIGKILL):
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_PEAK_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"The trial process failed (exit status {proc.returncode}): {' '.join(command)}\n{proc.stderr[-4000:]}"
        )
    return int(lines[-1][len(_PEAK_MARKER) :])


def own_peak_rss_bytes() -> int:
    """This process's peak resident set size since its ``exec`` (``VmHWM``; Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line: peak memory cannot be read on this system.")


def _is_allocation_failure(error: BaseException) -> bool:
    if isinstance(error, MemoryError | torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and ("can't allocate memory" in str(error) or "out of memory" in str(error))


def _trial_main(target: str, batch_size: int, duration: float, steps: int) -> None:
    """The child's side of :class:`SubprocessMeasure`: config on stdin, peak bytes on stdout."""
    torch.set_num_threads(1)
    model = build_model(target, json.load(sys.stdin))
    try:
        run_training_steps(model, batch_size, duration, steps)
    except Exception as error:
        if not _is_allocation_failure(error):
            raise
        print(f"Out of memory: {error}", file=sys.stderr)
        sys.exit(OOM_EXIT_CODE)
    print(f"{_PEAK_MARKER}{own_peak_rss_bytes()}", flush=True)


# ------------------------------------------------------------------------------------------------- search
@dataclasses.dataclass
class _Line:
    """Peak memory as a function of the batch size at one duration: ``intercept + slope * batch_size``."""

    intercept: float
    slope: float

    @classmethod
    def through(cls, p: tuple[int, float], q: tuple[int, float]) -> "_Line":
        slope = (q[1] - p[1]) / (q[0] - p[0])
        return cls(p[1] - slope * p[0], slope)

    def largest_within(self, budget: float) -> int | None:
        """The largest batch size this line keeps within ``budget`` (None if it does not grow)."""
        if self.slope <= 0:
            return None
        return math.floor((budget - self.intercept) / self.slope + 1e-9)


def _fit_line(fitting: list[tuple[int, float]], failing: list[tuple[int, float]], hint: _Line | None) -> _Line | None:
    """A line through the measured points nearest the budget, else through one point with the hint's slope."""
    if fitting and failing:
        return _Line.through(max(fitting), min(failing))
    points = sorted(fitting)[-2:] if len(fitting) >= 2 else fitting or failing[:1]
    if len(points) == 2:
        return _Line.through(points[0], points[1])
    if points and hint is not None:
        return _Line(points[0][1] - hint.slope * points[0][0], hint.slope)
    return hint


def _largest_fitting(
    peak_of: Callable[[int], float | None], budget: float, lo: int, max_batch_size: int, hint: _Line | None
) -> tuple[int, _Line | None]:
    """The largest batch size in ``[lo, max_batch_size]`` whose peak is within ``budget`` (0 if not even 1).

    Args:
        peak_of: measures a batch size (None: out of memory).
        lo: a size known to fit without a trial (0: none).
        hint: the expected peak line, from a longer bucket.

    Returns:
        the size, and the peak line fitted to this bucket's trials (for the next bucket's hint).
    """
    hi = max_batch_size + 1  # the smallest size known not to fit; max_batch_size + 1 while none is
    fitting: list[tuple[int, float]] = []
    failing: list[tuple[int, float]] = []
    stalls = 0  # consecutive estimates that did not pay off
    while hi - lo > 1:
        line = _fit_line(fitting, failing, hint)
        guess = line.largest_within(budget) if line is not None else None
        from_line = guess is not None and stalls < 2
        closed = hi <= max_batch_size
        if closed:
            probe = guess if from_line else (lo + hi) // 2
        elif lo:  # nothing failed yet: just past the estimate (a good one then closes the bracket), at most 8x lo
            probe = min(guess + 1 if from_line else 2 * lo, _GROWTH_CAP * lo)
        else:
            probe = 1
        probe = max(lo + 1, min(probe, hi - 1))
        width, growth_cap = hi - lo, _GROWTH_CAP * lo
        peak = peak_of(probe)
        fits = peak is not None and peak <= budget
        if fits:
            lo = probe
            fitting.append((probe, peak))
        else:
            hi = probe
            if peak is not None:
                failing.append((probe, peak))
        # An estimate pays off if it halves a closed bracket, or if, growing, the size just past it does not fit.
        # Two that do not are followed by a bisection or a doubling: the trials stay logarithmic in number.
        if not from_line:
            stalls = 0
        elif closed:
            stalls = stalls + 1 if 2 * (hi - lo) > width else 0
        else:
            stalls = stalls + 1 if fits and probe < growth_cap else 0
    return lo, _fit_line(fitting, failing, hint)


def _default_measure(
    model: "str | type | Callable[[], torch.nn.Module] | None", config: Any, device: str, steps: int
) -> MeasureFn:
    if isinstance(model, type):
        model = f"{model.__module__}:{model.__qualname__}"
    if isinstance(model, str):
        model_cls = resolve_model_class(model)
        require_step_contract(model_cls)
        if isinstance(config, str | Path):
            config = load_model_config(config, model_cls)
        config = dict(config or {})
    if device == "cpu":
        if not isinstance(model, str):
            raise ValueError(
                "On CPU every trial runs in a fresh process: pass the model as 'module.path:ClassName' (or the "
                "class) with its config, not a factory."
            )
        return SubprocessMeasure(model, config, steps)
    if model is None:
        raise ValueError("Pass a model ('module.path:ClassName', the class, or a factory) or a measure function.")
    built = build_model(model, config) if isinstance(model, str) else model()
    require_step_contract(type(built))
    return CudaMeasure(built.to(device), steps)


def _progress(message: str) -> None:
    print(f"[oomptimizer] {message}", file=sys.stderr, flush=True)


def search_bucket_batch_sizes(
    model: "str | type | Callable[[], torch.nn.Module] | None",
    bins: Sequence[float],
    max_duration: float,
    memory_gib: float,
    *,
    config: dict[str, Any] | str | Path | None = None,
    max_batch_size: int = 1024,
    steps: int = 2,
    device: str | None = None,
    measure: MeasureFn | None = None,
    progress: Callable[[str], None] | None = _progress,
) -> list[int]:
    """The largest batch size per duration bucket whose training steps fit ``memory_gib`` (see module docstring).

    Args:
        model: ``module.path:ClassName``, the class, or (GPU only) a factory returning the model; unused when
            ``measure`` is given.
        bins: upper duration edges of all buckets but the last, in seconds, increasing (``bucket_duration_bins``).
        max_duration: the last bucket's upper edge.
        memory_gib: the memory budget of a training step, GiB.
        config: the model config: a mapping, or a YAML file (a training config's ``model`` node is taken).
        max_batch_size: no bucket's batch grows past this.
        steps: training steps per trial.
        device: ``cuda`` (trials in this process) or ``cpu`` (a subprocess per trial); default: cuda if available.
        measure: replaces the measurement: ``measure(batch_size, duration) -> peak bytes or None`` (out of memory).
        progress: receives a line per trial (default: stderr); None for silence.

    Returns:
        ``len(bins) + 1`` batch sizes (``bucket_batch_size``), shortest bucket first; non-increasing.

    Raises:
        ValueError: on bad bins or limits; RuntimeError if a batch of one does not fit the longest bucket.
    """
    edges = [float(b) for b in bins] + [float(max_duration)]
    if not bins or any(b <= 0 for b in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
        raise ValueError(
            f"bins {list(bins)} with max_duration {max_duration}: expected at least one bin, positive and strictly "
            "increasing, all below max_duration."
        )
    if memory_gib <= 0 or max_batch_size < 1 or steps < 1:
        raise ValueError(
            f"Expected memory_gib > 0, max_batch_size >= 1 and steps >= 1; got memory_gib={memory_gib}, "
            f"max_batch_size={max_batch_size}, steps={steps}."
        )
    if measure is None:
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        measure = _default_measure(model, config, device, steps)
    budget = memory_gib * GIB
    report = progress or (lambda message: None)
    sizes = [0] * len(edges)
    lo, line, previous = 0, None, None
    for index in reversed(range(len(edges))):
        duration = edges[index]
        label = f"bucket {index + 1}/{len(edges)} (<= {duration:g} s)"

        def peak_of(batch_size: int, duration: float = duration, label: str = label) -> float | None:
            peak = measure(batch_size, duration)
            verdict = "out of memory" if peak is None else f"peak {peak / GIB:.3f} of {memory_gib:g} GiB"
            fits = peak is not None and peak <= budget
            report(f"{label}: batch {batch_size} -> {verdict}: {'fits' if fits else 'does not fit'}")
            return peak

        hint = _Line(line.intercept, line.slope * duration / previous) if line is not None else None
        lo, line = _largest_fitting(peak_of, budget, lo, max_batch_size, hint)
        if lo == 0:
            raise RuntimeError(
                f"{label}: even a batch of one {duration:g} s utterance does not train within {memory_gib:g} GiB. "
                "Raise --memory-gib, lower --max-duration, or shrink the model."
            )
        sizes[index], previous = lo, duration
        report(f"{label}: batch size {lo}")
    return sizes


# ---------------------------------------------------------------------------------------------------- CLI
def format_yaml(bins: Sequence[float], sizes: Sequence[int]) -> str:
    """The ``bucket_duration_bins`` and ``bucket_batch_size`` lines of a dataset config."""
    return (
        f"bucket_duration_bins: [{', '.join(f'{b:g}' for b in bins)}]\n"
        f"bucket_batch_size: [{', '.join(str(s) for s in sizes)}]"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m speechtrain.datatools.oomptimizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model class, module.path:ClassName")
    parser.add_argument("--config", help="YAML with the model config (or a training config with a model: node)")
    bins = parser.add_mutually_exclusive_group()
    bins.add_argument("--bins", type=float, nargs="+", help="bucket_duration_bins: upper edges, seconds")
    bins.add_argument("--buckets", type=int, help="number of buckets, edges estimated from --inputs")
    parser.add_argument("--inputs", nargs="+", help="NeMo manifests / lhotse cuts to estimate bins from")
    parser.add_argument("--max-duration", type=float, help="the last bucket's upper edge, seconds")
    parser.add_argument("--memory-gib", type=float, help="memory budget of a training step, GiB")
    parser.add_argument("--max-batch-size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="training steps per trial")
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda if available")
    for name, kind in (("--trial-batch-size", int), ("--trial-duration", float), ("--trial-steps", int)):
        parser.add_argument(name, type=kind, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trial_batch_size is None:
        if args.max_duration is None or args.memory_gib is None:
            parser.error("--max-duration and --memory-gib are required.")
        if (args.bins is None) == (args.buckets is None) or (args.buckets is not None) != bool(args.inputs):
            parser.error("give either --bins, or --buckets with --inputs.")
    return args


def main(argv: list[str] | None = None) -> None:
    args = _parse_args(argv)
    if args.trial_batch_size is not None:
        _trial_main(args.model, args.trial_batch_size, args.trial_duration, args.trial_steps)
        return
    bins = args.bins
    if args.buckets is not None:
        from speechtrain.datatools.estimate_duration_bins import estimate_bins

        bins = estimate_bins(args.inputs, args.buckets, max_duration=args.max_duration)
    sizes = search_bucket_batch_sizes(
        args.model, bins, args.max_duration, args.memory_gib, config=args.config,
        max_batch_size=args.max_batch_size, steps=args.steps, device=args.device,
    )  # fmt: skip
    _progress(f"set train_ds.max_duration: {args.max_duration:g}, the last bucket's edge")
    print(format_yaml(bins, sizes))


if __name__ == "__main__":
    main()
