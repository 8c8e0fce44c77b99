"""Data-parallel gradient reduction in buckets, overlapped with the backward pass.

Parameters are grouped into buckets in the order backward produces their gradients (the reverse of their
definition order), up to ``bucket_bytes`` each. During the backward pass of the last micro-batch of a step,
a bucket whose gradients are all accumulated is summed over the data-parallel ranks with an asynchronous
all-reduce while backward goes on with the earlier layers. Buckets are launched strictly in order, so every rank
issues the same collectives in the same order, whatever its data. :meth:`GradientBuckets.finish` launches what is
left (zeros for parameters that got no gradient), waits, and divides by the global token count.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_BUCKET_BYTES = 25 * 2**20


class GradientBuckets:
    """Bucketed, overlapped data-parallel gradient all-reduce for one model chunk (see module docstring).

    Args:
        module: the model chunk.
        group: the data-parallel process group (None or size 1: no communication).
        bucket_bytes: the size a bucket grows to before a new one starts.
    """

    def __init__(self, module: torch.nn.Module, group: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.group = group
        self.distributed = group is not None and torch.distributed.get_world_size(group) > 1
        self.buckets: list[list[torch.nn.Parameter]] = []
        size = 0
        for param in reversed([p for p in module.parameters() if p.requires_grad]):
            bytes_ = param.numel() * param.element_size()
            current = self.buckets[-1] if self.buckets else None
            if current is None or size + bytes_ > bucket_bytes or param.dtype != current[0].dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(param)
            size += bytes_
        self._bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_gradient) for b in self.buckets for p in b]
        self.start()

    def start(self) -> None:
        """Forget the previous step; gradients of the next backward pass are synchronised."""
        self.sync_enabled = True
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next = 0
        self._pending: dict[int, tuple[torch.Tensor, Any]] = {}

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate (all micro-batches but the last)."""
        self.sync_enabled = False
        try:
            yield
        finally:
            self.sync_enabled = True

    def _on_gradient(self, param: torch.nn.Parameter) -> None:
        if not (self.sync_enabled and self.distributed):
            return
        index = self._bucket_of[id(param)]
        self._ready[index].add(id(param))
        while self._next < len(self.buckets) and len(self._ready[self._next]) == len(self.buckets[self._next]):
            self._launch(self._next)

    def _launch(self, index: int) -> None:
        bucket = self.buckets[index]
        # Always a copy (flattening a single tensor would alias it): the all-reduce runs while backward goes on.
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket])
        handle = torch.distributed.all_reduce(flat, group=self.group, async_op=True)
        self._pending[index] = (flat, handle)
        self._next = index + 1

    def finish(self, global_tokens: torch.Tensor) -> None:
        """Complete the reduction and divide every gradient by ``global_tokens``."""
        divisor = global_tokens.clamp(min=1)
        if self.distributed:
            while self._next < len(self.buckets):
                self._launch(self._next)
        for index, bucket in enumerate(self.buckets):
            if index in self._pending:
                flat, handle = self._pending.pop(index)
                handle.wait()
                reduced = torch._utils._unflatten_dense_tensors(flat, bucket)
            else:
                reduced = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            for param, grad in zip(bucket, reduced):
                param.grad = grad.div_(divisor.to(grad.dtype))
        self.start()

    def remove(self) -> None:
        """Detach the hooks from the parameters."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
