"""`python -m asyncrl ...`: the same CLI as the `asyncrl` command (for hosts where it is not installed)."""

import sys

from asyncrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
