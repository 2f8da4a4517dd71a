#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench scaleout`` (:mod:`smb2.bench.scaleout`).
This path keeps working for a release."""

import sys

from smb2.bench.scaleout import main

if __name__ == "__main__":
    sys.exit(main())
