"""``python -m smb2.bench``: the same as ``smb2 bench``."""

import sys

from . import main

sys.exit(main())
