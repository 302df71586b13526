"""`python -m sublet` and the `sublet` console script: `sublet status [--json|--prometheus]`."""

from __future__ import annotations

import sys

from ._status import main

if __name__ == "__main__":
    sys.exit(main())
