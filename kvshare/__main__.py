"""`python -m kvshare ...`: the same as the `kvshare` console script."""

import sys

from kvshare.cli import main

sys.exit(main())
