"""``python -m kvtop`` is the ``kvtop`` command."""

import sys

from kvtop.cli import main

sys.exit(main())
