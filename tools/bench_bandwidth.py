"""smb2 against a raw baseline, per transport: ``smb2 bench bandwidth`` (see its ``--help``)."""
import sys

from smb2.bench import bandwidth

sys.exit(bandwidth())
