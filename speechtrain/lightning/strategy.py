"""``MegatronStrategy``: Lightning's DDP family, with Megatron Core's tensor, pipeline and data parallel groups.

Process layout: ``devices x num_nodes`` processes = TP x PP x DP (Megatron's order: tensor-parallel ranks are
adjacent, so a TP group stays inside one node whenever TP divides the devices per node). Samplers, the loss and
metrics see the *data-parallel* rank and size. The process group is NCCL on GPUs and gloo on CPUs.
"""

import logging
import os
from typing import Any
from unittest import mock

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.distributed.utils import _sync_module_states

from speechtrain.lightning import checkpoint as sharded
from speechtrain.lightning import dist_checkpoint, parallel_state
from speechtrain.lightning.fault_tolerance import NonFiniteGuard
from speechtrain.lightning.limits import rank_agreement
from speechtrain.lightning.megatron_compat import model_parallel_manual_seed, use_device
from speechtrain.lightning.megatron_parallel import MegatronParallel
from speechtrain.lightning.optimizer import MegatronOptimizer
from speechtrain.lightning.precision import MegatronMixedPrecision
from speechtrain.lightning.progress import logs_this_step

logger = logging.getLogger(__name__)


class MegatronStrategy(DDPStrategy):
    """Train speechtrain models with tensor, pipeline and data parallelism on Megatron Core's engine.

    Args:
        tensor_model_parallel_size: ranks that split each layer's weights.
        pipeline_model_parallel_size: ranks that split the stack of layers into stages.
        micro_batch_size: split each data-parallel rank's batch into micro-batches of this size for the
            pipeline schedule (None: one micro-batch).
        use_distributed_optimizer: Megatron's ``DistributedOptimizer``: optimizer states and fp32 main
            parameters sharded over the data-parallel ranks, gradients reduce-scattered (ZeRO-1); the same updates
            with 1/DP of the optimizer memory per rank.
        overlap_grad_reduce: reduce gradient buckets while backward runs. Only for models where every trainable
            parameter gets a gradient in every step on every rank (not SALM with text-only batches); off, the
            buckets are reduced after backward in a fixed order whatever the data. None (the default): on for a
            model whose ``every_parameter_gets_a_gradient()`` says so (the ASR models), else off.
        grad_reduce_in_fp32: accumulate and reduce gradients in fp32 (Megatron's DDP), whatever the weights' dtype.
        seed: seed of the model-parallel RNG streams (default: Lightning's global seed, else 1234).
        max_consecutive_nonfinite_steps: a step whose loss or gradient norm is not finite is skipped (no update),
            counted and logged with its cut IDs; this many in a row checkpoint the last good state and stop the
            run (:class:`~speechtrain.lightning.fault_tolerance.NonFiniteGuard`; 0 turns the guard off).
        fp16_initial_loss_scale, fp16_min_loss_scale, fp16_loss_scale_window, fp16_hysteresis: Megatron's dynamic
            loss scaler under ``16-mixed`` (NeMo's ``MegatronMixedPrecision`` names and defaults: 2^32, 1, 1000 steps,
            2 overflows). The scale halves after ``hysteresis`` overflowing steps (each skipped) and doubles after
            ``window`` clean ones: from 2^32 a small model skips its first steps until the scale has come down to
            what its gradients allow, so a lower start such as 2^16 saves them. Ignored by the other precisions.
        checkpoint_format: ``torch``: one ``torch.save`` file per model-parallel rank, the distributed optimizer's
            state gathered on data-parallel rank 0, resumed under the same TP/PP layout only
            (:mod:`~speechtrain.lightning.checkpoint`). ``torch_dist``: Megatron Core's ``dist_checkpointing``
            (every rank writes its own shards of the model and optimizer; resumed under any TP x DP layout,
            :mod:`~speechtrain.lightning.dist_checkpoint`). Either format reads checkpoints of both.
        async_save: ``torch_dist`` only: the checkpoints of ``fit`` are written by a process forked from each rank
            while training goes on (Megatron's asynchronous save); the folder is completed, and older checkpoints
            removed, once every rank's write is done (looked at with the periodic rank agreement), and the next
            save, the end of ``fit`` and a preemption wait for it. Until then the previous checkpoint is the one in
            place, so a kill during the write resumes from it.
        **kwargs: ``DDPStrategy`` arguments (``process_group_backend``, ``timeout``, ...).
    """

    strategy_name = "megatron"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        micro_batch_size: int | None = None,
        use_distributed_optimizer: bool = False,
        overlap_grad_reduce: bool | None = None,
        grad_reduce_in_fp32: bool = True,
        seed: int | None = None,
        max_consecutive_nonfinite_steps: int = 10,
        fp16_initial_loss_scale: float = 2.0**32,
        fp16_min_loss_scale: float = 1.0,
        fp16_loss_scale_window: int = 1000,
        fp16_hysteresis: int = 2,
        checkpoint_format: str = "torch",
        async_save: bool = False,
        **kwargs: Any,
    ) -> None:
        # The arguments as passed (the trainer's config stores them), DDPStrategy's only where they are plain data.
        self.init_args = {k: v for k, v in locals().items() if k not in ("self", "kwargs", "__class__")}
        # Megatron settings the bridge does not support yet (interleaved pipeline chunks, context and sequence
        # parallelism) are refused by name rather than passed on to Lightning.
        for name, default in (("virtual_pipeline_model_parallel_size", None), ("context_parallel_size", 1),
                              ("sequence_parallel", False)):  # fmt: skip
            if kwargs.pop(name, default) != default:
                raise NotImplementedError(f"MegatronStrategy: {name} is not supported yet; leave it at its default.")
        sizes = (tensor_model_parallel_size, pipeline_model_parallel_size)
        if not all(isinstance(size, int) and size >= 1 for size in sizes):
            raise ValueError(
                f"MegatronStrategy: tensor/pipeline_model_parallel_size must be positive integers, got {sizes}."
            )
        if not 0 < fp16_min_loss_scale <= fp16_initial_loss_scale or fp16_loss_scale_window < 1 or fp16_hysteresis < 1:
            raise ValueError(
                "MegatronStrategy: the fp16 loss scaler needs 0 < fp16_min_loss_scale <= fp16_initial_loss_scale, "
                f"fp16_loss_scale_window >= 1 and fp16_hysteresis >= 1; got {fp16_min_loss_scale}, "
                f"{fp16_initial_loss_scale}, {fp16_loss_scale_window}, {fp16_hysteresis}."
            )
        if checkpoint_format not in ("torch", "torch_dist"):
            raise ValueError(
                f"MegatronStrategy: checkpoint_format must be 'torch' or 'torch_dist', got {checkpoint_format!r}."
            )
        if async_save and checkpoint_format != "torch_dist":
            raise ValueError(
                "MegatronStrategy: async_save=true needs checkpoint_format='torch_dist' (Megatron's asynchronous "
                f"save), got checkpoint_format={checkpoint_format!r}. Set trainer.strategy.checkpoint_format="
                "torch_dist, or async_save=false."
            )
        super().__init__(**kwargs)
        vars(self).update(self.init_args)  # self.tensor_model_parallel_size, ... (no Strategy attribute is so named)
        self.init_args |= {k: v for k, v in kwargs.items() if isinstance(v, bool | int | float | str) or v is None}
        self.nonfinite_guard = NonFiniteGuard(max_consecutive_nonfinite_steps)
        self.megatron_parallel: MegatronParallel | None = None
        self._window_open = False  # an accumulation window has started and not yet stepped
        self._async_saves = dist_checkpoint.AsyncSaves() if async_save else None
        self._saved_at_step = -1  # the step of the pending asynchronous save

    @property
    def loss_scaling(self) -> dict[str, float]:
        """The fp16 loss scaler's settings under Megatron's ``OptimizerConfig`` names (read by the optimizer)."""
        return {"initial_loss_scale": self.fp16_initial_loss_scale, "min_loss_scale": self.fp16_min_loss_scale,
                "loss_scale_window": self.fp16_loss_scale_window, "hysteresis": self.fp16_hysteresis}  # fmt: skip

    # ------------------------------------------------------------------------------------------ process setup
    def _check_layout(self) -> None:
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        world = self.num_nodes * self.num_processes
        if world % (tp * pp):
            raise ValueError(
                f"trainer.devices x trainer.num_nodes = {self.num_processes} x {self.num_nodes} = {world} processes "
                f"cannot be split into model replicas of tensor_model_parallel_size ({tp}) x "
                f"pipeline_model_parallel_size ({pp}) = {tp * pp} processes. "
                f"Use a multiple of {tp * pp} processes, or smaller parallel sizes."
            )

    def setup_environment(self) -> None:
        if self._layer_sync is not None:
            raise ValueError(
                "trainer.sync_batchnorm=true is not supported here (torch's SyncBatchNorm syncs over "
                "every process and ignores the Conformer's padding mask); the bridge averages the running statistics "
                "over the data-parallel ranks before each validation and checkpoint. Set trainer.sync_batchnorm=false."
            )
        if not isinstance(self.precision_plugin, MegatronMixedPrecision):
            self.precision_plugin = MegatronMixedPrecision(self.precision_plugin.precision)
        self.precision_plugin.device_type = self.root_device.type
        self._check_layout()
        super().setup_environment()  # process group (gloo on CPU, NCCL on GPU)
        use_device(self.root_device)  # imports Megatron; its CPU adaptations for a CPU run only
        from megatron.core import parallel_state as mpu

        layout = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size)
        current = (parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size())
        if parallel_state.is_initialized() and layout != current:
            mpu.destroy_model_parallel()
        if not parallel_state.is_initialized():
            mpu.initialize_model_parallel(*layout)
        seed = self.seed if self.seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 1234))
        model_parallel_manual_seed(seed)
        logger.info(
            "Megatron layout: TP %d x PP %d x DP %d (this rank: tp %d, pp %d, dp %d).",
            *layout,
            parallel_state.data_parallel_world_size(),
            parallel_state.tensor_parallel_rank(),
            parallel_state.pipeline_parallel_rank(),
            parallel_state.data_parallel_rank(),
        )

    def setup(self, trainer: Any) -> None:
        """Lightning's ``setup`` broadcasts every parameter and buffer from global rank 0 to the whole world before
        ``validate``/``test``/``predict`` (there is no DDP wrapper to do it then). Under tensor or pipeline
        parallelism that overwrites each model-parallel peer's shard with rank 0's (same shapes, other weights): a
        closing ``trainer.validate`` after ``fit`` evaluated a different model. Here the states are broadcast only
        inside the data-parallel group, from its first rank: replicas agree, model-parallel shards stay their own
        (without model parallelism that group is the world, and its first rank global rank 0, as in Lightning)."""
        if trainer.state.fn == TrainerFn.FITTING:  # Lightning broadcasts nothing then (see configure_ddp)
            return super().setup(trainer)
        module = self.model
        names = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
        # Lightning's world-wide broadcast then has nothing to send.
        with mock.patch.object(module, "_ddp_params_and_buffers_to_ignore", names, create=True):
            super().setup(trainer)
        # From the group's first rank (``src`` is a rank within the group, as in torch's DDP).
        group = parallel_state.data_parallel_group()
        _sync_module_states(module, group, 250 * 1024 * 1024, src=0, params_and_buffers_to_ignore=())

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Samplers shard by data-parallel rank: TP and PP peers read the same samples."""
        return {"num_replicas": parallel_state.data_parallel_world_size(), "rank": parallel_state.data_parallel_rank()}

    def configure_ddp(self) -> None:
        """Wrap the model in Megatron Core's DDP (:class:`MegatronParallel`) instead of torch's.

        Lightning zeroes gradients *after* ``training_step`` (it expects backward to come later); here the
        schedule inside ``training_step`` already ran backward, so the step zeroes the gradient buffers itself at
        the start of each optimizer step (``MegatronOptimizer.zero_grad``, which Lightning calls, does nothing).
        """
        module = self.lightning_module
        self.precision_plugin.check_model(module)
        self._release_megatron_parallel()
        self.megatron_parallel = MegatronParallel(
            module,
            device=self.root_device,
            micro_batch_size=self.micro_batch_size,
            overlap_grad_reduce=self._overlap_grad_reduce(module),
            use_distributed_optimizer=self.use_distributed_optimizer,
            grad_reduce_in_fp32=self.grad_reduce_in_fp32,
        )
        MegatronParallel.active = self.megatron_parallel
        self._window_open = False

    def _overlap_grad_reduce(self, module: Any) -> bool:
        if self.overlap_grad_reduce is not None:
            return bool(self.overlap_grad_reduce)
        every = getattr(module, "every_parameter_gets_a_gradient", None)
        return bool(every()) if callable(every) else False

    def setup_optimizers(self, trainer: Any) -> None:
        """The module's ``configure_optimizers`` builds Megatron's optimizer through
        :func:`speechtrain.core.optim.build_optimizer`; the non-finite guard decides inside its step."""
        super().setup_optimizers(trainer)
        for optimizer in self.optimizers:
            if not isinstance(optimizer, MegatronOptimizer):
                raise TypeError(
                    f"MegatronStrategy trains with Megatron Core's optimizer, but configure_optimizers returned a "
                    f"{type(optimizer).__name__}. Build it with speechtrain.core.optim.build_optimizer (as "
                    "SpeechModel.configure_optimizers does)."
                )
            optimizer.should_update = self._should_update
            optimizer.needs_norm = self._needs_norm

    def _needs_norm(self) -> bool:
        return self.nonfinite_guard.max_consecutive > 0 or logs_this_step(self.lightning_module.trainer)

    def _should_update(self, grad_norm: float | None) -> bool:
        module = self.lightning_module
        ok = self.nonfinite_guard.check(module.trainer, module, grad_norm)
        if not logs_this_step(module.trainer):
            return ok
        if ok and grad_norm is not None:
            module.log("grad_norm", grad_norm, batch_size=1)
        else:
            module.log("nonfinite_steps", float(self.nonfinite_guard.total), batch_size=1)
        return ok

    # ------------------------------------------------------------------------------------------------- steps
    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        batch = args[0] if args else kwargs["batch"]
        module = self.lightning_module
        # Lightning's own decision (the one its loop acts on): more batches accumulate into this optimizer step.
        accumulate = module.trainer.fit_loop._should_accumulate()
        if not self._window_open:
            for optimizer in self.optimizers:  # the step's .grad aliases of the buffers (Megatron's zero_grad)
                optimizer.mcore.zero_grad(set_to_none=True)
            self.megatron_parallel.start_window()
            self.nonfinite_guard.before_step(module)
        with self.precision_plugin.train_step_context():
            loss = self.megatron_parallel.run(batch, forward_only=False, last_in_window=not accumulate)
        self._window_open = accumulate  # the next batch continues this optimizer step
        self.nonfinite_guard.observe(loss, batch)
        if logs_this_step(module.trainer):
            module.log("reduced_train_loss", loss, prog_bar=True, batch_size=1)
        return loss

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Gradients were already computed inside the pipeline schedule (``training_step``)."""
        return closure_loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if parallel_state.pipeline_parallel_world_size() == 1:
            return super().validation_step(*args, **kwargs)  # the module's own, in the precision's context
        if self.megatron_parallel is None:
            self.configure_ddp()
        with self.precision_plugin.val_step_context():
            loss = self.megatron_parallel.run(args[0] if args else kwargs["batch"], forward_only=True)
        self.lightning_module.log("val_loss", loss, prog_bar=True, batch_size=1)
        return loss

    def on_validation_start(self) -> None:
        """Every rank validates with the same normalisation statistics: their mean over the data-parallel ranks."""
        super().on_validation_start()
        parallel_state.average_norm_statistics(self.lightning_module)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Checkpoints hold the data-parallel mean of the normalisation statistics (a collective: every rank dumps
        the checkpoint)."""
        parallel_state.average_norm_statistics(self.lightning_module)
        return super().lightning_module_state_dict()

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Metrics are reduced over the data-parallel group (model-parallel peers hold the same values)."""
        group = parallel_state.data_parallel_group() if group is None else group  # (None: no Megatron state)
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Lightning's decisions (save a checkpoint, stop early) are taken by every process of the world: the
        count is compared with the world size, so it is summed over the world, not the data-parallel group."""
        flag = torch.tensor(int(decision), device=self.root_device)
        parallel_state.all_reduce(flag, torch.distributed.group.WORLD)  # (a no-op without a distributed run)
        return bool(flag == self.world_size) if all else bool(flag)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Under ``torch_dist`` the optimizer state is written by :meth:`save_checkpoint`, each rank its shards:
        nothing is gathered here."""
        return {} if self.checkpoint_format == "torch_dist" else super().optimizer_state(optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """``torch``: one shard per model-parallel rank, written atomically (see
        :mod:`speechtrain.lightning.checkpoint`); ``torch_dist``: Megatron's distributed checkpoint
        (:mod:`speechtrain.lightning.dist_checkpoint`), asynchronously under ``async_save`` while ``fit`` runs (a
        save outside it, with no end of ``fit`` to wait for it, is written at once)."""
        if self.checkpoint_format != "torch_dist":
            sharded.save_checkpoint(checkpoint, filepath)
            return
        self.wait_for_checkpoint()
        trainer = self.lightning_module.trainer
        fitting = trainer.state.fn == TrainerFn.FITTING and trainer.state.status == TrainerStatus.RUNNING
        saves = self._async_saves if fitting else None
        dist_checkpoint.save_checkpoint(checkpoint, filepath, self.lightning_module, self.optimizers, saves)
        self._saved_at_step = trainer.global_step

    def wait_for_checkpoint(self) -> None:
        """Finish the pending asynchronous save, if any: its writers done on every rank, its folder complete (a
        collective call)."""
        if self._async_saves is not None:
            self._async_saves.finish()

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._async_saves is not None:  # (every rank registers it: the agreement reduces the same flags)
            saves = self._async_saves
            rank_agreement(self.lightning_module.trainer).register(saves.FLAG, saves.writing_here)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """A pending asynchronous save is finalized at the first rank agreement after it (every ``every`` steps,
        host flags over a gloo group) that finds every rank's writer done: no collective or host synchronisation of
        its own in the step."""
        super().on_train_batch_start(batch, batch_idx)
        saves = self._async_saves
        if saves is not None and saves.pending:
            trainer = self.lightning_module.trainer
            agreement = rank_agreement(trainer)
            agreed = agreement.at_step_end(trainer)  # (the one of the last step's end; its own on another cadence)
            if agreement.step is not None and agreement.step > self._saved_at_step:  # (one made after the save)
                saves.finalize_if_written(agreed.get(saves.FLAG))

    def on_train_end(self) -> None:
        self.wait_for_checkpoint()
        super().on_train_end()

    def on_exception(self, exception: BaseException) -> None:
        """A failed run leaves a pending asynchronous save unfinished (the other ranks may be gone): its writer is
        stopped, and the previous checkpoint stays the one in place."""
        if self._async_saves is not None:
            self._async_saves.abort()
        super().on_exception(exception)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Either format, whichever ``checkpoint_format`` this run writes."""
        if dist_checkpoint.is_dist_checkpoint(checkpoint_path):
            return dist_checkpoint.load_checkpoint(checkpoint_path, self.lightning_module)
        return sharded.load_checkpoint(checkpoint_path, weights_only=True if weights_only is None else weights_only)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if dist_checkpoint.holds_optimizer_state(checkpoint):
            dist_checkpoint.load_optimizer_state(checkpoint, self.lightning_module, self.optimizers)
        else:
            super().load_optimizer_state_dict(checkpoint)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Removes ``filepath`` (an older checkpoint ``ModelCheckpoint`` rotates out) once the pending asynchronous
        save is complete: until then it may be the only complete checkpoint."""
        if self._async_saves is not None:
            self._async_saves.after_save(lambda: sharded.remove_checkpoint(filepath))
        else:
            sharded.remove_checkpoint(filepath)

    def teardown(self) -> None:
        """Keeps the parallel state (and process group) alive, so that the sharded model can still be saved or
        evaluated after ``fit``; :func:`speechtrain.lightning.teardown` releases them. A pending asynchronous save
        is finished first."""
        self.wait_for_checkpoint()
        self._release_megatron_parallel()
        super().teardown()

    def _release_megatron_parallel(self) -> None:
        if self.megatron_parallel is not None:
            self.megatron_parallel.release()
            self.megatron_parallel = None
