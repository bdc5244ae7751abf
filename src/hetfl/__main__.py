"""``python -m hetfl ...``: the ``hetfl`` command, for an environment whose scripts are not on PATH."""

import sys

from hetfl.cli import main

if __name__ == "__main__":
    sys.exit(main())
