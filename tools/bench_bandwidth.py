"""smb2 against a raw uvloop TCP baseline (see ``python tools/bench_bandwidth.py --help``)."""
import sys

from smb2.bench import main

sys.exit(main())
