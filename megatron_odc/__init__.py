"""megatron-odc: an ODC (on-demand communication) data-parallel backend for megatron-core.

Glossary, used the same way in every module:

- minibatch: the samples of one optimizer step, over all DP ranks.
- microbatch: one forward/backward pass of one rank; ranks may run different numbers of them.
- fetch: a rank pulls the parameter shards of a bucket from their owners (one-sided get).
- push: a rank adds its gradient slices into the owners' fp32 accumulators (one-sided accumulate).
- fence: the DP-wide point where every rank's earlier operations are complete and visible.

Lower layers (``layout``, ``balance``, ``transport``, the engine, ``telemetry``, ``simulate``) import no
megatron module; only the Megatron-facing modules and ``megatron_odc.patches`` do.
"""

__version__ = "0.1.0"
