"""Length balancing: cost model, partitioners and per-minibatch microbatch plans.

Owns the pure-Python planning that decides which DP rank runs which samples in which microbatches
(:func:`make_plan`), the per-sample cost model (:class:`CostModel`) and the partitioners it uses. It imports
neither megatron nor torch; every rank computes the same plan from the same inputs with no communication.
The offline tool ``python -m megatron_odc.balance`` (``tools/balance_cli.py``) compares the plans'
predicted bubble rates.
"""

from megatron_odc.balance.cost import CostModel
from megatron_odc.balance.partition import (
    balanced_partition,
    first_fit_decreasing,
    greedy_lpt,
    karmarkar_karp,
    refine,
)
from megatron_odc.balance.plan import (
    EQUAL_COUNT_PLAN_KINDS,
    PLAN_KINDS,
    TOO_LONG_POLICIES,
    Plan,
    make_plan,
)

__all__ = [
    "EQUAL_COUNT_PLAN_KINDS",
    "PLAN_KINDS",
    "TOO_LONG_POLICIES",
    "CostModel",
    "Plan",
    "balanced_partition",
    "first_fit_decreasing",
    "greedy_lpt",
    "karmarkar_karp",
    "make_plan",
    "refine",
]
