"""Tensor parallelism that never splits a sum: every output element is computed whole on one rank.

transformers' TP plans split a block's output projection (``o_proj``, ``down_proj``) by its input
features: each rank multiplies its slice and the ranks add their partial products
(``rowwise``). In bfloat16 each partial is rounded before the addition and the sum rounded again,
so ~37% of the outputs differ from the one-device product by one bf16 step (measured on the
development CPU, DESIGN "round-4 pitfalls"): answers move with G. Here such a layer is split by
its output features instead: the ranks gather the input slices (the heads or MLP columns each
computed), each computes its share of the output columns over the whole input, and the ranks
gather the columns. Every dot product then runs on one rank, over the same operands, as one
device runs it. The results are one device's bits wherever the matrix library computes a slice of
the columns with the kernel it uses for the whole layer: on the development CPU always at 32 rows
or fewer (every decode step) and at most prefill sizes; where oneDNN picks another bf16 kernel
for the slice, ~0.01% of a layer's outputs land one bf16 step apart (docs/performance-notes.md,
"Tensor parallelism that splits no sum"; ``benchmarks/bench_split_sums.py --sweep``). The head's
gathered logits use the same gather.

A dimension G does not divide (a vocabulary of 50,257 or 32,001; the head's rows) is split as
DTensor's ``Shard`` splits it, ``ceil(n / G)`` rows to the first ranks and the rest to the last
(:func:`shard_widths`), and gathered whole: each piece padded to the widest for the exchange and
cut back after it, so every rank holds the same full logits, applies the same generation settings
to them and takes the same stopping decision.

Each rank still holds 1/G of every such weight (its output rows instead of its input columns). The
cost is traffic: two all-gathers of ``rows x features / G`` per layer instead of one all-reduce of
``rows x hidden``.

A model's plan is rewritten by :func:`exact_plan` (driver side, no torch); the styles are
registered in transformers' style registry by :func:`register` on a rank before loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: transformers' styles whose forward splits no sum: lookups (a vocabulary-parallel embedding
#: adds zeros to one rank's rows) and styles that only replicate parameters.
EXACT_STYLES = frozenset(
    {
        "embedding_rowwise",
        "embedding_colwise",
        "replicated_with_grad_allreduce",
        "replicate",
    }
)
#: Column splits (every output element on one rank), rewritten to ``LOCAL``: the same
#: arithmetic, without transformers' per-call swapping of parameters.
_COLWISE = frozenset({"colwise"})
#: Styles that gather a layer's output, rewritten to ``GATHERED``: their input is replicated.
_GATHERED_REPLICATED_INPUT = frozenset({"colwise_gather_output", "colwise_rep"})
#: Row-parallel styles, rewritten to split by output features instead.
_ROWWISE_SHARDED_INPUT = frozenset({"rowwise"})
_ROWWISE_REPLICATED_INPUT = frozenset({"rowwise_split_input", "rowwise_rep"})

#: The names rayeval registers its styles under.
LOCAL = "rayeval_local"  # input replicated: split output columns, keep this rank's
GATHERED = "rayeval_gathered"  # input replicated: split output columns, gather them
GATHER_INPUT = "rayeval_gather_input"  # input split on its last dim: gather it first


def exact_plan(plan: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """A TP plan whose forward splits no sum, from a model's plan.

    Args:
        plan: The architecture's plan (module or parameter pattern -> style name).

    Returns:
        The overrides to pass as ``DistributedConfig(tp_plan=...)`` (transformers merges them
        into the model's plan), and the styles of ``plan`` that split a sum this cannot rewrite
        (empty: the whole plan is exact).
    """
    overrides: dict[str, str] = {}
    inexact: list[str] = []
    for name, style in plan.items():
        if style in _COLWISE:
            overrides[name] = LOCAL
        elif style in _ROWWISE_SHARDED_INPUT:
            overrides[name] = GATHER_INPUT
        elif style in _ROWWISE_REPLICATED_INPUT | _GATHERED_REPLICATED_INPUT:
            overrides[name] = GATHERED
        elif style not in EXACT_STYLES and style not in inexact:
            inexact.append(style)
    return overrides, inexact


def register(gather: Gather) -> None:
    """Register rayeval's styles in transformers' registry (rank side), gathering with
    ``gather``."""
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    for name, gather_input, gather_output in (
        (LOCAL, False, False),
        (GATHERED, False, True),
        (GATHER_INPUT, True, True),
    ):
        ALL_PARALLEL_STYLES.register(name, _style(gather, gather_input, gather_output))


def shard_widths(size: int, world: int) -> tuple[int, ...]:
    """Each rank's part of a dimension of ``size`` that ``Shard`` splits over ``world`` ranks,
    as DTensor splits it (``torch.chunk``'s rule): ``ceil(size / world)`` for the first ranks,
    the rest to the last ones (a vocabulary of 677 over 2 ranks: 339 and 338; a rank may get
    none)."""
    step = -(-size // world)
    return tuple(max(0, min(step, size - rank * step)) for rank in range(world))


class Gather:
    """The ranks' activations concatenated along the last dimension, in rank order: through
    shared memory once :attr:`shm` is set (CPU ranks of one node), else over the process group
    (gloo, or NCCL on GPUs). The group is always the replica's whole process group (the TP mesh
    spans it), which is the group the shared memory serves."""

    def __init__(self) -> None:
        #: The default group's :class:`~rayeval.actors.parallel.shm_collectives.ShmCollectives`,
        #: or None.
        self.shm: Any = None

    def __call__(self, tensor: Any, group: Any, widths: tuple[int, ...] | None = None) -> Any:
        """Every rank's ``tensor`` concatenated along the last dimension.

        Args:
            tensor: This rank's piece; the same shape on every rank but for its last dimension.
            group: The replica's process group.
            widths: Every rank's last-dimension size, where they differ (a dimension that the
                ranks' count does not divide: :func:`shard_widths`); None where they are equal.
                Each piece is padded to the widest for the exchange, which needs equal sizes,
                and cut back after it.
        """
        if widths is None or len(set(widths)) == 1:
            return self._gather_equal(tensor, group)
        import torch
        import torch.nn.functional as F

        widest = max(widths)
        gathered = self._gather_equal(F.pad(tensor, (0, widest - tensor.shape[-1])), group)
        pieces = [gathered[..., r * widest : r * widest + w] for r, w in enumerate(widths)]
        return torch.cat(pieces, dim=-1)

    def _gather_equal(self, tensor: Any, group: Any) -> Any:
        import torch
        import torch.distributed as dist

        if self.shm is not None:
            gathered = self.shm.gather_last_dim(tensor)
            if gathered is not None:
                return gathered
        tensor = tensor.contiguous()
        world = dist.get_world_size(group)
        flat = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(flat, tensor.view(-1), group=group)
        return concat_pieces(flat.view(world, *tensor.shape))


def concat_pieces(pieces: Any) -> Any:
    """``(world, *shape)`` pieces as one tensor concatenated along the last dimension."""
    world, *shape = pieces.shape
    return pieces.movedim(0, -2).reshape(*shape[:-1], world * shape[-1])


@dataclass(frozen=True)
class Split:
    """How a linear layer split by output features computes (set as ``rayeval_split`` on the
    layer): whether it gathers its input's last-dim slices first, and its output columns after.

    Args:
        gather: The ranks' all-gather.
        group: The replica's process group.
        gather_input: The input arrives split on its last dim (a row-parallel layer's).
        gather_output: The output columns are gathered (else each rank keeps its own).
        input_widths: Each rank's slice of the input features (:func:`shard_widths`).
        output_widths: Each rank's output columns: its rows of the weight.
    """

    gather: Gather
    group: Any
    gather_input: bool
    gather_output: bool
    input_widths: tuple[int, ...]
    output_widths: tuple[int, ...]

    def whole_input(self) -> Any:
        """A function of the layer's input giving the whole input on every rank (gathered
        where it arrives split)."""
        from torch.distributed.tensor import DTensor, Replicate

        def whole(x: Any) -> Any:
            if isinstance(x, DTensor):
                return x.redistribute(placements=[Replicate()]).to_local()
            return self.gather(x, self.group, self.input_widths) if self.gather_input else x

        return whole

    def forward_of(self, module: Any, *, input_whole: bool = False) -> Any:
        """``module``'s forward: its own ``F.linear`` on this rank's rows of the weight (and
        bias), over the whole input (``input_whole``: the caller has made it whole already)."""
        import torch.nn.functional as F

        whole = self.whole_input()

        def forward(x: Any) -> Any:
            if not input_whole:
                x = whole(x)
            bias = module.bias
            out = F.linear(x, _local(module.weight), None if bias is None else _local(bias))
            if not self.gather_output:
                return out
            return self.gather(out, self.group, self.output_widths)

        return forward


def _local(tensor: Any) -> Any:
    """This rank's part of ``tensor`` (a ``DTensor``'s local tensor)."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def _style(gather: Gather, gather_input: bool, gather_output: bool) -> Any:
    """A transformers ``TensorParallelLayer`` for a linear layer split by output features."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from transformers.distributed.tensor_parallel import ColwiseParallel

    class OutputSplitLinear(ColwiseParallel):  # type: ignore[misc]
        """Weight and bias split by output features (``Shard(0)``); the input made whole on
        every rank (gathered from the ranks' last-dim slices where ``gather_input``); the output
        columns gathered where ``gather_output``. Its forward is the layer's own ``F.linear``
        on the local slices, without transformers' per-call swapping of parameters (a decode
        step makes hundreds of these calls); a layer that is not a plain ``nn.Linear`` (a
        quantised one) keeps transformers' column-parallel forward where nothing is gathered,
        and is refused otherwise."""

        def install_forward(self, module: Any, mesh: Any, *, config: Any = None, **kw: Any) -> Any:
            if type(module) is not torch.nn.Linear:
                if not gather_input and not gather_output:
                    return super().install_forward(module, mesh, config=config, **kw)
                raise ValueError(
                    f"{type(module).__name__} is not a plain linear layer: rayeval's exact "
                    "tensor parallelism splits those only"
                )
            out_features, in_features = module.weight.shape  # the whole layer's
            widths = (
                shard_widths(in_features, mesh.size()),
                shard_widths(out_features, mesh.size()),
            )
            split = Split(gather, mesh.get_group(), gather_input, gather_output, *widths)
            module.forward = split.forward_of(module)  # type: ignore[method-assign]
            module.rayeval_split = split  # type: ignore[assignment]
            return module

        def shard_param(self, module: Any, param: str, mesh: Any, **kw: Any) -> None:
            meta = module._parameters.get(param)
            if meta is None:
                return
            module._parameters[param] = torch.nn.Parameter(
                distribute_tensor(meta, mesh, [Shard(0)], src_data_rank=None),
                requires_grad=False,
            )

    return OutputSplitLinear(input_layouts=Replicate(), output_layouts=Shard(-1))


def split_lora(model: Any) -> int:
    """Shape the LoRA layers PEFT wrapped around this rank's split linear layers so that they
    compute as PEFT computes them on one device, in place; returns how many were shaped. Their
    matrices are written afterwards (:func:`rayeval.actors.weights.adapters.load_adapter_weights`
    cuts each ``lora_B`` to the rows it is given here).

    PEFT's unmerged forward is ``result = base_layer(x)``, then ``result + lora_B(lora_A(x)) *
    scaling`` with ``x`` cast to the adapter's dtype, then cast back to ``result``'s dtype. It
    stays PEFT's own forward, so every element is computed with PEFT's arithmetic:

    * a layer that keeps its output columns (``LOCAL``) holds this rank's rows of ``lora_B``
      (the rows of the base weight it holds: PEFT builds it so for a tensor-parallel weight),
      so the LoRA term has the same columns; they are named in ``lora_B``'s ``rayeval_rows``;
    * a layer that gathers its output (``GATHERED``, ``GATHER_INPUT``) holds the whole
      ``lora_B`` (PEFT built this rank's rows): the gathered result gets the whole term, as on
      one device (``r`` columns: a redundant, tiny product on each rank);
    * a layer whose input arrives split (``GATHER_INPUT``) gathers it before PEFT's forward
      runs, since ``lora_A`` needs the whole input; its base layer then takes the whole input
      as it is and gathers only its output.
    """
    import torch

    shaped = 0
    for module in model.modules():
        base: Any = getattr(module, "base_layer", None)
        split = getattr(base, "rayeval_split", None)
        if not isinstance(split, Split) or not hasattr(module, "lora_B"):
            continue
        rows = _rows_held(base.weight)
        for linear in module.lora_B.values():
            if not split.gather_output:
                linear.rayeval_rows = rows
                continue
            whole = base.weight.shape[0]
            linear.weight = torch.nn.Parameter(
                linear.weight.new_zeros(whole, linear.weight.shape[1]), requires_grad=False
            )
            linear.out_features = whole
        if split.gather_input:
            base.forward = split.forward_of(base, input_whole=True)
            module.forward = _with_whole_input(module.forward, split.whole_input())
        shaped += 1
    return shaped


def _rows_held(weight: Any) -> slice:
    """The rows of the whole weight that this rank's ``Shard(0)`` part of ``weight`` holds."""
    (chunk,) = weight.__create_chunk_list__()  # DCP's own description of the local shard
    return slice(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0])


def _with_whole_input(forward: Any, whole: Any) -> Any:
    """``forward`` called on the whole input (``whole(x)``)."""

    def on_whole_input(x: Any, *args: Any, **kwargs: Any) -> Any:
        return forward(whole(x), *args, **kwargs)

    return on_whole_input
