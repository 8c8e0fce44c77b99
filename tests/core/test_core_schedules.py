"""Learning-rate schedules of ``model.optim.sched``: cosine with warmup_ratio, Noam, inverse square root, linear,
warm-up-stable-decay."""

import math

import pytest
import torch

from speechtrain.core.optim import OptimConfig, SchedConfig, build_scheduler, lr_factor


def _lrs(sched: SchedConfig, steps: int, lr: float = 1.0, max_steps: int = 100) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(opt, OptimConfig(name="sgd", lr=lr, sched=sched), max_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def test_cosine_with_warmup_ratio_warms_up_over_that_share_of_max_steps():
    lrs = _lrs(SchedConfig(name="CosineAnnealing", warmup_ratio=0.1, min_lr=0.01), 100)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)  # 10 warm-up steps of 100
    assert lrs[10] == pytest.approx(1.0) and lrs[55] == pytest.approx(0.505, abs=0.01)
    assert min(lrs) >= 0.01 and lrs[99] == pytest.approx(0.01, abs=1e-3)
    assert lrs == _lrs(SchedConfig(name="cosine", warmup_steps=10, min_lr=0.01), 100)


def test_noam_follows_the_transformer_formula_and_peaks_at_the_end_of_warmup():
    sched = SchedConfig(name="NoamAnnealing", warmup_steps=10, d_model=256, min_lr=1e-5)
    lrs = _lrs(sched, 60, lr=2.0)
    for step in (0, 5, 9, 20, 59):
        s = step + 1
        assert lrs[step] == pytest.approx(2.0 * 256**-0.5 * min(s**-0.5, s * 10**-1.5))
    assert max(lrs) == lrs[9]


def test_inverse_sqrt_decays_as_one_over_root_step_to_the_floor():
    lrs = _lrs(SchedConfig(name="inverse_sqrt", warmup_steps=4, min_lr=0.3), 50)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[15] == pytest.approx(math.sqrt(4 / 16))
    assert lrs[49] == pytest.approx(0.3)  # sqrt(4/50) = 0.28 < min_lr


def test_warmup_ratio_of_a_time_bounded_run_is_a_share_of_the_time():
    sched = SchedConfig(name="cosine", warmup_ratio=0.2)
    assert lr_factor(0, sched, 0, 1.0, progress=lambda: 0.1) == pytest.approx(0.5)
    assert lr_factor(9, sched, 0, 1.0, progress=lambda: 0.6) == pytest.approx(0.5)  # half-way through the decay


def test_linear_and_wsd_decay_in_a_straight_line_to_the_floor():
    linear = _lrs(SchedConfig(name="WarmupAnnealing", warmup_steps=10, min_lr=0.1), 100)
    assert linear[9] == pytest.approx(1.0) and linear[55] == pytest.approx(0.1 + 0.9 * 0.5)
    assert linear[99] == pytest.approx(0.1 + 0.9 / 90)
    wsd = _lrs(SchedConfig(name="wsd", warmup_steps=10, min_lr=0.1, decay_ratio=0.2), 100)
    assert wsd[:10] == linear[:10] and wsd[10:82] == [1.0] * 72  # stable until the last 20% of the 90 steps
    assert wsd[91] == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert wsd[99] == pytest.approx(0.1 + 0.9 / 18)
    time_bounded = SchedConfig(name="wsd", warmup_steps=0, decay_ratio=0.5)
    assert lr_factor(50, time_bounded, 0, 1.0, progress=lambda: 0.4) == 1.0
    assert lr_factor(90, time_bounded, 0, 1.0, progress=lambda: 0.75) == pytest.approx(0.5)


def test_a_job_with_a_bad_decay_ratio_stops_before_any_run_folder():
    from speechtrain.common.config import ConfigError
    from speechtrain.core.model import check_optim_config

    with pytest.raises(ConfigError, match=r"model.optim.sched.decay_ratio=1.5: must be in \(0, 1\]"):
        check_optim_config({"sched": {"name": "wsd", "decay_ratio": 1.5}})


@pytest.mark.parametrize(
    ("sched", "message"),
    [
        (SchedConfig(name="Polynomial"), "Unknown schedule"),
        (SchedConfig(warmup_steps=5, warmup_ratio=0.1), "both warmup_steps"),
        (SchedConfig(name="noam"), "needs a warm-up"),
        (SchedConfig(warmup_ratio=1.5), "warmup_ratio must be"),
        (SchedConfig(name="wsd", decay_ratio=0.0), "decay_ratio must be"),
    ],
)
def test_bad_schedules_are_refused_by_name(sched, message):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=message):
        build_scheduler(opt, OptimConfig(name="sgd", sched=sched), 100)


def test_the_wall_clock_progress_syncs_doubling_then_every_n_steps_and_extrapolates_between():
    """A time-bounded run's schedule reads rank 0's clock at steps 0, 1, 2, 4, ... then every ``every`` steps (a
    run of a few dozen steps decays too), and in between moves by the last measured time per step."""
    from types import SimpleNamespace

    from speechtrain.core.model import _WallClockProgress

    trainer, reads = SimpleNamespace(global_step=0), []

    class Timer:
        _duration = 100.0

        def time_elapsed(self, stage):
            reads.append(trainer.global_step)
            return 0.5 * trainer.global_step  # half a second per step

    progress = _WallClockProgress(Timer(), trainer, every=50)
    for step in range(200):
        trainer.global_step = step
        fraction = progress()
        if step >= 2:
            assert fraction == pytest.approx(0.005 * step)
    assert reads == [0, 1, 2, 4, 8, 16, 32, 64, 114, 164]


def test_the_wall_clock_progress_follows_the_epoch_bound_when_it_ends_the_run_first():
    from types import SimpleNamespace

    from speechtrain.core.model import _WallClockProgress

    trainer = SimpleNamespace(global_step=0)

    class Timer:
        _duration = 100.0

        def time_elapsed(self, stage):
            return 0.5 * trainer.global_step  # the clock would end the run at step 200

    epochs = _WallClockProgress(Timer(), trainer, steps=40)  # the epochs end it at step 40
    clock = _WallClockProgress(Timer(), trainer, steps=400)  # the clock ends it first
    for step in range(41):
        trainer.global_step = step
        assert epochs() == pytest.approx(step / 40)
        assert clock() == pytest.approx(0.005 * step)
