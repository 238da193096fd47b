"""Offline tools on top of the planners (:mod:`megatron_odc.balance` only: no torch, no megatron).

- ``balance_cli``: ``python -m megatron_odc.balance``, the predicted bubble rates of each plan kind;
- ``simulate``: ``python -m megatron_odc.simulate``, the command line of the step-time simulator;
- ``simulator``: the analytic step-time model of lockstep FSDP and ODC;
- ``paper``: the ODC paper's Tables 5 and 6 next to the simulator's predictions;
- ``calibration``: the simulator calibrated from, and compared with, a CPU benchmark file;
- ``presets``, ``reference``, ``cli_args``: model presets, the sail-sg/odc LB-Micro baseline and
  the flags both command lines share.
"""
