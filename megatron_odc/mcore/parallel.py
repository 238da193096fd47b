"""megatron-core's model-parallel state for one training run: set it up, read the DP group, tear down.

:func:`model_parallel` initialises ``parallel_state`` with the TP and PP sizes for the duration of a
block and yields the data-parallel coordinates the rest of the run needs (the DP rank and size, whose
ranks form one length-balancing plan, the DP group, and the pipeline stage). Everything else about
megatron's groups stays inside the adapter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch.distributed as dist
from megatron.core import parallel_state


@dataclasses.dataclass(frozen=True)
class DataParallelCoordinates:
    """Where this process sits in the data-parallel dimension.

    Attributes:
        dp_rank: this rank's index in its DP group (the TP ranks of one replica share it).
        dp_size: ranks in the DP group.
        dp_group: the DP process group (of this rank's pipeline stage).
        pp_rank: this rank's pipeline stage.
        pp_size: pipeline stages.
    """

    dp_rank: int
    dp_size: int
    dp_group: dist.ProcessGroup
    pp_rank: int = 0
    pp_size: int = 1


@contextlib.contextmanager
def model_parallel(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int = 1,
    *,
    timeout_minutes: float | None = None,
) -> Iterator[DataParallelCoordinates]:
    """megatron-core's parallel state for the block (the default process group must be up).

    ``timeout_minutes``: the collective timeout of every group megatron-core creates (its default, 30
    minutes, when None).
    """
    timeout = {} if timeout_minutes is None else {"distributed_timeout_minutes": timeout_minutes}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        **timeout,
    )
    try:
        yield DataParallelCoordinates(
            parallel_state.get_data_parallel_rank(),
            parallel_state.get_data_parallel_world_size(),
            parallel_state.get_data_parallel_group(),
            parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
    finally:
        parallel_state.destroy_model_parallel()
