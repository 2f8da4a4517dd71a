#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench resume`` (:mod:`smb2.bench.resume`).
This path keeps working for a release."""

import sys

from smb2.bench.resume import main

if __name__ == "__main__":
    sys.exit(main())
