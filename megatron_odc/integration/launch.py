"""``python -m megatron_odc.launch SCRIPT [Megatron-LM args]``: run a Megatron-LM script with ODC's patches.

Run it under ``torchrun`` in place of the script itself, e.g.::

    MEGATRON_LM_PATH=/path/to/Megatron-LM torchrun --nproc-per-node 2 -m megatron_odc.launch \\
        pretrain_gpt.py <Megatron-LM args> --dp-backend odc

or under ``mpiexec`` for ``--odc-transport mpi`` (rank, world size, local rank and the rendezvous
address then come from MPI: ``flags.apply_megatron_lm_launch_env``, run by the patched ``parse_args``)::

    MEGATRON_LM_PATH=/path/to/Megatron-LM mpiexec -n 16 -hosts node1,node2 \\
        python -m megatron_odc.launch pretrain_gpt.py <Megatron-LM args> --dp-backend odc \\
        --odc-transport mpi

``SCRIPT`` is resolved against ``$MEGATRON_LM_PATH`` first, then the working directory. The
Megatron-LM root (``$MEGATRON_LM_PATH``, else the script's directory) is appended to ``sys.path``:
``megatron`` is a namespace package, so ``megatron.core`` still comes from the installed megatron-core
(the version the guard checks, with its prebuilt dataset helpers) while ``megatron.training``,
``megatron.legacy`` and the script's own modules (``gpt_builders``, ``model_provider``) come from the
checkout. Then :func:`megatron_odc.integration.megatron_lm.apply_megatron_lm_patches` is applied (with the
CPU patches when CUDA is absent, and then the CPU flags of ``megatron_lm.flags.CPU_FLAGS`` the user did
not set are added to ``args``, with one log line naming them), and the script runs as ``__main__``
through ``runpy`` with ``sys.argv = [SCRIPT, *args]``. When the script ends normally (returns, or
exits with status 0 as Megatron-LM does at ``--exit-interval``) the ODC chunks' transports are released
(``builders.close_odc_chunks``); the patches are reverted whenever it ends.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

logger = logging.getLogger(__name__)

MEGATRON_LM_PATH_ENV = "MEGATRON_LM_PATH"


def resolve_script(script: str, megatron_lm_path: str | None) -> str:
    """Absolute path of ``script``: under ``megatron_lm_path`` if it exists there, else the cwd.

    Raises:
        ValueError: the script exists in neither place.
    """
    candidates = []
    if megatron_lm_path and not os.path.isabs(script):
        candidates.append(os.path.join(megatron_lm_path, script))
    candidates.append(os.path.abspath(script))
    for candidate in candidates:
        if os.path.isfile(candidate):
            return os.path.abspath(candidate)
    raise ValueError(
        f"Megatron-LM script {script!r} not found (looked at {candidates}); set "
        f"{MEGATRON_LM_PATH_ENV} to the Megatron-LM checkout"
    )


def _run_script(script: str) -> None:
    """Run ``script`` as ``__main__``; an exit with status 0 (or none) counts as its normal end."""
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise


def main(argv: list[str] | None = None) -> None:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__ or "")
        return
    megatron_lm_path = os.environ.get(MEGATRON_LM_PATH_ENV)
    script = resolve_script(argv[0], megatron_lm_path)
    root = os.path.abspath(megatron_lm_path) if megatron_lm_path else os.path.dirname(script)
    if root not in sys.path:
        sys.path.append(root)

    import torch

    from megatron_odc.integration.megatron_lm import apply_megatron_lm_patches
    from megatron_odc.integration.megatron_lm.builders import close_odc_chunks
    from megatron_odc.integration.megatron_lm.flags import with_cpu_flags

    cpu = not torch.cuda.is_available()
    handle = apply_megatron_lm_patches(cpu=cpu)
    logger.info("running %s with %d patches (cpu=%s)", script, len(handle.patched), cpu)
    sys.argv = [script, *with_cpu_flags(argv[1:], cuda=not cpu)]
    try:
        _run_script(script)
        close_odc_chunks()
    finally:
        handle.revert()
