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
installed megatron-core is imported first (the version the guard checks, with its prebuilt dataset
helpers); then the Megatron-LM root (``$MEGATRON_LM_PATH``, else the script's directory) is put FIRST on
``sys.path``: ``megatron`` is a namespace package, so ``megatron.training``, ``megatron.legacy`` and the
script's own modules (``gpt_builders``, ``model_provider``) come from the checkout, never from the copy
of ``megatron/training`` that the megatron-core wheel ships from 0.17 on (used only when the root has
none). One log line names the ``megatron/training`` and ``megatron.core`` that run. Then :func:`megatron_odc.integration.megatron_lm.apply_megatron_lm_patches` is applied (with the
CPU patches when CUDA is absent, and then the CPU flags of ``megatron_lm.flags.CPU_FLAGS`` the user did
not set are added to ``args``, with one log line naming them), and the script runs as ``__main__``
through ``runpy`` with ``sys.argv = [SCRIPT, *args]``. When the script ends normally (returns, or
exits with status 0 as Megatron-LM does at ``--exit-interval``) the ODC chunks' transports are released
(``builders.close_odc_chunks``) and, with the rank's last health record, its process groups are
destroyed (``megatron_lm.health.end_job``); the patches are reverted whenever it ends.

A refusal of megatron_odc's own (an unsupported Megatron-LM or megatron-core, a flag ``--dp-backend``
does not combine with, a model built without ODC: a ``ValueError`` raised in ``megatron_odc``) ends the
process with that one line on stderr and exit status 2, without a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import traceback

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


REFUSAL_EXIT_CODE = 2
"""The exit status of a refusal of megatron_odc's own (see the module docstring)."""

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_odc_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is a ``ValueError`` raised by megatron_odc's own code (its innermost frame)."""
    if not isinstance(exc, ValueError) or exc.__traceback__ is None:
        return False
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return os.path.abspath(last.filename).startswith(_PACKAGE_DIR + os.sep)


def put_checkout_first(root: str) -> None:
    """Put ``root`` first on ``sys.path``, the installed megatron-core imported before (if any)."""
    with contextlib.suppress(ImportError):  # without one, the checkout's own megatron/core runs
        import megatron.core  # noqa: F401 - keeps the installed megatron-core for the run
    if root in sys.path:
        sys.path.remove(root)
    sys.path.insert(0, root)


def describe_megatron() -> str:
    """Which ``megatron/training`` and ``megatron.core`` run (paths and versions), for the log."""
    import megatron.core
    from megatron.core import package_info

    from megatron_odc.integration.megatron_lm.releases import checkout_version, training_dir

    training = training_dir()
    version = checkout_version(training) if training else None
    return (
        f"megatron/training from {training} ({version or 'no package_info beside it'}), "
        f"megatron.core {package_info.__version__} from {os.path.dirname(megatron.core.__file__)}"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point; ``argv`` defaults to ``sys.argv[1:]``; a refusal or a peer's death exits with one
    line (``megatron_lm.health.failure_report``)."""
    finished = False
    try:
        _main(argv)
        finished = True
    except Exception as exc:
        report = _failure_report(exc)  # while this rank's health records are still kept
        if report is None:
            raise
        status, line = report
        if line is not None:
            sys.stderr.write(f"megatron_odc: {line}\n")
        sys.exit(status)
    finally:
        with contextlib.suppress(ImportError):  # nothing was started without torch
            from megatron_odc.integration.megatron_lm.health import end_job

            end_job(finished=finished)


def _failure_report(exc: BaseException) -> tuple[int, str | None] | None:
    refusal = is_odc_refusal(exc)
    try:
        from megatron_odc.integration.megatron_lm.health import failure_report
    except ImportError:  # megatron_odc's own refusal before torch / megatron-core could be imported
        return (REFUSAL_EXIT_CODE, str(exc)) if refusal else None
    return failure_report(exc, refusal=refusal)


def _main(argv: list[str] | None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(__doc__ or "")
        return
    megatron_lm_path = os.environ.get(MEGATRON_LM_PATH_ENV)
    script = resolve_script(argv[0], megatron_lm_path)
    root = os.path.abspath(megatron_lm_path) if megatron_lm_path else os.path.dirname(script)
    put_checkout_first(root)

    import torch

    from megatron_odc.integration.megatron_lm import apply_megatron_lm_patches
    from megatron_odc.integration.megatron_lm.builders import close_odc_chunks
    from megatron_odc.integration.megatron_lm.flags import with_cpu_flags
    from megatron_odc.runner.launch_env import launch_rank
    from megatron_odc.runner.log import job_info_on_rank_zero

    job_info_on_rank_zero(launch_rank(os.environ))
    cpu = not torch.cuda.is_available()
    handle = apply_megatron_lm_patches(cpu=cpu)
    logger.info(
        "%s", describe_megatron()
    )  # after the patches: Megatron-LM's imports set up logging
    logger.info(
        "running %s with %d patches for %s (cpu=%s)",
        script,
        len(handle.patched),
        handle.release.tag,
        cpu,
    )
    sys.argv = [script, *with_cpu_flags(argv[1:], cuda=not cpu)]
    try:
        _run_script(script)
        close_odc_chunks()
    finally:
        handle.revert()
