"""``python -m memsafe``: the command line (see memsafe.cli)."""

import sys

from memsafe.cli import main

sys.exit(main())
