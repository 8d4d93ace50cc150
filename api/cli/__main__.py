"""``python -m rayeval.api.cli``: the ``rayeval`` command."""

import sys

from rayeval.api.cli import main

sys.exit(main())
