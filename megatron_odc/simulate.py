"""``python -m megatron_odc.simulate``: the step-time simulator of lockstep FSDP and ODC.

The model and the command line live in :mod:`megatron_odc.tools`; see docs/balancing.md.
"""

import sys

from megatron_odc.tools.simulate import main

if __name__ == "__main__":
    sys.exit(main())
