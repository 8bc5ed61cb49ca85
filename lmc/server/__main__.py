"""``python -m lmc.server`` = ``lmc server``."""

import sys

from lmc.server.cli import main

sys.exit(main())
