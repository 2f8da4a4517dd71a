#!/usr/bin/env bash
# host_deps.sh - system packages the host build and tests want, installed
# with apt only when running as root with apt available; otherwise say what
# is missing and carry on:
#  * the libibverbs headers, so that smb2._verbs (the RDMA data path) is
#    compiled (without them smb2 builds TCP-only);
#  * Slurm (slurmctld, slurmd, munge) for tests/test_slurm.py, which runs
#    examples/slurm/ on a single-host cluster (tools/slurm_cluster.sh;
#    without it that test skips and says why);
#  * etcd (Debian's etcd-server) for replicated clusters: LocalCluster(
#    replicated=True) starts a private one (tests/test_membership.py,
#    tests/test_jepsen.py; without it they skip and say why).  Its package
#    scripts may start a system etcd on 2379 where systemd runs; the tests
#    do not use that one.
set -u
if [ ! -e /usr/include/infiniband/verbs.h ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing libibverbs-dev (for smb2._verbs, the RDMA transport)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq libibverbs-dev >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs-dev >/dev/null 2>&1; } \
      || echo "could not install libibverbs-dev: building smb2 without RDMA"
  else
    echo "no infiniband/verbs.h and no root+apt to install libibverbs-dev: building smb2 without RDMA"
  fi
fi
if ! command -v etcd >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "installing etcd-server (the membership service of replicated clusters)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends etcd-server >/dev/null 2>&1; } \
      || echo "could not install etcd-server: the replicated-cluster tests will skip"
  else
    echo "no etcd and no root+apt to install etcd-server: the replicated-cluster tests will skip"
  fi
fi
"$(dirname "$0")/slurm_cluster.sh" install || echo "no Slurm: tests/test_slurm.py will skip"
exit 0
