#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench repair`` (:mod:`smb2.bench.repair`).
This path keeps working for a release."""

import sys

from smb2.bench.repair import main

if __name__ == "__main__":
    sys.exit(main())
