"""The megatron-core adapter: the only layer that imports ``megatron.core`` (besides the integrations).

- ``config``: the backends, ``ODCConfig`` and every refusal, written once (no megatron import);
- ``releases``: the supported megatron-core releases and every difference between them, one table;
- ``units``: which modules of a model are ODC units, and the TP-replicated parameters;
- ``data_parallel``: ``ODCDataParallel``, megatron-core's DP-wrapper contract over the engine;
- ``optimizer``: ``ODCOptimizer``, Megatron's optimizer surface over the owned shards;
- ``dist_ckpt/``: torch_dist checkpoints of ODC models and optimizers, and of every backend;
- ``backends``: ``build_backend`` (odc / fsdp / ddp / distopt behind one switch);
- ``step``: one training step on this rank's own microbatch count (including zero);
- ``model``, ``parallel``, ``optimizer_setup``, ``datasets``, ``rng``: megatron-core's GPT, parallel
  state, optimizer config and scheduler, pretraining datasets and generators, for the entries;
- ``fp8_te``: TransformerEngine FP8 parameters through megatron-core's ``fp8_utils``;
- ``cpu_optimizers``: megatron-core's own optimizers over CPU tensors;
- ``rl/``: ODC under a training loop someone else drives (RL / post-training: loss contracts, the
  schedule call on a rank-local count, rollout weight sync, offload, a frozen reference; docs/rl.md).

Imports ``core/`` and ``transport/`` from the package. Nothing is imported with the package itself.
"""
