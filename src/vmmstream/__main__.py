"""``python -m vmmstream``: the ``vmmstream`` command."""

import sys

from .cli import main

sys.exit(main())
