"""``checkpoint_format=torch_dist``: Megatron's ``dist_checkpointing`` as the checkpoint format.

Default suite: one process (a run saved and resumed equals an uninterrupted one; the folder's integrity checks; the
description of tensor-parallel parameters). Slow: real gloo processes, a checkpoint written at TP=2 x DP=2 read back
under TP=1 x DP=1, TP=1 x DP=2, TP=2 x DP=1 and TP=1 x DP=4, with and without the distributed optimizer: every weight
and optimizer state tensor equal (the resumed run writes the state it read, and both are read in one process by
Megatron's ``load_plain_tensors``), and a TP=2 run killed and resumed ends bit-identical."""

import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from test_lightning_megatron_parity import JOB, _env, _free_port, assemble, run_job

from speechtrain.core.exp_manager import find_last_checkpoint
from speechtrain.lightning import MegatronStrategy, Trainer, dist_checkpoint, parallel_state
from speechtrain.lightning import checkpoint as files
from speechtrain.lightning.megatron_compat import import_megatron
from speechtrain.lightning.teardown import teardown
from speechtrain.testing.toy_models import ToyTransformerRegressor


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(
    tmp_path: Path,
    steps: int,
    resume: Path | None = None,
    save_every: int = 0,
    async_save: bool = False,
    top_k: int = -1,
) -> tuple:
    pl.seed_everything(0, verbose=False)
    losses = _Losses()
    callbacks: list = [losses]
    if save_every:
        callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="{step}", every_n_train_steps=save_every,
                                         save_top_k=top_k, monitor="step" if top_k > 0 else None,
                                         mode="max"))  # fmt: skip
    strategy = MegatronStrategy(checkpoint_format="torch_dist", async_save=async_save)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy,
                      max_steps=steps, gradient_clip_val=0.05, logger=False, enable_checkpointing=bool(save_every),
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, callbacks=callbacks,
                      default_root_dir=tmp_path)  # fmt: skip
    model = ToyTransformerRegressor({"batch_size": 32, "optim": {"name": "adam", "lr": 1e-2, "weight_decay": 0.0}})
    try:
        trainer.fit(model, ckpt_path=resume)
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    finally:
        teardown(trainer)
    return losses.losses, weights


