#!/usr/bin/env bash
# slurm_cluster.sh - a real single-host Slurm cluster (Debian's slurmctld,
# slurmd and munge) for tests/test_slurm.py and for trying
# examples/slurm/smb2_train.sbatch by hand.
#
#   tools/slurm_cluster.sh install   apt-get install the daemons (root + apt; skipped when present)
#   tools/slurm_cluster.sh start     install, write the config, start munged, slurmctld and a slurmd
#                                    per node, wait until the nodes are idle; prints SLURM_CONF=... on its last line
#                                    (after "slurm_cluster: already running" where it was)
#   tools/slurm_cluster.sh stop      stop the daemons this script started
#
# Nothing under /etc/slurm is touched: the config, state and logs live in
# $SMB2_SLURM_DIR (default /tmp/smb2-slurm), and Slurm's commands find them
# through SLURM_CONF, which the caller exports.
#
# The cluster has $SMB2_SLURM_NODES nodes (default 2), smb2-n1, smb2-n2, ...:
# one slurmd each (`slurmd -N`; Debian's Slurm is built with multiple-slurmd
# support), each on a loopback address of its own (127.0.0.11, 127.0.0.12,
# ...) that /etc/hosts names, so that a job's processes on different nodes
# can listen on the same port, as on separate hosts.  The /etc/hosts lines
# carry a marker and are removed by `stop`.
#
# Exit status: 0 ready (or stopped), 3 cannot run here (not root, no apt, no
# daemons; the reason on stderr), 1 something failed (the logs are named).
set -u
DIR=${SMB2_SLURM_DIR:-/tmp/smb2-slurm}
NODES=${SMB2_SLURM_NODES:-2}
PACKAGES="slurmctld slurmd slurm-client munge"
CONF=$DIR/slurm.conf
MUNGED_PID=/run/munge/munged.pid
HOSTS_MARK="# smb2 tools/slurm_cluster.sh"
CTLD_PORT=${SMB2_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${SMB2_SLURMD_PORT:-6818}
export SLURM_CONF=$CONF

node_names() { seq -f "smb2-n%g" 1 "$NODES"; }

cannot() { echo "slurm_cluster: cannot run here: $*" >&2; exit 3; }
fail() { echo "slurm_cluster: $*" >&2; exit 1; }

have_daemons() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    && command -v sbatch >/dev/null
}

install() {
  have_daemons && return 0
  [ "$(id -u)" = 0 ] || cannot "slurmctld/slurmd/munged are not installed and installing them needs root"
  command -v apt-get >/dev/null || cannot "slurmctld/slurmd/munged are not installed and there is no apt-get"
  echo "slurm_cluster: installing $PACKAGES" >&2
  export DEBIAN_FRONTEND=noninteractive
  # --no-install-recommends: no mail server, no docs; the first try uses the
  # package lists already there (no update: faster, and offline caches work)
  apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null 2>&1 \
    || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null 2>&1; } \
    || cannot "apt-get install $PACKAGES failed"
  have_daemons || cannot "installed $PACKAGES but the daemons are not on PATH"
}

all_idle() {
  local states
  states=$(sinfo -h -N -o %t 2>/dev/null) || return 1
  [ "$(echo "$states" | grep -cE '^(idle|mix|alloc)$')" = "$NODES" ]
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
  local cpus mem
  cpus=$(nproc)
  # slurmd's own view of the memory (MB), less 5 %: a node that reports less
  # than its configured RealMemory is drained
  mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.95}' /proc/meminfo)
  cat >"$CONF" <<EOF
# written by tools/slurm_cluster.sh: a single-host cluster for smb2's tests
ClusterName=smb2test
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
# no cgroups: this runs in containers and VMs whose cgroup tree is not ours
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
PartitionName=smb2 Nodes=ALL Default=YES MaxTime=60 State=UP
EOF
  # every node has the host's CPUs (they share them) and its share of the memory
  local i=0 name
  for name in $(node_names); do
    i=$((i + 1))
    echo "NodeName=$name NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i))" \
         "CPUs=$cpus RealMemory=$((mem / NODES)) State=UNKNOWN" >>"$CONF"
  done
}

# name each node's loopback address in /etc/hosts (marked lines, replaced)
write_hosts() {
  local i=0 name
  { grep -vF "$HOSTS_MARK" /etc/hosts || true; } >"$DIR/hosts.new"
  for name in $(node_names); do
    i=$((i + 1))
    echo "127.0.0.$((10 + i)) $name $HOSTS_MARK" >>"$DIR/hosts.new"
  done
  # in place (cat, not mv): /etc/hosts may be a bind mount
  cat "$DIR/hosts.new" >/etc/hosts || cannot "cannot write /etc/hosts, where the nodes' addresses are named"
  rm -f "$DIR/hosts.new"
}

start() {
  install
  if [ -f "$CONF" ] && all_idle; then
    echo "slurm_cluster: already running"
    echo "SLURM_CONF=$CONF"
    return 0
  fi
  [ "$(id -u)" = 0 ] || cannot "starting slurmd needs root"
  write_conf
  write_hosts
  # munged runs as the munge user, with its key from the package
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  if ! munge -n </dev/null >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged || fail "munged did not start (see /var/log/munge/munged.log)"
    touch "$DIR/munged.ours"
  fi
  pgrep -F "$DIR/slurmctld.pid" slurmctld >/dev/null 2>&1 \
    || slurmctld -f "$CONF" -i || fail "slurmctld did not start (see $DIR/log/slurmctld.log)"
  local name
  for name in $(node_names); do
    pgrep -F "$DIR/slurmd-$name.pid" >/dev/null 2>&1 \
      || slurmd -f "$CONF" -N "$name" || fail "slurmd -N $name did not start (see $DIR/log/slurmd-$name.log)"
  done
  for _ in $(seq 1 60); do
    if all_idle; then
      echo "SLURM_CONF=$CONF"
      return 0
    fi
    sleep 0.5
  done
  fail "not all $NODES nodes are idle after 30 s: $(sinfo -h -N -o '%N %t %E' 2>&1) (see $DIR/log/)"
}

# SIGTERM to each daemon named by a pid file that still runs it, then wait
# for all of them together
stop_pidfiles() {
  local pidfile pids=""
  for pidfile in "$@"; do
    [ -f "$pidfile" ] || continue
    if pgrep -F "$pidfile" >/dev/null 2>&1; then
      pids="$pids $(cat "$pidfile")"
      kill -TERM "$(cat "$pidfile")"
    fi
    rm -f "$pidfile"
  done
  for _ in $(seq 1 100); do
    [ -n "$pids" ] || return 0
    # shellcheck disable=SC2086
    kill -0 $pids 2>/dev/null || return 0
    sleep 0.1
  done
  echo "slurm_cluster: still running after 10 s: $pids" >&2
}

stop() {
  local files=("$DIR"/slurmd-*.pid "$DIR/slurmctld.pid")
  # munged only where this script started it (others on this host may use it)
  if [ -f "$DIR/munged.ours" ]; then
    files+=("$MUNGED_PID")
    rm -f "$DIR/munged.ours"
  fi
  stop_pidfiles "${files[@]}"
  if grep -qF "$HOSTS_MARK" /etc/hosts 2>/dev/null; then
    # (grep -v exits 1 when only marked lines were there: not a failure)
    { grep -vF "$HOSTS_MARK" /etc/hosts || true; } >"$DIR/hosts.new" && cat "$DIR/hosts.new" >/etc/hosts && rm -f "$DIR/hosts.new"
  fi
}

case ${1:-} in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
