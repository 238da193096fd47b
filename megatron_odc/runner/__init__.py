"""The plugin's own training entry, ``python -m megatron_odc.train``, built on the megatron-core adapter.

- ``arguments``: the parser (Megatron-LM's flag names) and one validator per flag group;
- ``odc_flags``: ODC's flags and their rules, shared with the Megatron-LM integration;
- ``data_pipeline``: each rank's packed microbatches of every minibatch;
- ``trainer``: ``train`` and the ``Trainer`` whose loop hands work to its components;
- ``checkpoint``: iteration directories, the tracker, atomic saves, RNG / sampler / scheduler state;
- ``log``: Megatron-style log lines with ODC's figures;
- ``errors``: which rank prints a user error found once the process group is up (one line per job).

Imports ``mcore/``, ``core/``, ``transport/``, ``data/`` and ``balance/``; never ``megatron`` itself.
"""
