"""The bucket batch-size search: exact against brute force on fake memory models, and real CPU trials."""

import math
import random
import signal
import sys

import pytest
import torch
from conftest import tiny_ctc_config

from speechtrain.asr.conv_ctc import ConvCTCModel
from speechtrain.datatools import oomptimizer
from speechtrain.datatools.oomptimizer import (
    GIB,
    OOM_EXIT_CODE,
    CudaMeasure,
    SubprocessMeasure,
    format_yaml,
    load_model_config,
    run_training_steps,
    run_trial_process,
    search_bucket_batch_sizes,
)

MIB = 1024**2
CTC_TARGET = "speechtrain.asr.conv_ctc:ConvCTCModel"


class CountingMeasure:
    """A fake memory model ``peak(batch_size, duration)`` that counts its trials (None: out of memory)."""

    def __init__(self, peak):
        self.peak = peak
        self.trials = []

    def __call__(self, batch_size, duration):
        self.trials.append((batch_size, duration))
        return self.peak(batch_size, duration)


def brute_force(peak, edges, budget, max_batch_size):
    """The largest size per bucket whose peak fits, tried one by one."""
    sizes = []
    for duration in edges:
        fitting = [b for b in range(1, max_batch_size + 1) if (p := peak(b, duration)) is not None and p <= budget]
        sizes.append(max(fitting))
    return sizes


def search(measure, bins, max_duration, memory_gib, **kwargs):
    return search_bucket_batch_sizes(None, bins, max_duration, memory_gib, measure=measure, progress=None, **kwargs)


@pytest.mark.parametrize("seed", range(20))
def test_search_is_exact_for_linear_memory(seed):
    rng = random.Random(seed)
    per_item_second = rng.uniform(0.2, 8.0) * MIB
    baseline = rng.uniform(0.3, 2.0) * GIB
    bins = sorted(rng.sample([0.5, 1, 2, 3, 5, 8, 12, 16, 20, 25], rng.randint(1, 6)))
    max_duration = bins[-1] * rng.uniform(1.1, 2.0)
    memory_gib = rng.uniform(3.0, 40.0)
    measure = CountingMeasure(lambda b, d: per_item_second * b * d + baseline)

    sizes = search(measure, bins, max_duration, memory_gib)

    assert sizes == brute_force(measure.peak, [*bins, max_duration], memory_gib * GIB, 1024)
    assert len(set(measure.trials)) == len(measure.trials)
    # At most six trials for the longest bucket and two for each shorter one (the module docstring's claim).
    assert len(measure.trials) <= 6 + 2 * len(bins)


@pytest.mark.parametrize("seed", range(20))
def test_search_is_exact_for_nonlinear_stepped_memory(seed):
    """Attention-like d^2 terms, convex growth in the batch, and 2 MiB allocator blocks: still the exact answer."""
    rng = random.Random(100 + seed)
    linear, quadratic, convex = rng.uniform(0.5, 4) * MIB, rng.uniform(0, 0.5) * MIB, rng.uniform(0, 0.2) * MIB

    def peak(b, d):
        raw = 0.5 * GIB + linear * b * d + quadratic * b * d * d + convex * (b * d) ** 1.5
        return math.ceil(raw / (2 * MIB)) * 2 * MIB

    measure = CountingMeasure(peak)
    bins, max_duration, memory_gib = [1.0, 2.5, 6.0, 11.0], 20.0, rng.uniform(2.0, 16.0)

    sizes = search(measure, bins, max_duration, memory_gib)

    assert sizes == brute_force(peak, [*bins, max_duration], memory_gib * GIB, 1024)
    assert len(measure.trials) <= 6 * 5


def test_out_of_memory_trials_do_not_fit():
    """A trial that crashes (None) before its peak reaches the budget counts as too big."""

    def peak(b, d):
        return None if b * d > 100 else 0.1 * GIB + b * d * MIB

    assert search(CountingMeasure(peak), [2, 5], 10, 8.0) == [50, 20, 10]


