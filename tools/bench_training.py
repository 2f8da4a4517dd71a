#!/usr/bin/env python3
"""The benchmark moved into the package: ``smb2 bench training`` (:mod:`smb2.bench.training`).
This path keeps working for a release."""

import sys

from smb2.bench.training import cli

if __name__ == "__main__":
    sys.exit(cli())
