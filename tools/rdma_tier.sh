#!/usr/bin/env bash
# rdma_tier.sh - the soft-RoCE tier of `make test`: the whole transport-
# parametrized test suite once more, inside ONE boot of the rxe VM
# (tools/rxe_vm.sh), with SMB2_TEST_TRANSPORTS=rdma.
#
#   tools/rdma_tier.sh [PYTEST ARGS...]
#
# Where this machine cannot run the VM (tools/rxe_vm.sh --check fails: no
# root, no apt, no qemu ...) it prints ONE line "RDMA tier skipped: <reason>"
# and exits 0 -- unless SMB2_REQUIRE_RDMA_TIER=1 (CI sets it), then that is a
# failure.  The guest runs Debian's python3 on the shared checkout with
# PYTHONPATH=src, so the host build must have made src/smb2/_verbs*.so
# (make test installs libibverbs-dev for that).
set -uo pipefail
cd "$(dirname "$0")/.."
require=${SMB2_REQUIRE_RDMA_TIER:-0}

skip() {
  if [ "$require" = 1 ]; then
    echo "RDMA tier FAILED to start (SMB2_REQUIRE_RDMA_TIER=1): $1" >&2
    exit 1
  fi
  echo "RDMA tier skipped: $1"
  exit 0
}

if ! check=$(tools/rxe_vm.sh --check 2>&1); then
  skip "$(echo "$check" | tail -1)"
fi
if ! ls src/smb2/_verbs*.so >/dev/null 2>&1; then
  skip "the host build has no smb2._verbs (install libibverbs-dev and rebuild: make test does when it runs as root with apt)"
fi

# the VM's own limit: the tier takes ~5 min quiet and ~10-15 min on a busy
# machine (TCG shares its cores); a test cut by the hang guard adds 200 s
export RXE_VM_TIMEOUT=${RXE_VM_TIMEOUT:-1500}
echo "RDMA tier: the test suite with SMB2_TEST_TRANSPORTS=rdma in a soft-RoCE VM ($check)"
start=$(date +%s)
# per-test timeout: TCG emulates every instruction, yet the slowest test takes
# well under a minute there (the whole tier ~150 s on a quiet machine); a test
# stuck for 3 minutes gets every thread's traceback dumped (faulthandler), and
# at 4 it fails by name and the tier goes on -- well inside the VM's limit, so
# a hang is reported as the test it is, not as the VM's timeout.  A test on
# uvloop is out of pytest-timeout's reach (its signal is handled inside
# uvloop's C loop): SMB2_TEST_HANG_GUARD (tests/conftest.py) cancels an async
# test after 200 s, so it fails by name with the line it waited on
tools/rxe_vm.sh --env PYTHONPATH="$PWD/src" --env SMB2_TEST_TRANSPORTS=rdma \
  --env SMB2_RDMA_TIER=1 --env SMB2_TEST_HANG_GUARD=200 --env PYTHONUNBUFFERED=1 -- \
  python3 -m pytest -p no:cacheprovider --timeout=240 -o faulthandler_timeout=180 -q -rs "$@" tests
rc=$?
echo "RDMA tier: exit code $rc after $(( $(date +%s) - start )) s"
exit $rc
