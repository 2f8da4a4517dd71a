#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench attacks`` (:mod:`smb2.bench.attacks`).
This path keeps working for a release."""

import sys

from smb2.bench.attacks import main

if __name__ == "__main__":
    sys.exit(main())
