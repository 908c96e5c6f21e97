"""``python -m kvcouple``: the ``kvcouple`` command (for environments without its script)."""

import sys

from kvcouple.cli import main

if __name__ == "__main__":
    sys.exit(main())
