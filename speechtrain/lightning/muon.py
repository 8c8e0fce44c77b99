"""Muon for a model's hidden weight matrices, AdamW for its other parameters (``model.optim.name: muon``).

Muon (momentum orthogonalised by Newton-Schulz; Keller Jordan, 2024) updates each weight matrix with its Nesterov
momentum made (roughly) orthogonal, ``U V^T`` of the momentum's SVD, computed by five bf16 Newton-Schulz iterations.
The update is scaled by ``0.2 * sqrt(max(rows, cols))`` (Moonshot's rule, torch's ``adjust_lr_fn="match_rms_adamw"``)
so that its RMS matches AdamW's and the same learning rate and schedule serve both halves. Embeddings, the input
and output layers (the model names them: :attr:`speechtrain.core.model.SpeechModel.MUON_ADAMW_MODULES`), biases, norms,
convolutions and recurrent weights stay with AdamW, as Muon's authors prescribe.

Why this file and not the engine's: Megatron Core 0.19's Muon (``get_megatron_optimizer`` with ``optimizer="muon"``:
``TensorParallelMuon`` from the ``emerging-optimizers`` package) computes the same update when given these numbers
(``muon_nesterov``, ``muon_coefficient_type="simple"``, ``muon_extra_scale_factor=0.2``) and this parameter split
(``is_embedding_or_output_parameter`` on the rest), and was measured against this file on the demo recipe at equal
steps (RESULTS.md, ``bridge.muon_*``; ``benchmarks/asr_optimizers.py``). Its update is slower: one matrix at a time,
where :func:`orthogonalize` stacks the matrices of one shape and runs the iterations as batched products, fewer and
larger. And every data-parallel rank runs all of it: the layer-wise distributed optimizer that shares the
iterations over the ranks (as this file does) wraps its torch optimizers in Megatron's only for bf16 weights (under
``32`` and ``bf16-mixed``, the demo's precision, it cannot step) and gathers uneven shards, which gloo refuses. So the
engine's Muon would cost every run a slower step for the same WER; revisit when its layer-wise path takes fp32
weights. torch's own ``torch.optim.Muon`` also updates one matrix at a time; this file's numbers are torch's (tested
against ``torch.optim.Muon``).

Data parallelism: every data-parallel rank holds the same reduced gradients and momentum, so each orthogonalises
only its share of the matrices and one ``all_gather`` (bf16, one per step, the same layout on every rank whatever the
data) gives every rank all the updates: the same weights on every rank as one process computes, at half the
iterations' cost on 2 ranks. Under tensor parallelism each
rank orthogonalises its own shard of a split matrix (Megatron's default ``muon_tp_mode="blockwise"``), which is not
the full matrix's orthogonalisation: a TP run's numbers differ from TP=1's. Not with the distributed optimizer,
whose shards are flat slices of many matrices.
"""

import functools
import math
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch

# Keller Jordan's quintic iteration (torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalize(x: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """(N, A, B) matrices -> their Newton-Schulz orthogonalisations (bf16), each as ``torch.optim.Muon`` computes
    it for one matrix: in bf16, a tall matrix transposed, divided by its Frobenius norm, then ``steps`` quintic
    iterations ``X <- a X + (b G + c G^2) X`` with ``G = X X^T``."""
    a, b, c = NS_COEFFICIENTS
    x = x.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)  # (not ``@``: its broadcasting adds views and reshapes per call)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def lr_ratio(shape: torch.Size) -> float:
    """Moonshot's update scale, ``0.2 * sqrt(max(rows, cols))``: the update's RMS matches AdamW's."""
    return 0.2 * math.sqrt(max(shape[0], shape[1]))


