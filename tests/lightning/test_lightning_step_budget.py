"""The step budget (docs/bridge.md): one host synchronisation per optimizer step (the gradient norm) and one every
10 steps (the ranks' agreement on time limit and preemption), the same collectives on every rank, counted on CPU
processes exactly as they would be made on GPUs
(:mod:`speechtrain.testing.step_budget`, ``benchmarks/step_budget.py``). A test here fails when a step gains a sync
or a collective that depends on the data."""

import re
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from speechtrain.testing.step_budget import StepBudget, _consistent, _HostCalls, _Operators, _Step, summarise

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _recorded(function) -> list[str]:
    owner = StepBudget()
    owner.current = _Step()
    with _HostCalls(owner), _Operators(owner):
        function()
    return owner.current.syncs


def test_the_recorder_sees_each_kind_of_host_sync_and_nothing_else():
    x = torch.arange(6.0)
    assert _recorded(lambda: (x * 2).sum()) == []
    assert _recorded(lambda: torch.where(x > 2, x, 0).cumsum(0)) == []  # fixed shapes: no sync
    found = _recorded(lambda: (x.sum().item(), bool(x.any()), float(x[0]), x.tolist(), x.cpu(), x.to("cpu")))
    assert [s.split(" ")[0] for s in found] == ["item", "__bool__", "__float__", "tolist", "cpu", ".to(cpu)"]
    found = _recorded(lambda: (x.nonzero(), x[x > 2], torch.repeat_interleave(torch.tensor([1, 2]))))
    assert [s.split(" ")[0] for s in found] == ["aten.nonzero.default", "aten.index.Tensor",
                                                 "aten.repeat_interleave.Tensor"]  # fmt: skip
    assert all("test_lightning_step_budget.py" in s for s in found)  # each named by the line that made it


def test_a_collective_that_depends_on_the_data_is_inconsistent():
    same = {0: ["all_reduce 16 g0,1", "all_reduce 8 g0"], 1: ["all_reduce 16 g0,1", "all_reduce 4 g1"]}
    assert _consistent(same)  # (each rank's own one-member group may differ)
    assert not _consistent({0: ["all_reduce 16 g0,1"], 1: ["all_reduce 16 g0,1", "all_reduce 16 g0,1"]})
    assert not _consistent({0: ["all_reduce 16 g0,1"], 1: ["all_reduce 32 g0,1"]})
    steps = [[{"syncs": ["item at x.py:1"], "collectives": ["all_reduce 4 g0,1"], "ops": 10}] * 3] * 2
    summary = summarise(steps, skip=1)
    assert summary["syncs_per_step"] == 1 and summary["same_collectives_on_every_rank"]


class _SyncInTheStep(pl.LightningModule):
    """A toy step that reads its loss on the host, as a careless metric would."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).square().mean()
        if loss.item() > 1e6:  # the sync under test
            raise AssertionError
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)


def test_a_sync_added_to_a_step_is_reported_with_its_line():
    budget = StepBudget()
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[budget])  # fmt: skip
    trainer.fit(_SyncInTheStep())
    assert len(budget.steps) == 3
    assert all(any(s.startswith("item at tests/lightning/test_lightning_step_budget.py") for s in step["syncs"])
               for step in budget.steps)  # fmt: skip


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["ctc", pytest.param("salm", marks=pytest.mark.slow)])
def test_a_training_step_waits_on_the_host_once_and_agrees_on_its_collectives(family):
    """Two gloo ranks, the family through the bridge with a wall-clock limit: one host sync per step (the gradient
    norm that clipping and the non-finite guard read), every rank the same collectives at every step."""
    from step_budget import measure

    result = measure(family, tp=1, devices=2, steps=12, skip=2)
    places = {re.sub(r":\d+$", "", place): count for place, count in result["sync_places"].items()}
    # the gradient norm, every step, over the whole gradient buffers at TP=1 (the ranks' agreement every 10 steps
    # reduces host flags on the host)
    assert places == {"__float__ at speechtrain/lightning/optimizer.py": 1.0}, result["sync_places"]
    assert result["syncs_per_step"] == 1 and result["max_syncs_per_step"] == 1
    assert result["same_collectives_on_every_rank"], result["collective_sequences"]
    assert len(result["collective_sequences"]) == 2, result["collective_sequences"]  # with and without the agreement


@pytest.mark.slow
@pytest.mark.multiprocess
def test_without_clipping_and_the_guard_a_step_never_waits_on_the_host():
    from step_budget import measure

    result = measure("ctc", tp=1, devices=2, steps=12, skip=2, no_clip=True)
    assert result["syncs_per_step"] == 0, result["sync_places"]
    assert result["same_collectives_on_every_rank"], result["collective_sequences"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(("family", "tp"), [("hybrid", 1), ("streaming", 1), ("tts", 1), ("ctc", 2)])
def test_the_other_families_and_tensor_parallelism_keep_the_budget(family, tp):
    from step_budget import measure

    result = measure(family, tp=tp, devices=2 * tp, steps=12, skip=2)
    assert result["syncs_per_step"] == 1 and result["max_syncs_per_step"] == 1, result["sync_places"]
    assert result["same_collectives_on_every_rank"], result["collective_sequences"]


def test_host_flags_are_reduced_over_a_gloo_group_made_once_beside_a_device_backend(tmp_path, monkeypatch):
    import torch.distributed as dist

    from speechtrain.lightning import limits

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        assert limits.host_group() is dist.distributed_c10d._get_default_group()  # gloo already: itself
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # as the default group of a GPU run
        made = limits.host_group()
        assert made is not dist.distributed_c10d._get_default_group() and limits.host_group() is made
        flags = torch.tensor([0, 1], dtype=torch.uint8)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=made)
        assert flags.tolist() == [0, 1]
    finally:
        dist.destroy_process_group()
