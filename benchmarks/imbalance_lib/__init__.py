"""The parts of ``benchmarks/imbalance.py``, one job per module.

``settings`` (the configurations, model and cost constants), ``model`` (the GPT with segmented
attention), ``workload`` (sample lengths, packed microbatches, the per-token loss), ``probes`` (timing
and memory instrumentation), ``fsdp2`` (the PyTorch FSDP2 peers), ``world`` (the spawned ranks that
build every backend and run the cells), ``report`` (rows, paired ratios and bounds, the text table,
timelines), ``host`` (the cost-model calibration and the emulated-bf16 check). The command line and
the notes on what is measured are in ``benchmarks/imbalance.py``.
"""
