"""The parts of ``benchmarks/gpu_check.py``, one job per module.

``world`` (the rehearsal switch, where the rank bodies allocate, ``run_world``: a rank body on processes
sharing ``cuda:0``, or on CPU with the fakes), ``transport_ranks`` (the correctness, NVSHMEM, overlap and
bandwidth rank bodies), ``training_ranks`` (the GPT, batches, ``_train`` and the parity, emulated-FP8 and
TransformerEngine FP8 rank bodies, with the parameter comparisons), ``checks`` (each check's judgement
and targets, ``CHECKS``, ``RANK_FUNCTIONS``), ``report`` (the closing table, the dry run). The command
line, the table of checks and the notes on the rehearsal are in ``benchmarks/gpu_check.py``.
"""
