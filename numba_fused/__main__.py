"""``python -m numba_fused``: the ``numba-fused`` command line."""
import sys

from .cli import main

sys.exit(main())