def test_search_stops_at_max_batch_size():
    measure = CountingMeasure(lambda b, d: b * d * MIB)
    assert search(measure, [1, 2, 4], 8, 100.0, max_batch_size=64) == [64, 64, 64, 64]
    assert measure.trials[-1] == (64, 8.0) and len(measure.trials) <= 6


def test_shorter_buckets_reuse_the_longer_bucket_without_trials():
    """Memory that ignores duration: a shorter bucket never re-tries the longer bucket's size or below."""
    measure = CountingMeasure(lambda b, d: b * GIB)
    assert search(measure, [1, 2, 3], 4, 10.0) == [10, 10, 10, 10]
    shorter = [t for t in measure.trials if t[1] < 4]
    assert all(b > 10 for b, _ in shorter) and len(shorter) <= 2 * 3


def test_a_batch_of_one_that_does_not_fit_names_the_bucket():
    with pytest.raises(RuntimeError, match=r"bucket 3/3 \(<= 16 s\).*one 16 s utterance.*4 GiB"):
        search(CountingMeasure(lambda b, d: 5 * GIB), [4, 8], 16, 4.0)


@pytest.mark.parametrize(("bins", "max_duration"), [([], 10), ([4, 2], 10), ([2, 4], 4), ([0, 2], 10)])
def test_bad_bins_raise(bins, max_duration):
    with pytest.raises(ValueError, match="strictly increasing"):
        search(CountingMeasure(lambda b, d: 0), bins, max_duration, 1.0)


class NoExampleBatch(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()

    def forward_step(self, batch):
        return batch

    def loss_step(self, batch, output):
        return output


def test_a_model_without_example_batch_is_refused_before_any_trial():
    with pytest.raises(TypeError, match=r"NoExampleBatch has no example_batch\(batch_size, duration\)"):
        search_bucket_batch_sizes(NoExampleBatch, [2], 4, 1.0, config={}, device="cpu")


def test_a_factory_cannot_run_in_subprocesses():
    with pytest.raises(ValueError, match="fresh process"):
        search_bucket_batch_sizes(lambda: None, [2], 4, 1.0, device="cpu")


class OomAbove(ConvCTCModel):
    """A model whose example batches above ``limit`` run out of CUDA memory."""

    limit = 4

    def example_batch(self, batch_size, duration):
        if batch_size > self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return super().example_batch(batch_size, duration)


def test_cuda_measure_reads_the_peak_and_catches_out_of_memory(monkeypatch):
    """The GPU path's bookkeeping, with torch.cuda's memory statistics faked (the model runs on CPU)."""
    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 1234)
    model = OomAbove(tiny_ctc_config())
    measure = CudaMeasure(model)
    assert measure(2, 0.5) == 1234 and calls == ["empty_cache", "reset", "empty_cache"]
    assert measure(5, 0.5) is None
    assert all(p.grad is None for p in model.parameters())


def test_conv_ctc_example_batch_is_a_trainable_worst_case():
    model = ConvCTCModel(tiny_ctc_config())
    batch = model.example_batch(3, 1.5)
    assert batch["audio"].shape == (3, 24000) and batch["audio_lens"].tolist() == [24000] * 3
    assert batch["tokens"].shape == (3, 30) and batch["token_lens"].tolist() == [30] * 3  # 20 characters/s
    log_probs, lengths = model.forward_step(batch)
    assert (lengths >= batch["token_lens"]).all()
    loss_sum, tokens = model.loss_step(batch, (log_probs, lengths))
    assert torch.isfinite(loss_sum) and int(tokens) == 90  # CTC can align the transcript: not zeroed as infinite
    short = model.example_batch(2, 0.05)
    assert short["token_lens"].tolist() == [1, 1]
    before = [p.detach().clone() for p in model.parameters()]
    run_training_steps(model, 2, 0.5)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_load_model_config_takes_the_model_node_of_a_training_config(tmp_path):
    model_cfg = load_model_config("examples/conf/asr_train.yaml", ConvCTCModel)
    assert model_cfg["size"] == "demo" and "trainer" not in model_cfg
    plain = tmp_path / "model.yaml"
    plain.write_text("encoder:\n  d_model: 8\n")
    assert load_model_config(plain, ConvCTCModel) == {"encoder": {"d_model": 8}}
    with pytest.raises(FileNotFoundError, match="--config"):
        load_model_config(tmp_path / "missing.yaml")


