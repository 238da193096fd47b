"""``python -m megatron_odc.launch SCRIPT [args]``: a Megatron-LM script with ``--dp-backend odc``.

The launcher and the patches live in :mod:`megatron_odc.integration`; see docs/megatron_lm.md.
"""

from megatron_odc.integration.launch import main

if __name__ == "__main__":
    main()
