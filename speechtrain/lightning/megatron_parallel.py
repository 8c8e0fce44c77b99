"""``MegatronParallel``: runs a speechtrain model's steps through Megatron Core's pipeline schedules.

A model that trains under :class:`~speechtrain.lightning.MegatronStrategy` describes one micro-batch step in
two parts, which is what lets the same model run with and without pipeline parallelism:

- ``forward_step(batch) -> Tensor``: this pipeline stage's forward. The first stage reads the batch; later stages
  read the activation handed to ``set_input_tensor``. The last stage returns what ``loss_step`` needs.
- ``loss_step(batch, output) -> (loss_sum, num_tokens)``: the summed loss of the micro-batch and the number of
  tokens (or frames, or utterances) it is summed over.

The global batch that one data-parallel rank receives is split into micro-batches (``micro_batch_size``); the
reported and optimised loss is ``sum(loss_sum) / sum(num_tokens)`` over all micro-batches and data-parallel
ranks, exactly as one process would compute it over the whole global batch. Gradients are summed over
micro-batches and data-parallel ranks in one flat buffer per dtype, then divided by the global token count.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from speechtrain.lightning import parallel_state
from speechtrain.lightning.grad_buckets import GradientBuckets
from speechtrain.lightning.megatron_compat import import_megatron


def split_micro_batches(batch: Any, micro_batch_size: int | None) -> list[Any]:
    """Split a batch (tensor, or dict/list/tuple of tensors and lists) along dim 0 into micro-batches."""
    size = _batch_size(batch)
    if micro_batch_size is None or micro_batch_size >= size:
        return [batch]
    if size % micro_batch_size:
        raise ValueError(
            f"A batch of {size} cannot be split into micro-batches of {micro_batch_size}; make the batch size a "
            "multiple of strategy.micro_batch_size."
        )
    return [_slice(batch, start, start + micro_batch_size) for start in range(0, size, micro_batch_size)]


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, dict):
        return _batch_size(next(iter(batch.values())))
    if isinstance(batch, list | tuple):
        return _batch_size(batch[0]) if batch and isinstance(batch[0], torch.Tensor | dict) else len(batch)
    raise TypeError(f"Cannot split a batch of type {type(batch).__name__} into micro-batches.")


def _slice(batch: Any, start: int, end: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:end]
    if isinstance(batch, dict):
        return {k: _slice(v, start, end) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        if batch and isinstance(batch[0], torch.Tensor | dict):
            return type(batch)(_slice(v, start, end) for v in batch)
        return batch[start:end]
    return batch


def global_token_count(num_tokens: torch.Tensor | None) -> torch.Tensor:
    """The token count of the whole global batch (only the last pipeline stage counted; all ranks learn it)."""
    total = torch.zeros((), dtype=torch.float64) if num_tokens is None else num_tokens.detach().double().reshape(())
    total = parallel_state.all_reduce(total, parallel_state.pipeline_parallel_group())
    return parallel_state.all_reduce(total, parallel_state.data_parallel_group())


class MegatronParallel:
    """Drives one model chunk through Megatron's forward/backward schedule (see module docstring).

    Args:
        module: the LightningModule (this rank's pipeline stage); it must define ``forward_step``, ``loss_step``
            and ``set_input_tensor``.
        micro_batch_size: micro-batch size (None: the whole batch is one micro-batch).
        grad_scale_func: multiplies the loss before backward (fp16 loss scaling), or None.
        pipeline_dtype: dtype of activations sent between pipeline stages.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        micro_batch_size: int | None = None,
        grad_scale_func: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pipeline_dtype: torch.dtype = torch.float32,
    ) -> None:
        for name in ("forward_step", "loss_step", "set_input_tensor"):
            if not callable(getattr(module, name, None)):
                raise TypeError(
                    f"{type(module).__name__} cannot run under MegatronStrategy: it has no {name}() "
                    "(see speechtrain.lightning.megatron_parallel for the contract)."
                )
        import_megatron()
        from megatron.core.enums import ModelType
        from megatron.core.transformer import TransformerConfig

        self.module = module
        self.micro_batch_size = micro_batch_size
        # The schedules read their settings from a TransformerConfig; the layer sizes in it are placeholders.
        tp, pp = parallel_state.tensor_parallel_world_size(), parallel_state.pipeline_parallel_world_size()
        config = TransformerConfig(
            num_layers=pp,
            hidden_size=8 * tp,
            num_attention_heads=tp,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=pipeline_dtype,
            variable_seq_lengths=True,  # speech: every micro-batch has its own length; shapes are sent first
            moe_token_dispatcher_type="alltoall",  # (unused: no experts) the default refuses variable lengths
            deallocate_pipeline_outputs=False,
            calculate_per_token_loss=True,
            finalize_model_grads_func=self._finalize_grads,
            grad_scale_func=grad_scale_func,
        )
        self.buckets = GradientBuckets(module, parallel_state.data_parallel_group())
        config.no_sync_func = self.buckets.no_sync
        module.config = config
        module.model_type = ModelType.encoder_or_decoder

    def _finalize_grads(self, model: list[torch.nn.Module], num_tokens: torch.Tensor | None, **_: Any) -> None:
        self.buckets.finish(global_token_count(num_tokens))

    @staticmethod
    def _loss_func(module: torch.nn.Module, batch: Any, output: torch.Tensor) -> tuple:
        loss_sum, num_tokens = module.loss_step(batch, output)
        num_tokens = torch.as_tensor(num_tokens, dtype=torch.int).reshape(())
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().float(), "num_tokens": num_tokens}

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module) -> tuple:
        batch = next(data_iterator)
        return model.forward_step(batch), partial(self._loss_func, model, batch)

    def run(self, batch: Any, forward_only: bool) -> torch.Tensor:
        """Forward (and backward unless ``forward_only``) over the micro-batches of ``batch``.

        Returns:
            The loss per token over the global batch (all micro-batches and data-parallel ranks), identical on
            every rank.
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if batch is None or (isinstance(batch, dict) and "ids" in batch and not batch["ids"]):
            # Every utterance of this rank's batch was unreadable (skipped and counted by the dataset). The rank
            # still takes part in the collectives, contributing nothing.
            if not forward_only:
                self.buckets.finish(global_token_count(None))
            return self._reduce_loss(torch.zeros(2, dtype=torch.float64))
        micro_batches = split_micro_batches(batch, self.micro_batch_size)
        self.buckets.start()
        results = get_forward_backward_func()(
            forward_step_func=self._forward_step,
            data_iterator=iter(micro_batches),
            model=[self.module],
            num_microbatches=len(micro_batches),
            seq_length=0,
            micro_batch_size=0,
            forward_only=forward_only,
        )
        sums = torch.zeros(2, dtype=torch.float64)  # loss_sum, num_tokens; nonzero only on the last stage
        for item in results:
            sums += torch.stack([item["loss_sum"].double().reshape(()), item["num_tokens"].double().reshape(())])
        return self._reduce_loss(sums)

    @staticmethod
    def _reduce_loss(sums: torch.Tensor) -> torch.Tensor:
        """(loss_sum, num_tokens) of this rank -> the loss per token of the global batch, on every rank."""
        sums = parallel_state.all_reduce(sums, parallel_state.pipeline_parallel_group())
        sums = parallel_state.all_reduce(sums, parallel_state.data_parallel_group())
        return (sums[0] / sums[1].clamp(min=1)).float()
