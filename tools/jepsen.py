#!/usr/bin/env python3
"""The Jepsen harness moved into the lab: ``python -m smb2.testing.jepsen`` (the
library is :mod:`smb2.testing.jepsen`).  This path keeps working for a release."""

import sys

from smb2.testing.jepsen.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
