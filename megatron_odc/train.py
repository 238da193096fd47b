"""``python -m megatron_odc.train``: the plugin's own training entry (run under torchrun).

The parser, trainer and checkpointing live in :mod:`megatron_odc.runner`; see the README.
"""

import sys

from megatron_odc.runner.trainer import main

if __name__ == "__main__":
    sys.exit(main())
