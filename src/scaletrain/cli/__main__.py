"""`python -m scaletrain.cli VERB ...`: the same command as `python -m scaletrain VERB ...`."""

import sys

from scaletrain.cli import main

if __name__ == "__main__":
    sys.exit(main())
