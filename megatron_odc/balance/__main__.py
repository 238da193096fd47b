"""``python -m megatron_odc.balance``: predicted bubble rates of every plan kind.

The command line lives in :mod:`megatron_odc.tools.balance_cli`; see docs/balancing.md.
"""

import sys

from megatron_odc.tools.balance_cli import main

if __name__ == "__main__":
    sys.exit(main())
