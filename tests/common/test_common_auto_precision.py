import logging
import math
import os
import subprocess
import sys

import pytest

from speechtrain.common import auto_precision
from speechtrain.common.auto_precision import ENV, bf16_speedup, resolve_auto_precision


@pytest.fixture
def clean_env(monkeypatch):
    """No answer in the environment, and whatever the code under test writes there is undone afterwards."""
    for name in (ENV, "WORLD_SIZE"):
        monkeypatch.setenv(name, "")  # recorded, so the teardown removes what resolve_auto_precision sets
        monkeypatch.delenv(name)
    return monkeypatch


def _no_timing():
    raise AssertionError("measured although the answer was given")


@pytest.mark.parametrize("speedup,expected", [(2.9, "bf16-mixed"), (1.49, "32-true"), (0.5, "32-true")])
def test_auto_takes_bf16_only_where_it_is_clearly_faster_and_records_the_answer_for_the_ranks(
    clean_env, caplog, speedup, expected
):
    clean_env.setattr(auto_precision, "bf16_speedup", lambda: speedup)
    with caplog.at_level(logging.INFO, logger="speechtrain.common.auto_precision"):
        assert resolve_auto_precision("cpu") == expected
    assert os.environ[ENV] == expected
    assert f"{speedup:.2f}x as fast as fp32" in caplog.text
    clean_env.setattr(auto_precision, "bf16_speedup", _no_timing)
    assert resolve_auto_precision("cpu") == expected  # the second call (a rank Lightning started) reads it


def test_an_answer_in_the_environment_is_used_and_a_wrong_one_is_refused(clean_env):
    clean_env.setattr(auto_precision, "bf16_speedup", _no_timing)
    clean_env.setenv(ENV, "bf16-mixed")
    assert resolve_auto_precision("auto") == "bf16-mixed"
    clean_env.setenv(ENV, "bf16")
    with pytest.raises(ValueError, match=f"{ENV}='bf16': choose one of 32-true, bf16-mixed"):
        resolve_auto_precision("cpu")


def test_ranks_of_an_outside_launcher_train_in_fp32_rather_than_disagree(clean_env, caplog):
    clean_env.setattr(auto_precision, "bf16_speedup", _no_timing)
    clean_env.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING):
        assert resolve_auto_precision("cpu") == "32-true"
    assert ENV in caplog.text and "outside launcher" in caplog.text


def test_the_measurement_is_real_and_quick():
    speedup = bf16_speedup(repeats=2, products=1)
    assert math.isfinite(speedup) and speedup > 0


def test_the_two_dtypes_take_turns_and_the_best_timing_of_each_counts(monkeypatch):
    """A burst of work from another process in the middle of the timing must not land on one dtype only: the
    timings alternate, and each dtype's best one counts (here a 10x slow-down hits two of the fp32 timings)."""
    import torch

    order, fp32_calls = [], iter([10.0, 1.0, 10.0])

    def fake_seconds(a, b, products):
        order.append(a.dtype)
        return next(fp32_calls) if a.dtype == torch.float32 else 0.5

    monkeypatch.setattr(auto_precision, "_seconds", fake_seconds)
    assert bf16_speedup(repeats=3, products=1) == 2.0
    assert order == [torch.float32, torch.bfloat16] * 3


def test_a_rank_started_from_this_process_inherits_the_choice(clean_env):
    """Lightning starts the other data-parallel ranks as child processes with this environment: they must not
    time the CPU again (a second timing could disagree)."""
    clean_env.setattr(auto_precision, "bf16_speedup", lambda: 3.0)
    assert resolve_auto_precision("cpu") == "bf16-mixed"
    child = ("import speechtrain.common.auto_precision as m\n"
             "m.bf16_speedup = lambda: 1 / 0\n"
             "print(m.resolve_auto_precision('cpu'))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "bf16-mixed"


def test_the_trainer_resolves_auto_and_records_the_answer(clean_env, tmp_path):
    from speechtrain.lightning import MegatronStrategy, Trainer

    clean_env.setattr(auto_precision, "bf16_speedup", lambda: 0.5)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), precision="auto", logger=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    assert trainer.init_args["precision"] == "32-true"
    assert trainer.strategy.precision_plugin.precision == "32-true"
    clean_env.setenv(ENV, "bf16-mixed")
    trainer = Trainer(accelerator="cpu", devices=1, strategy=MegatronStrategy(), precision="auto", logger=False,
                      enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"
