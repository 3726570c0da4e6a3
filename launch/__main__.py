"""`python -m launch ...`: the same CLI as the `asyncrl` command (for hosts where it is not installed)."""

import sys

from launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