def test_a_run_resumed_from_a_dist_checkpoint_equals_an_uninterrupted_one_and_damage_is_refused(tmp_path):
    """One process, the toy transformer, Adam with clipping: 4 steps straight, saving after 2 (the end of an epoch:
    the toy's loader is not resumable), and a run resumed from that ``torch_dist`` checkpoint for the last 2: the
    same losses and bit-identical weights. The folder is Megatron's checkpoint
    plus run state and a complete-marker; a truncated or altered file of it is refused by name."""
    straight, weights = _fit(tmp_path / "straight", 4, save_every=2)
    saved = tmp_path / "straight" / "ckpt" / "step=2.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [files.METADATA, dist_checkpoint.RUN, dist_checkpoint.WEIGHTS]
    assert dist_checkpoint.is_dist_checkpoint(saved) and files.checkpoint_candidates(saved) == [saved]
    dist_checkpoint.verify(saved)
    # the manifest merged from the writers' digests is the one Megatron's own hashing of the folder writes
    manifest = saved / dist_checkpoint.WEIGHTS / "integrity.json"
    merged = manifest.read_text()
    assert not list(manifest.parent.glob(".sha256*")) and ".metadata" in json.loads(merged)["files"]
    _megatron_integrity_manifest(manifest.parent)
    assert manifest.read_text() == merged
    resumed, resumed_weights = _fit(tmp_path / "resumed", 4, resume=saved)
    assert resumed == straight[2:]
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=0, msg=name)

    # a resume picks the run's last checkpoint unless it fails its checks, then the previous good one
    run = tmp_path / "runs" / "version_0" / "checkpoints"
    run.mkdir(parents=True)
    shutil.copytree(saved, run / "step=2.ckpt")
    shutil.copytree(tmp_path / "straight" / "ckpt" / "step=4.ckpt", run / "run--last.ckpt")
    assert find_last_checkpoint(tmp_path / "runs") == run / "run--last.ckpt"
    last_shard = next((run / "run--last.ckpt" / dist_checkpoint.WEIGHTS).glob("*.distcp"))
    flipped = bytearray(last_shard.read_bytes())
    flipped[len(flipped) // 2] ^= 0xFF
    last_shard.write_bytes(bytes(flipped))
    assert find_last_checkpoint(tmp_path / "runs", set_aside=True) == run / "step=2.ckpt"
    assert (run / "run--last.ckpt.corrupt").is_dir()

    shard = next((saved / dist_checkpoint.WEIGHTS).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: same size, caught by its SHA-256
    shard.write_bytes(bytes(data))
    with pytest.raises(files.CorruptCheckpointError, match="does not match|mismatch|hash"):
        dist_checkpoint.verify(saved)
    shard.write_bytes(bytes(data[:-10]))  # truncated: no longer a complete checkpoint
    assert files.checkpoint_candidates(saved) == []
    with pytest.raises(files.CorruptCheckpointError, match="incomplete or truncated"):
        dist_checkpoint.verify(saved)
    with pytest.raises(ValueError, match="checkpoint_format=torch_dist"):
        files.load_checkpoint(saved)  # not readable without the model: named

    # torch reads the index (.metadata) with pickle.load: a crafted one (its size in the marker) is refused unread.
    index = saved / dist_checkpoint.WEIGHTS / ".metadata"
    index.write_bytes(pickle.dumps(_Payload()))
    marker = json.loads((saved / files.METADATA).read_text())
    marker["shard_bytes"] = {name: (saved / name).stat().st_size for name in marker["shard_bytes"]}
    (saved / files.METADATA).write_text(json.dumps(marker))
    with pytest.raises(files.CorruptCheckpointError, match="posix.system is not allowed|os.system is not allowed"):
        dist_checkpoint.verify(saved)


def test_async_save_is_refused_without_the_torch_dist_format():
    with pytest.raises(ValueError, match="async_save=true needs checkpoint_format='torch_dist'.*got.*'torch'"):
        MegatronStrategy(async_save=True)


def test_a_run_resumed_from_an_async_dist_checkpoint_equals_an_uninterrupted_one(tmp_path):
    """``async_save``: a run saving every 2 of 6 steps, and one resumed from its step-2 checkpoint that keeps only
    its newest (top 1 by step: step 4 is removed once step 6 is complete; the end of ``fit`` finalizes step 6):
    the same losses and bit-identical weights."""
    straight, weights = _fit(tmp_path / "straight", 6, save_every=2, async_save=True)
    saved = tmp_path / "straight" / "ckpt"
    assert sorted(p.name for p in saved.iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    resumed, resumed_weights = _fit(tmp_path / "resumed", 6, resume=saved / "step=2.ckpt", save_every=2,
                                    async_save=True, top_k=1)  # fmt: skip
    assert resumed == straight[2:]
    for name, tensor in weights.items():
        torch.testing.assert_close(resumed_weights[name], tensor, rtol=0, atol=0, msg=name)
    folder = tmp_path / "resumed" / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["step=6.ckpt"]
    dist_checkpoint.verify(folder / "step=6.ckpt")
    assert not list((folder / "step=6.ckpt").rglob(".write_results*"))  # read back and removed before the hashes
    assert not list((folder / "step=6.ckpt").rglob(".sha256*"))  # the writers' digests, merged into the manifest


def test_an_async_save_in_flight_leaves_the_previous_checkpoint_in_place(_one_process, tmp_path, monkeypatch):
    """While the writer of an asynchronous save runs (held here until a gate file appears), ``path`` holds the
    previous complete checkpoint and the new one is an unmarked ``.partial``; a removal asked for meanwhile waits.
    The checkpoint holds the weights as they were at the save, though training changed them during the write."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    module = torch.nn.Linear(3, 2)
    path, gate = tmp_path / "last.ckpt", tmp_path / "gate"
    dist_checkpoint.save_checkpoint({"global_step": 1}, path, module, [])
    first = module.weight.detach().clone()
    write = FileSystemWriterAsync.write_preloaded_data_multithread

    def held(*args, **kwargs):
        while not gate.exists():
            time.sleep(0.01)
        write(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multithread", staticmethod(held))
    saves = dist_checkpoint.AsyncSaves()
    with torch.no_grad():
        module.weight.add_(1.0)
    second = module.weight.detach().clone()
    dist_checkpoint.save_checkpoint({"global_step": 2}, path, module, [], saves)
    with torch.no_grad():
        module.weight.add_(1.0)  # the next step, while the write runs
    removed = []
    saves.after_save(lambda: removed.append("older"))
    assert saves.pending and saves.writing_here() and removed == []
    partial = path.with_name(path.name + files.PARTIAL)
    assert partial.is_dir() and not (partial / files.METADATA).exists()
    assert files.checkpoint_candidates(path) == [path]
    dist_checkpoint.verify(path)
    assert dist_checkpoint.load_checkpoint(path, torch.nn.Linear(3, 2))["global_step"] == 1

    gate.touch()
    deadline = time.monotonic() + 60
    while saves.writing_here() and time.monotonic() < deadline:
        time.sleep(0.01)
    saves.finalize_if_written(False)  # (what the ranks' agreement says once every writer is done)
    assert not saves.pending and removed == ["older"] and not partial.exists()
    dist_checkpoint.verify(path)
    loaded = dist_checkpoint.load_checkpoint(path, torch.nn.Linear(3, 2))
    assert loaded["global_step"] == 2
    torch.testing.assert_close(loaded["state_dict"]["weight"], second, rtol=0, atol=0)
    assert not torch.equal(second, first)


def _megatron_integrity_manifest(weights: Path) -> None:
    import_megatron()
    from megatron.core.dist_checkpointing.validation import save_integrity_manifest

    save_integrity_manifest(str(weights))


class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.fixture
def _one_process():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    import_megatron().parallel_state.initialize_model_parallel(1, 1)
    yield
    teardown(None)


def test_tensor_parallel_parameters_are_described_as_slices_of_the_tp1_tensor(_one_process, monkeypatch):
    """A parameter with Megatron's TP marks is this rank's slice of the global (TP=1) tensor along its
    ``partition_dim``, written by DP rank 0; anything else is whole, written by TP and DP rank 0 only."""
    module = torch.nn.Module()
    module.column = torch.nn.Parameter(torch.zeros(4, 6))
    module.column.tensor_model_parallel, module.column.partition_dim = True, 0
    module.row = torch.nn.Parameter(torch.zeros(5, 3))
    module.row.tensor_model_parallel, module.row.partition_dim = True, 1
    module.norm = torch.nn.LayerNorm(5)
    module.register_buffer("stats", torch.zeros(2))
    monkeypatch.setattr(parallel_state, "tensor_parallel_world_size", lambda: 2)
    monkeypatch.setattr(parallel_state, "tensor_parallel_rank", lambda: 1)
    monkeypatch.setattr(parallel_state, "data_parallel_rank", lambda: 3)
    sharded = dist_checkpoint.model_sharded_state_dict(module)
    assert sorted(sharded) == ["column", "norm.bias", "norm.weight", "row", "stats"]
    assert sharded["column"].global_shape == (8, 6) and sharded["column"].global_offset == (4, 0)
    assert sharded["row"].global_shape == (5, 6) and sharded["row"].global_offset == (0, 3)
    assert sharded["column"].replica_id == (0, 0, 3)
    assert sharded["norm.weight"].global_shape == (5,) and sharded["norm.weight"].replica_id == (0, 1, 3)
    assert sharded["column"].data is module.column  # the parameter itself: what Megatron's optimizers match
    module.column.partition_stride = 2
    with pytest.raises(NotImplementedError, match="column"):
        dist_checkpoint.model_sharded_state_dict(module)


def test_saves_of_one_structure_reuse_the_save_plan_and_hold_their_own_weights(_one_process, tmp_path):
    """Saves of a state of the same structure keep Megatron's save strategy (its distribution of the shards and,
    from the third save on, its plan); each checkpoint holds the weights of its own save. A state of another
    structure is planned afresh."""
    module = torch.nn.Linear(3, 2)
    strategies = []
    for step in range(1, 5):
        with torch.no_grad():
            module.weight.add_(1.0)
        dist_checkpoint.save_checkpoint({"global_step": step}, tmp_path / f"{step}.ckpt", module, [])
        strategies.append(dist_checkpoint._saving["strategy"])
        loaded = dist_checkpoint.load_checkpoint(tmp_path / f"{step}.ckpt", torch.nn.Linear(3, 2))
        torch.testing.assert_close(loaded["state_dict"]["weight"], module.weight.detach(), rtol=0, atol=0)
    assert all(strategy is strategies[0] for strategy in strategies)
    other = torch.nn.Linear(4, 2)
    dist_checkpoint.save_checkpoint({"global_step": 5}, tmp_path / "5.ckpt", other, [])
    assert dist_checkpoint._saving["strategy"] is not strategies[0]
    loaded = dist_checkpoint.load_checkpoint(tmp_path / "5.ckpt", torch.nn.Linear(4, 2))
    torch.testing.assert_close(loaded["state_dict"]["weight"], other.weight.detach(), rtol=0, atol=0)


def test_a_failed_write_keeps_the_previous_dist_checkpoint(_one_process, tmp_path, monkeypatch):
    """A write failing inside Megatron's save (a full disk) is reported with the path and the reason; the previous
    checkpoint stays in place, complete and loadable, and the partial folder is a leftover for clean_leftovers."""
    from megatron.core import dist_checkpointing

    module = torch.nn.Linear(3, 2)
    path = tmp_path / "last.ckpt"
    dist_checkpoint.save_checkpoint({"global_step": 1}, path, module, [])
    before = {name: t.clone() for name, t in module.state_dict().items()}
    original = dist_checkpointing.save

    def full_disk(state, folder, **kwargs):
        original(state, folder, **kwargs)  # the shards are written, then the disk fills up
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    with torch.no_grad():
        module.weight.add_(1.0)
    with pytest.raises(files.CheckpointWriteError, match="the disk is full.*previous checkpoint at .*last.ckpt"):
        dist_checkpoint.save_checkpoint({"global_step": 2}, path, module, [])
    assert files.checkpoint_candidates(path) == [path]
    dist_checkpoint.verify(path)
    loaded = dist_checkpoint.load_checkpoint(path, module)
    assert loaded["global_step"] == 1
    torch.testing.assert_close(loaded["state_dict"]["weight"], before["weight"], rtol=0, atol=0)
    assert files.clean_leftovers(tmp_path) == [path.with_name("last.ckpt.partial")]


def test_run_state_of_another_layout_is_read_from_the_first_rank_unless_a_callback_holds_shards(tmp_path):
    """Each model-parallel rank's run state is its own file; under another TP/PP layout the first rank's is read,
    and a callback state of tensors (the EMA of TP shards) is refused by name rather than loaded into other shards."""
    saved = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1}
    scores = {"Other": {"count": 1, "best_score": torch.tensor(0.5)}}  # (scalars: a ModelCheckpoint's scores)
    torch.save({"global_step": 4, "callbacks": scores}, tmp_path / dist_checkpoint.RUN)
    torch.save({"global_step": 4, "callbacks": {}}, tmp_path / dist_checkpoint._run_name(1, 0))
    assert dist_checkpoint._run_name(1, 0) == "run_tp01_pp000.ckpt"
    assert dist_checkpoint._load_run(tmp_path, saved)["callbacks"].keys() == {"Other"}  # (this run: TP=1)
    torch.save({"callbacks": {"EMA": {"ema": [torch.zeros(2)], "updates": 3}}}, tmp_path / dist_checkpoint.RUN)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*EMA"):
        dist_checkpoint._load_run(tmp_path, saved)
    assert dist_checkpoint._load_run(tmp_path, {**saved, "tensor_model_parallel_size": 1})["callbacks"]["EMA"]


# ------------------------------------------------------------------------------------------- real processes
def _plain(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (Megatron's ``load_plain_tensors``), and the step of each optimizer group
    (the distributed optimizer's Adam step), read in a fresh process."""
    out = path.with_suffix(".plain.pt")
    code = (
        "import os, sys, torch\n"
        "from speechtrain.lightning.megatron_compat import import_megatron\n"
        "import_megatron()\n"
        "torch.distributed.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{sys.argv[3]}', rank=0, "
        "world_size=1)\n"
        "from megatron.core import dist_checkpointing\n"
        "def flat(d, prefix=''):\n"
        "    for k, v in d.items():\n"
        "        yield from flat(v, f'{prefix}{k}.') if isinstance(v, dict) else [(prefix + str(k), v)]\n"
        "from megatron.core.dist_checkpointing.serialization import load_common_state_dict\n"
        "state = dist_checkpointing.load_plain_tensors(sys.argv[1] + '/weights')\n"
        "tensors = {k: v for k, v in flat(state) if isinstance(v, torch.Tensor)}\n"
        "optimizer = load_common_state_dict(sys.argv[1] + '/weights')['optimizer']\n"
        "groups = optimizer.get('optimizer', optimizer)['param_groups']\n"
        "tensors['param_groups.step'] = torch.tensor([float(g.get('step', -1)) for g in groups])\n"
        "torch.save(tensors, sys.argv[2])\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path), str(out), str(_free_port())], env=_env(),
                            capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


@pytest.fixture(scope="module", params=[[], ["--distributed-optimizer"]], ids=["adam", "distributed-optimizer"])
def tp2xdp2_checkpoint(request, tmp_path_factory):
    """A checkpoint after 4 steps of a TP=2 x DP=2 run (Adam, clipping)."""
    tmp = tmp_path_factory.mktemp("tp2xdp2")
    common = ["--global-batch", "16", "--steps", "4", "--checkpoint-format", "torch_dist", *request.param]
    run_job(tmp / "run", 4, "--tp", "2", *common, "--ckpt-dir", str(tmp / "ckpt"), "--save-every", "4")
    return tmp / "ckpt" / "step=4.ckpt", request.param


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "nproc, tp", [(1, 1), (2, 1), (2, 2), (4, 1)], ids=["tp1xdp1", "tp1xdp2", "tp2xdp1", "tp1xdp4"]
)
def test_a_tp2xdp2_checkpoint_resumes_under_another_layout_with_the_same_weights_and_optimizer_state(
    tp2xdp2_checkpoint, nproc, tp, tmp_path
):
    saved, extra = tp2xdp2_checkpoint
    again = tmp_path / "again.ckpt"
    common = ["--global-batch", "16", "--steps", "6", "--checkpoint-format", "torch_dist", *extra]
    out = run_job(tmp_path / "resumed", nproc, "--tp", str(tp), *common, "--resume", str(saved),
                  "--save-at-start", str(again))  # fmt: skip
    expected, actual = _plain(saved), _plain(again)
    assert expected.keys() == actual.keys()
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in expected), sorted(expected)[:5]
    for key, tensor in expected.items():
        torch.testing.assert_close(actual[key], tensor, rtol=0, atol=0, msg=key)
    losses, _ = assemble(out)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_saves_its_distributed_optimizer_state_as_megatrons_gather_writes_it(tmp_path):
    """TP=2 x DP=2, distributed optimizer: each rank describing the state of its own parameters (no gather on
    data-parallel rank 0) writes a checkpoint with every tensor equal to the one saved through Megatron's gather."""
    common = ["--tp", "2", "--global-batch", "16", "--steps", "4", "--checkpoint-format", "torch_dist",
              "--distributed-optimizer", "--save-every", "4"]  # fmt: skip
    run_job(tmp_path / "own", 4, *common, "--ckpt-dir", str(tmp_path / "own.ckpt"))
    run_job(tmp_path / "gathered", 4, *common, "--ckpt-dir", str(tmp_path / "gathered.ckpt"), "--megatron-gather")
    own, gathered = _plain(tmp_path / "own.ckpt" / "step=4.ckpt"), _plain(tmp_path / "gathered.ckpt" / "step=4.ckpt")
    assert own.keys() == gathered.keys()
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in own), sorted(own)[:5]
    for key, tensor in gathered.items():
        torch.testing.assert_close(own[key], tensor, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_run_killed_and_resumed_from_a_dist_checkpoint_equals_uninterrupted_run(tmp_path):
    common = ["--tp", "2", "--global-batch", "16", "--steps", "6", "--checkpoint-format", "torch_dist"]
    straight = run_job(tmp_path / "straight", 2, *common)
    ckpt = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
        str(JOB), "--devices", "2", *common, "--ckpt-dir", str(ckpt), "--save-every", "4", "--kill-at", "4",
        "--out", str(tmp_path / "killed"),
    ]  # fmt: skip
    killed = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed").exists(), "the job should have been killed"
    saved = ckpt / "step=4.ckpt"
    assert dist_checkpoint.is_dist_checkpoint(saved)
    assert sorted(p.name for p in saved.iterdir()) == [files.METADATA, "run.ckpt", "run_tp01_pp000.ckpt", "weights"]
    resumed = run_job(tmp_path / "resumed", 2, *common, "--resume", str(saved))
    full_losses, full_weights = assemble(straight)
    losses, weights = assemble(resumed)
    assert losses == full_losses[4:]
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, full_weights[name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_kill_while_an_async_save_is_written_resumes_from_the_previous_one_as_an_uninterrupted_run(tmp_path):
    """2 gloo ranks, ``async_save``, a checkpoint every 2 steps; the write of step 4 never ends, training goes on, and
    every rank is killed after step 5 (SIGKILL, the writers die with their ranks): step 4 is an unmarked
    ``.partial``, step 2 is complete. The run resumed from step 2 (saving asynchronously too) ends as the
    uninterrupted run: the same losses and bit-identical weights."""
    common = ["--global-batch", "32", "--steps", "6", "--checkpoint-format", "torch_dist", "--async-save"]
    straight = run_job(tmp_path / "straight", 2, *common)
    ckpt = tmp_path / "ckpt"
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
        str(JOB), "--devices", "2", *common, "--ckpt-dir", str(ckpt), "--save-every", "2", "--hold-write-at", "4",
        "--kill-at", "5", "--out", str(tmp_path / "killed"),
    ]  # fmt: skip
    killed = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240, check=False)
    assert killed.returncode != 0 and not (tmp_path / "killed").exists(), "the job should have been killed"
    partial = ckpt / f"step=4.ckpt{files.PARTIAL}"
    assert partial.is_dir() and not (partial / files.METADATA).exists()
    assert files.checkpoint_candidates(ckpt / "step=4.ckpt") == []
    dist_checkpoint.verify(ckpt / "step=2.ckpt")
    assert files.clean_leftovers(ckpt) == [partial]
    resumed = run_job(tmp_path / "resumed", 2, *common, "--resume", str(ckpt / "step=2.ckpt"),
                      "--ckpt-dir", str(tmp_path / "again"), "--save-every", "2")  # fmt: skip
    full_losses, full_weights = assemble(straight)
    losses, weights = assemble(resumed)
    assert losses == full_losses[2:]
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, full_weights[name], rtol=0, atol=0, msg=name)
    for step in (4, 6):
        dist_checkpoint.verify(tmp_path / "again" / f"step={step}.ckpt")