class GroupedMuon(torch.optim.Optimizer):
    """Muon over 2-D parameters, with the matrices of one shape orthogonalised together (see module docstring).

    Args:
        params: 2-D parameters or parameter groups (``lr``, ``weight_decay``, ``momentum`` per group).
        lr: learning rate (scaled per matrix by :func:`lr_ratio`); decoupled weight decay multiplies the weights by
            ``1 - lr * weight_decay``.
        momentum: Nesterov momentum (0.95, Muon's default).
        ns_steps: Newton-Schulz iterations.
        group: a process group of ranks holding identical parameters and gradients (the data-parallel group after
            the reduction) that share the iterations' work, or None.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.0, momentum: float = 0.95,
                 ns_steps: int = 5, eps: float = 1e-7, group: Any = None) -> None:  # fmt: skip
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "ns_steps": ns_steps, "eps": eps}
        super().__init__(params, defaults)
        for g in self.param_groups:
            for p in g["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Muon updates 2-D weight matrices; got a parameter of shape {tuple(p.shape)}.")
        self.group = group

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = None if closure is None else torch.enable_grad()(closure)()
        # The matrices of one group and shape as one stacked tensor through the momentum and the iterations: a
        # few operators per shape, not several per matrix (the CPU runs a ``_foreach`` operator one tensor at a time).
        buckets = []  # (group, params, stacked Nesterov momenta) in parameter order: the same on every rank
        for g in self.param_groups:
            # (Under Megatron every parameter has its reduced gradient on every rank, so the ranks agree on the
            # matrices and on the all_gather's layout whatever the data.)
            by_shape: dict[tuple, list] = {}
            for p in g["params"]:
                if p.grad is not None:
                    by_shape.setdefault(tuple(p.shape), []).append(p)
            for params in by_shape.values():
                grads = torch.stack([p.grad for p in params])
                momentum = self._momentum(params)
                momentum.lerp_(grads, 1 - g["momentum"])
                buckets.append((g, params, grads.lerp_(momentum, g["momentum"])))  # Nesterov: grad.lerp(buf, momentum)
        for (g, params, _), update in zip(buckets, self._orthogonalized(buckets), strict=True):
            if g["weight_decay"]:
                # decoupled decay, p - lr * wd * p, as an add: one operator per matrix on the CPU, where a multiply by
                # a Python number is several (its scalar converted per tensor); one kernel on GPUs either way
                torch._foreach_add_(params, params, alpha=-g["lr"] * g["weight_decay"])
            torch._foreach_add_(params, update.unbind(0), alpha=-g["lr"] * lr_ratio(params[0].shape))
        return result

    def _momentum(self, params: list[torch.Tensor]) -> torch.Tensor:
        """(k, A, B): the momentum buffers of the same-shape ``params``, stacked; each one's state
        ``momentum_buffer`` is a view of it, so checkpoints keep torch's per-parameter layout (``torch.save`` stores
        the stack once; Megatron's and torch's distributed checkpoint writers copy each view out). Rebuilt from the
        states when one was replaced (a loaded checkpoint, a move to another device)."""
        stacks = self.__dict__.setdefault("_stacks", {})
        key = tuple(id(p) for p in params)
        states = [self.state[p] for p in params]
        cached = stacks.get(key)
        if cached is not None and all(s.get("momentum_buffer") is v for s, v in zip(states, cached[1], strict=True)):
            return cached[0]
        buffers = [s.get("momentum_buffer") for s in states]
        if all(b is None for b in buffers):
            stacked = params[0].new_zeros((len(params), *params[0].shape))
        else:
            stacked = torch.stack(
                [torch.zeros_like(p) if b is None else b for p, b in zip(params, buffers, strict=True)]
            )
        views = stacked.unbind(0)
        for state, view in zip(states, views, strict=True):
            state["momentum_buffer"] = view
        for stale in [k for k in stacks if not set(k).isdisjoint(key)]:  # (another set of these matrices' stack)
            del stacks[stale]
        stacks[key] = (stacked, views)
        return stacked

    def _orthogonalized(self, buckets: list) -> list[torch.Tensor]:
        """The orthogonalised updates of ``buckets`` ((k, A, B) each, the parameters' dtype) in order; with a
        process group, each rank computes its share."""
        if not buckets:
            return []
        world = 1 if self.group is None else torch.distributed.get_world_size(self.group)
        if world == 1:
            kinds: dict[tuple, list[int]] = {}  # buckets that stack (groups with the same settings)
            for i, (g, params, _) in enumerate(buckets):
                kinds.setdefault(_kind(params[0], g), []).append(i)
            out: list[torch.Tensor | None] = [None] * len(buckets)
            for (_, dtype, steps, eps), members in kinds.items():
                parts = [buckets[i][2] for i in members]
                result = orthogonalize(parts[0] if len(parts) == 1 else torch.cat(parts), steps, eps).to(dtype)
                for i, part in zip(members, result.split([len(x) for x in parts]), strict=True):
                    out[i] = part
            return out  # type: ignore[return-value]
        jobs = [(p, u, g) for g, params, updates in buckets for p, u in zip(params, updates.unbind(0), strict=True)]
        updates = self._shared(jobs, world, torch.distributed.get_rank(self.group))
        out, offset = [], 0
        for _, params, _ in buckets:
            out.append(torch.stack(updates[offset : offset + len(params)]))
            offset += len(params)
        return out

    def _shared(self, jobs: list, world: int, rank: int) -> list[torch.Tensor]:
        """The orthogonalised updates of ``jobs`` ((param, update, group) per matrix), each rank computing its
        share."""
        shares = _assign(tuple(tuple(p.shape) for p, _, _ in jobs), world)
        out: list[torch.Tensor | None] = [None] * len(jobs)
        mine = {}
        for (_, _, steps, eps), indices in _by_kind(jobs, shares[rank]).items():
            result = orthogonalize(torch.stack([jobs[i][1] for i in indices]), steps, eps)
            mine.update(zip(indices, result.unbind(0), strict=True))
        # One all_gather of every rank's share, flattened and padded to the largest share (bf16 moved as bytes:
        # plain data movement, which every backend supports).
        sizes = [sum(jobs[i][0].numel() for i in share) for share in shares]
        device = jobs[0][0].device
        flat = torch.zeros(max(sizes), dtype=torch.bfloat16, device=device)
        if shares[rank]:
            torch.cat([mine[i].reshape(-1) for i in shares[rank]], out=flat[: sizes[rank]])
        gathered = torch.empty(world * flat.numel(), dtype=torch.bfloat16, device=device)
        torch.distributed.all_gather_into_tensor(gathered.view(torch.uint8), flat.view(torch.uint8), group=self.group)
        dtypes = {p.dtype for p, _, _ in jobs}
        gathered = gathered.to(dtypes.pop()) if len(dtypes) == 1 else gathered  # (Megatron's: one, fp32)
        for r, share in enumerate(shares):
            offset = r * flat.numel()
            for i in share:
                n = jobs[i][0].numel()
                out[i] = gathered[offset : offset + n].view(jobs[i][0].shape).to(jobs[i][0].dtype)
                offset += n
        return out  # type: ignore[return-value]


def _kind(p: torch.Tensor, g: dict) -> tuple:
    """What matrices must share to be orthogonalised as one stack: shape, dtype and the group's Newton-Schulz
    settings."""
    return tuple(p.shape), p.dtype, g["ns_steps"], g["eps"]


def _by_kind(jobs: list, indices: list[int]) -> dict[tuple, list[int]]:
    """``indices`` grouped by :func:`_kind`."""
    kinds: dict[tuple, list[int]] = {}
    for i in indices:
        p, _, g = jobs[i]
        kinds.setdefault(_kind(p, g), []).append(i)
    return kinds


@functools.lru_cache(maxsize=8)
def _assign(shapes: tuple[tuple[int, ...], ...], world: int) -> tuple[tuple[int, ...], ...]:
    """Matrices (by index into ``shapes``) to ranks, balancing the iterations' cost (rows * cols * min(rows, cols)
    each), largest first; from the shapes alone, so every rank computes the same assignment (once: cached)."""
    shares: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    cost = [shape[0] * shape[1] * min(shape) for shape in shapes]
    for i in sorted(range(len(shapes)), key=lambda i: (-cost[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += cost[i]
    return tuple(tuple(sorted(share)) for share in shares)


class MuonWithAdamW(torch.optim.Optimizer):
    """Two torch optimizers under one: :class:`GroupedMuon` for the hidden matrices and AdamW for the rest (None
    when there is no rest).

    ``param_groups`` is both optimizers' groups (Muon's first), so LR schedulers and Megatron's optimizer (which
    reads the groups' parameters for norms and clipping, and calls ``step``) act on both. ``torch.optim.Optimizer``'s
    ``__init__`` is deliberately not called: this object owns no groups of its own.
    """

    def __init__(self, muon: GroupedMuon, adamw: torch.optim.Optimizer | None) -> None:
        self.muon, self.adamw = muon, adamw
        self.optimizers = (muon,) if adamw is None else (muon, adamw)
        self.defaults = dict(muon.defaults)
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> "_StateView":  # type: ignore[override]
        return _StateView(self.optimizers)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        result = None if closure is None else torch.enable_grad()(closure)()
        for optimizer in self.optimizers:
            optimizer.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """torch's layout (``state`` by parameter index, ``param_groups``; Muon's first), which Megatron's
        optimizers read, and the count of Muon's groups."""
        muon = self.muon.state_dict()
        adamw = self.adamw.state_dict() if self.adamw is not None else {"state": {}, "param_groups": []}
        offset = sum(len(g["params"]) for g in muon["param_groups"])
        return {
            "state": {**muon["state"], **{offset + i: v for i, v in adamw["state"].items()}},
            "param_groups": muon["param_groups"]
            + [{**g, "params": [offset + i for i in g["params"]]} for g in adamw["param_groups"]],
            "muon_groups": len(muon["param_groups"]),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        count = len(self.muon.param_groups)
        if state_dict.get("muon_groups") != count:
            raise ValueError(
                "This checkpoint's optimizer state is not this model's Muon + AdamW one (model.optim.name=muon): was "
                "it saved with another model.optim.name? Resume with that name, or start from its weights (init_from)."
            )
        groups = state_dict["param_groups"]
        offset = sum(len(g["params"]) for g in groups[:count])
        state = state_dict["state"]
        self.muon.load_state_dict(
            {"state": {i: v for i, v in state.items() if i < offset}, "param_groups": groups[:count]}
        )
        if self.adamw is not None:
            self.adamw.load_state_dict({
                "state": {i - offset: v for i, v in state.items() if i >= offset},
                "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in groups[count:]],
            })  # fmt: skip


class _StateView(MutableMapping):
    """Both optimizers' per-parameter states as one mapping; a write goes to the optimizer that owns the parameter
    (as Lightning's moving of optimizer states to a device does)."""

    def __init__(self, optimizers: tuple) -> None:
        self.optimizers = optimizers

    def _owner(self, param: torch.Tensor) -> dict:
        for optimizer in self.optimizers:
            if any(p is param for g in optimizer.param_groups for p in g["params"]):
                return optimizer.state
        raise KeyError(param)

    def __getitem__(self, param: torch.Tensor) -> Any:
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._owner(param)[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._owner(param)[param]

    def __iter__(self):
        return (p for optimizer in self.optimizers for p in optimizer.state)

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self.optimizers)


def muon_parameters(module: torch.nn.Module, adamw_modules: Iterable[str]) -> set[int]:
    """The ids of ``module``'s parameters that Muon updates: the 2-D ``weight`` of every layer except embeddings
    and the layers under ``adamw_modules`` (dotted names of submodules: the model's input and output layers)."""
    prefixes = tuple(adamw_modules)
    chosen = set()
    for name, sub in module.named_modules():
        if isinstance(sub, torch.nn.Embedding) or any(name == m or name.startswith(m + ".") for m in prefixes):
            continue
        weight = sub._parameters.get("weight")
        if weight is not None and weight.dim() == 2 and weight.requires_grad:
            chosen.add(id(weight))
    return chosen


def split_for_muon(optimizer: torch.optim.Optimizer, chosen: set[int], momentum: float, ns_steps: int,
                   group: Any = None) -> MuonWithAdamW:  # fmt: skip
    """``optimizer`` (an AdamW over groups that Megatron built: main parameters, weight-decay split) rebuilt as
    Muon over the parameters in ``chosen`` (by id; for fp32 main copies, the ids of the copies) and AdamW over the
    rest, each group keeping its learning rate, weight decay and Megatron's keys."""
    muon_groups, adamw_groups = [], []
    for g in optimizer.param_groups:
        keys = {k: v for k, v in g.items() if k != "params"}
        matrices = [p for p in g["params"] if id(p) in chosen]
        rest = [p for p in g["params"] if id(p) not in chosen]
        if matrices:
            muon_groups.append({**keys, "params": matrices, "momentum": momentum, "ns_steps": ns_steps, "eps": 1e-7})
        if rest:
            adamw_groups.append({**keys, "params": rest})
    if not muon_groups:
        raise ValueError("model.optim.name=muon: the model has no hidden weight matrices for Muon to update.")
    adamw = torch.optim.AdamW(adamw_groups) if adamw_groups else None  # each group carries AdamW's settings
    return MuonWithAdamW(GroupedMuon(muon_groups, group=group), adamw)
