"""Pipeline stages under ODC: the tied embedding shared by the first and last stage, and equal counts.

[Note: ODC with pipeline stages]
megatron-core's ``parallel_state`` gives every pipeline stage its own DP group (the ranks of the same
stage and TP rank in every DP replica). ``ODCDataParallel`` wraps each stage's model chunk over that
group, so each stage's parameters are sharded over its DP group, with its own layout, engine and
transport: fetches, pushes and fences never leave the stage. The units are the stage's transformer layers
plus its root unit (the embeddings on the first stage, the final norm and output layer on the last). The
1F1B schedule's order of forwards and backwards is legal for the engine ([Note: hooks under 1F1B] in
``core/hooks.py``); the two fences per minibatch stay two per stage (the push fence in
``finish_grad_sync``, the step's). Across stages travel only the schedule's activations, once per
minibatch a small all-reduce of the counts of one pipeline (:func:`agree_pipeline_count`, before the
schedule), and after the push fence the tied embedding's gradient (:class:`TiedEmbedding`).

A DP replica is one pipeline: all its stages run the same microbatches (the plan is made over replicas),
different replicas may run different counts, including 0: such a replica skips the schedule on every
stage and only joins the fences, the token count and the step (``step.finalize_without_microbatches``).

Tied embeddings: with ``share_embeddings_and_output_weights`` and more than one stage, megatron-core keeps
a copy of the word embedding on the last stage as the output layer's weight (both copies are marked
``shared_embedding``) and all-reduces their gradients over the embedding group (first and last stage of
one pipeline) after the DP reduction (``_allreduce_word_embedding_grads``). ODC does the same on the
owners' shards: each copy is laid out in buckets of its own (``ParamSpec.own_bucket``), so DP rank ``d``
owns the same range of it on both stages, and after the push fence each owner adds its slice over the
embedding group: exact, and 1/N of megatron's bytes. megatron-core's own all-reduce finds no gradient on
the parameter (ODC's gradients live in the owners' accumulators) and does nothing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_odc.core.engine import ODCEngine
from megatron_odc.transport.devices import (
    all_reduce_on_group_device,
    collective_device,
    every_rank_int,
)


def shared_embedding_names(named_params: list[tuple[str, torch.nn.Parameter, str]]) -> list[str]:
    """The names of this stage's copy of a word embedding tied across pipeline stages (megatron-core
    marks the first stage's word embedding and the last stage's output weight ``shared_embedding``
    when they are tied and the pipeline has more than one stage); empty otherwise."""
    return [n for n, p, _ in named_params if getattr(p, "shared_embedding", False)]


@dataclasses.dataclass
class TiedEmbedding:
    """This stage's copy of the tied word embedding and the group it is summed over.

    Attributes:
        name: the copy's engine name.
        group: the embedding group (the first and last stage of this rank's pipeline).
    """

    name: str
    group: dist.ProcessGroup

    @classmethod
    def of_stage(
        cls,
        named_params: list[tuple[str, torch.nn.Parameter, str]],
        group: dist.ProcessGroup | None,
    ) -> TiedEmbedding | None:
        """The stage's tied embedding, or ``None`` when it holds none (or the group is one rank)."""
        names = shared_embedding_names(named_params)
        if not names or group is None or dist.get_world_size(group) <= 1:
            return None
        if len(names) > 1:
            raise ValueError(
                f"pipeline stage {parallel_state.get_pipeline_model_parallel_rank()}: more than one "
                f"parameter is marked shared_embedding ({names}); ODC sums one tied embedding"
            )
        return cls(names[0], group)

    def check_owned_ranges(self, engine: ODCEngine) -> None:
        """Collective over the embedding group: every copy's owner on this DP rank owns the same range.

        Raises:
            ValueError: naming both stages and the DP rank (the layouts of the copies differ: a
                different ``--odc-bucket-size`` or DP size per stage).
        """
        spec = engine.layout.spec_of(self.name)
        ranges = [(p.param_start, p.numel) for p in engine.owned_pieces() if p.name == self.name]
        mine = (parallel_state.get_pipeline_model_parallel_rank(), spec.shape, ranges)
        everyone: list[object] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        first_stage, *first = everyone[0]
        for stage, *other in everyone[1:]:
            if other != first:
                raise ValueError(
                    f"DP replica {parallel_state.get_data_parallel_rank()}: the tied embedding's "
                    f"copy on pipeline stage {first_stage} (shape, owned ranges: {first}) differs "
                    f"from the copy on stage {stage} ({other}); every stage must use the same "
                    "--odc-bucket-size and --odc-alignment"
                )

    def allreduce_grads(self, engine: ODCEngine) -> None:
        """Sum the owned gradient slices of the two copies over the embedding group (after the fence)."""
        slices = engine.owned.grads_of([self.name])
        if not slices:
            return
        flat = torch.cat(slices)
        all_reduce_on_group_device(flat, group=self.group)
        offset = 0
        for s in slices:
            s.copy_(flat[offset : offset + s.numel()])
            offset += s.numel()


def agree_pipeline_count(count: int, *, unplanned: int | None = None) -> int:
    """The number of microbatches every stage of this rank's pipeline runs. Collective over the
    pipeline group with more than one stage; ``count`` itself with one.

    Different counts inside one pipeline deadlock the 1F1B schedule's sends and receives; the plan gives
    one count per DP replica, so a difference is a planning bug, named here instead. A stage whose
    ``count`` is ``unplanned`` has no planned loader (Megatron-LM builds a GPT dataset on the first and
    last stage only) and takes the count of the stages that have one (``unplanned`` if none has).

    Raises:
        ValueError: naming the DP replica and each planned stage's count.
    """
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages <= 1:
        return count
    counts = every_rank_int(count, parallel_state.get_pipeline_model_parallel_group())
    planned = [(stage, c) for stage, c in enumerate(counts) if c != unplanned]
    if len({c for _, c in planned}) > 1:
        listed = ", ".join(f"stage {stage}: {c}" for stage, c in planned)
        raise ValueError(
            f"DP replica {parallel_state.get_data_parallel_rank()}: the stages of its pipeline were "
            f"given different numbers of microbatches ({listed}); every stage of one pipeline must "
            "run the same microbatches (the plan assigns them per DP replica)"
        )
    return planned[0][1] if planned else count


def from_last_stage(value: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's ``value`` on every stage of this pipeline (its loss report: only the
    last stage computes the loss); ``value`` itself with one stage. Collective over the pipeline group.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return value
    group = parallel_state.get_pipeline_model_parallel_group()
    out = value.to(collective_device(group)).clone()
    dist.broadcast(out, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return out.to(value.device)