def test_trial_process_outcomes():
    python = [sys.executable, "-c"]
    assert run_trial_process([*python, "print('noise'); print('oomptimizer-peak-bytes=1234')"], "") == 1234
    assert run_trial_process([*python, f"raise SystemExit({OOM_EXIT_CODE})"], "") is None
    assert run_trial_process([*python, f"import os; os.kill(os.getpid(), {int(signal.SIGKILL)})"], "") is None
    with pytest.raises(RuntimeError, match="exit status 1.*broken model"):
        run_trial_process([*python, "raise ValueError('broken model')"], "")


@pytest.mark.slow
def test_a_real_cpu_trial_reports_the_child_peak_and_config_errors():
    tiny = tiny_ctc_config()
    peak = SubprocessMeasure(CTC_TARGET, tiny, steps=1)(2, 1.0)
    assert 50 * MIB < peak < 8 * GIB  # Python + torch + the model: not the parent's (pytest's) memory
    with pytest.raises(RuntimeError, match="encoder.d_modle"):
        SubprocessMeasure(CTC_TARGET, {**tiny, "encoder": {"d_modle": 4}})(1, 1.0)


def test_cli_estimates_bins_from_manifests(monkeypatch, capsys, dtmf_manifest):
    from speechtrain.datatools.estimate_duration_bins import estimate_bins

    calls = []

    def fake_search(model, bins, max_duration, memory_gib, **kwargs):
        calls.append((model, bins, max_duration, memory_gib, kwargs))
        return list(range(len(bins) + 1, 0, -1))

    monkeypatch.setattr(oomptimizer, "search_bucket_batch_sizes", fake_search)
    oomptimizer.main(["--model", CTC_TARGET, "--config", "m.yaml", "--buckets", "3", "--inputs", str(dtmf_manifest),
                      "--max-duration", "20", "--memory-gib", "6"])  # fmt: skip
    bins = estimate_bins([str(dtmf_manifest)], 3, max_duration=20)
    assert calls == [(CTC_TARGET, bins, 20.0, 6.0, {"config": "m.yaml", "max_batch_size": 1024, "steps": 2,
                                                    "device": None})]  # fmt: skip
    assert capsys.readouterr().out == format_yaml(bins, [3, 2, 1]) + "\n"
    assert (
        format_yaml([1.5, 4, 8], [40, 16, 8, 2])
        == "bucket_duration_bins: [1.5, 4, 8]\nbucket_batch_size: [40, 16, 8, 2]"
    )


@pytest.mark.parametrize(
    "extra", [["--bins", "2", "--buckets", "3"], ["--buckets", "3"], [], ["--bins", "2", "--inputs", "a.json"]]
)
def test_cli_needs_bins_or_buckets_with_inputs(extra):
    with pytest.raises(SystemExit):
        oomptimizer.main(["--model", CTC_TARGET, "--max-duration", "8", "--memory-gib", "1", *extra])


@pytest.mark.slow
def test_real_search_on_a_tiny_ctc_model():
    """Real subprocess trials: the chosen size was measured within the budget and the next one above it."""
    real = SubprocessMeasure(CTC_TARGET, tiny_ctc_config())
    peaks = {}

    def measure(batch_size, duration):
        if (batch_size, duration) not in peaks:
            peaks[batch_size, duration] = real(batch_size, duration)
        return peaks[batch_size, duration]

    budget = measure(1, 3.0) + 40 * MIB  # the child's baseline, plus room for a few dozen utterances
    sizes = search(measure, [1.5], 3.0, budget / GIB, max_batch_size=256)

    short, long = sizes
    assert 0 < long <= short
    assert peaks[long, 3.0] <= budget
    # The shorter bucket's size is measured at 1.5 s, or taken from the longer bucket (then it fits a fortiori).
    assert (peaks[short, 1.5] if short > long else peaks[long, 3.0]) <= budget
    for size, duration in ((long, 3.0), (short, 1.5)):
        if size < 256:
            above = peaks[size + 1, duration]
            assert above is None or above > budget
