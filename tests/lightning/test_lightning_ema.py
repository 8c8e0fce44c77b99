"""exp_manager.ema: the moving average's arithmetic, its swap for validation, resume, and the final archive."""

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import example_job, example_main, final_weights, run_folder

from speechtrain.lightning.checkpoint import load_checkpoint
from speechtrain.lightning.ema import EMA


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)
        self.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)


def test_update_follows_the_warmed_up_decay_and_swap_exchanges_values():
    torch.manual_seed(0)
    module = _Tiny()
    ema = EMA(decay=0.9)
    ema._ensure(module)
    assert ema._names == ["linear.weight", "linear.bias", "norm.weight", "norm.bias", "norm.running_mean",
                          "norm.running_var"]  # fmt: skip
    expected = {name: t.detach().clone() for name, t in zip(ema._names, ema._live)}
    weight_storage = module.linear.weight.data_ptr()
    for n in range(30):
        with torch.no_grad():
            for t in ema._live:
                t.add_(torch.randn_like(t))
        ema.update()
        decay = min(0.9, (1 + n) / (10 + n))
        for name, t in zip(ema._names, ema._live):
            expected[name] = decay * expected[name] + (1 - decay) * t.detach()
    for name, average in zip(ema._names, ema._ema):
        torch.testing.assert_close(average, expected[name], rtol=1e-6, atol=1e-6)
    live = module.linear.weight.detach().clone()
    ema._swap()
    torch.testing.assert_close(module.linear.weight.detach(), expected["linear.weight"], rtol=1e-6, atol=1e-6)
    assert module.linear.weight.data_ptr() == weight_storage, "a swap copies into the tensors the optimizer holds"
    ema._swap()
    assert torch.equal(module.linear.weight.detach(), live)


def test_bad_settings_and_a_foreign_average_are_refused():
    with pytest.raises(ValueError, match=r"exp_manager\.ema\.decay=1\.0"):
        EMA(decay=1.0)
    with pytest.raises(ValueError, match="every_n_steps=0"):
        EMA(every_n_steps=0)
    ema = EMA()
    ema.load_state_dict({"names": ["other.weight"], "ema": [torch.zeros(1)], "updates": 3})
    with pytest.raises(ValueError, match=r"does not match this model's weights .*other\.weight"):
        ema._ensure(_Tiny())


def _ema_state(checkpoint):
    (state,) = [v for k, v in checkpoint["callbacks"].items() if k.startswith("EMA")]
    return dict(zip(state["names"], state["ema"])), state["updates"]


def test_resumed_run_with_ema_equals_uninterrupted_and_the_archive_holds_the_average(tmp_path, dtmf_manifest,
                                                                                     capsys):  # fmt: skip
    main = example_main()
    straight, split = tmp_path / "straight", tmp_path / "split"
    job = ("model.optim.sched.name=constant", "exp_manager.ema.enable=true", "exp_manager.ema.decay=0.95")
    main(example_job(straight, dtmf_manifest, "trainer.max_epochs=4", *job))
    main(example_job(split, dtmf_manifest, "trainer.max_epochs=2", *job))
    main(example_job(split, dtmf_manifest, "trainer.max_epochs=4", *job, "exp_manager.resume_if_exists=true"))

    expected, resumed = final_weights(straight), final_weights(split)
    assert expected.keys() == resumed.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")

    # The last checkpoint holds the live weights and, beside them, the average, which is what the archive holds.
    last = load_checkpoint(run_folder(straight) / "checkpoints" / "asr_demo--last.ckpt")
    average, updates = _ema_state(last)
    assert updates == last["global_step"] > 0
    live = last["state_dict"]
    assert average.keys() <= expected.keys()
    moved = 0
    for name, tensor in average.items():
        torch.testing.assert_close(expected[name], tensor, rtol=0, atol=0)
        moved += not torch.equal(live[name], tensor)
    assert moved > 0, "the average must differ from the live weights"

    # benchmarks/asr_ema.py decodes both side by side.
    spec = importlib.util.spec_from_file_location("asr_ema", Path(__file__).parents[2] / "benchmarks" / "asr_ema.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    module.main(["--run", str(run_folder(straight)), "--sets", str(dtmf_manifest)])
    rows = capsys.readouterr().out.strip().splitlines()[-2:]
    assert rows[0].startswith("| moving average (archive) | ") and rows[1].startswith("| live weights (last.ckpt) | ")
    assert all(row.endswith("% |") for row in rows), rows
