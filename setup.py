"""Builds the compiled parts of smb2 (everything else is in pyproject.toml).

SMB2_DEBUG=1 makes a debug build: -O0 -g, Cython line tracing and an
annotated HTML file beside each .pyx.

``smb2._verbs`` (the RDMA data path) is built only where the libibverbs
headers are installed (Debian: ``libibverbs-dev``); without them smb2 is a
TCP-only install.  SMB2_NO_VERBS=1 skips it on purpose.
"""

import glob
import os
import sysconfig

from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SMB2_DEBUG") == "1"

directives = {"language_level": 3, "embedsignature": True}
macros = []
if DEBUG:
    directives.update(linetrace=True, boundscheck=True, wraparound=True)
    macros.append(("CYTHON_TRACE_NOGIL", "1"))
cflags = ["-O0", "-g"] if DEBUG else ["-O3"]


def have_verbs_header() -> bool:
    if os.environ.get("SMB2_NO_VERBS") == "1":
        return False
    dirs = [os.environ.get("SMB2_VERBS_INCLUDE", ""), sysconfig.get_config_var("INCLUDEDIR") or "",
            "/usr/include", "/usr/local/include"]
    return any(d and os.path.exists(os.path.join(d, "infiniband", "verbs.h")) for d in dirs)


# _core.pyx is a hub that includes its parts (.pxi) and their C (.h) from
# here: the compiler looks here for the headers, and a change to any part
# rebuilds the extension
CORE_PARTS = "src/smb2/_core_parts"
extensions = [
    Extension("smb2._core", ["src/smb2/_core.pyx"], include_dirs=[CORE_PARTS],
              depends=sorted(glob.glob(f"{CORE_PARTS}/*.pxi") + glob.glob(f"{CORE_PARTS}/*.h")),
              extra_compile_args=cflags, define_macros=macros),
]
if have_verbs_header():
    extensions.append(Extension("smb2._verbs", ["src/smb2/_verbs.pyx"], extra_compile_args=cflags,
                                define_macros=macros, libraries=["ibverbs"]))

setup(ext_modules=cythonize(extensions, compiler_directives=directives, annotate=DEBUG))
