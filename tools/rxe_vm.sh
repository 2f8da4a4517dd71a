#!/usr/bin/env bash
# rxe_vm.sh - run a command inside a throw-away Debian bookworm VM that has a
# REAL soft-RoCE device (kernel rdma_rxe driver), Debian's python3-pyverbs and
# the project's test dependencies (tools/rxe_vm_requirements.txt).
#
#   tools/rxe_vm.sh [options] [--] CMD [ARGS...]
#   tools/rxe_vm.sh --check      # one line: can this machine run the tier?
#   tools/rxe_vm.sh --build      # only build/update the image
#
# e.g. from the repo root:
#   tools/rxe_vm.sh --env PYTHONPATH=$PWD/src -- python3 tools/rxe_probe.py
#   tools/rxe_vm.sh --env PYTHONPATH=$PWD/src -- python3 -m pytest tests
#
# What it does, every step idempotent:
#   1. host packages (apt-get, only if missing): qemu-system-x86 mmdebstrap
#      e2fsprogs cpio (+ gzip util-linux coreutils)
#   2. if the image in $RXE_VM_DIR is missing or stale (its stamp holds a hash
#      of the guest package list, the requirements file and the build code):
#      download the requirements as cp311 wheels with the HOST's pip (the guest
#      has no network), mmdebstrap a bookworm rootfs (on /dev/shm when there is
#      room) with python3-pyverbs rdma-core ..., pip-install the wheels into it
#      offline, unpack Debian's generic amd64 kernel .deb into it (no
#      initramfs-tools run), make an ext4 image with `mke2fs -d` (no loop
#      device, no mount), a tiny busybox initramfs, and an ELF vmlinux.
#   3. boot it with qemu: KVM if /dev/kvm really works, else TCG (where
#      /dev/kvm is kvm_pvm, which cannot boot a stock kernel: TCG); qboot
#      firmware, root disk with snapshot=on (every run starts from the pristine
#      image, runs can be concurrent), NO NIC at all, the share directories via
#      9p at the SAME path as on the host.
#   4. in the guest (no systemd/udev): modprobe rdma_rxe, a dummy netdev (or a
#      veth pair) with a TEST-NET-1 address, `rdma link add rxe0 type rxe
#      netdev ...`, wait for PORT_ACTIVE + the RoCE v2 GID, cd to the caller's
#      cwd, run CMD (stdout/stderr on the serial console = this stdout), power
#      off.
#   5. exit with CMD's exit code: 124 on timeout, 125 on VM/infra failure,
#      126 if the cwd is not inside a share, 127 if CMD is not found.
#
# Options:
#   --check         print one line and exit 0 if this machine can run the tier
#                   ("ok: ..."), else print the reason and exit 1; installs
#                   and builds nothing (may run `apt-get update` once to see
#                   whether the host packages are available)
#   --build         only build/update the image (progress on stderr) and exit
#   --rebuild       delete and rebuild the image first
#   --share DIR     share DIR (read-write, 9p, cache=none) at the same path in
#                   the guest; repeatable; default: the current directory
#   --share-ro DIR  share DIR read-only with cache=loose (faster)
#   --cwd DIR       directory to run CMD in (default: current directory)
#   --env VAR=VAL   export VAR=VAL for CMD in the guest; repeatable
#   --veth          two rxe devices: rxe0 on veth0 (192.0.2.1) and rxe1 on
#                   veth1 (192.0.2.2), policy routing forces traffic through
#                   the veth: packets really go through the guest's UDP/IP
#                   stack; default is one rxe0 on a dummy netdev (rxe's
#                   internal loopback path)
#   --debug         show all kernel messages and the guest init trace
#
# Environment:
#   RXE_VM_DIR         image/cache dir (default /var/tmp/smb2-rxe-vm)
#   RXE_VM_ACCEL       auto | kvm | tcg  (default auto: kvm if /dev/kvm works)
#   RXE_VM_MEM         guest memory in MiB (default 2048)
#   RXE_VM_CPUS        guest vCPUs (default: host nproc, at most 4)
#   RXE_VM_TIMEOUT     seconds before the VM is killed (default 900)
#   RXE_VM_EXTRA_PKGS  extra guest Debian packages, comma separated
#                      (part of the image hash: the image is rebuilt)
#   RXE_VM_PIP         host command used to download the wheels
#                      (default: `python3 -m pip`)
#   RXE_VM_BUILD_TMP   rootfs build dir (default /dev/shm/... if > 4 GiB free)
#
# Inside the guest CMD sees: RXE_DEV=rxe0, RXE_NETDEV, RXE_IPV4, RXE_GID_INDEX
# (index of the IPv4-mapped RoCEv2 GID), and with --veth also RXE_DEV2=rxe1,
# RXE_IPV4_2, RXE_GID_INDEX2. The guest runs as root (CAP_IPC_LOCK, no memlock
# limit problems), without systemd/udev; /dev nodes come from devtmpfs. Its
# python3 is Debian's 3.11.2: an extension module built on the host by any
# CPython 3.11 imports there (same cpython-311 ABI tag).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REQS=$HERE/rxe_vm_requirements.txt
VM_DIR=${RXE_VM_DIR:-/var/tmp/smb2-rxe-vm}
ACCEL=${RXE_VM_ACCEL:-auto}
MEM=${RXE_VM_MEM:-2048}
NCPU_HOST=$(nproc)
CPUS=${RXE_VM_CPUS:-$(( NCPU_HOST > 4 ? 4 : NCPU_HOST ))}
TIMEOUT=${RXE_VM_TIMEOUT:-900}
SUITE=bookworm
# python3-numpy / python3-pytest are NOT taken from Debian: the pinned wheels
# from $REQS go to /usr/local and must be the same versions as on the host.
# They live IN the image rather than coming from the host venv over a 9p
# share: that works too, but every import then goes over 9p and Python-heavy
# tests ran 3-5x slower.
# etcd-server: the replicated buffers' membership, so the tier runs them over rdma too
GUEST_PKGS="python3,python3-pip,python3-pyverbs,rdma-core,ibverbs-providers,ibverbs-utils,iproute2,kmod,mount,procps,busybox-static,etcd-server"
[ -n "${RXE_VM_EXTRA_PKGS:-}" ] && GUEST_PKGS="$GUEST_PKGS,$RXE_VM_EXTRA_PKGS"

SHARES=()
ENVS=()
CWD=$PWD
CHECK=0
BUILD_ONLY=0
REBUILD=0
MODE=dummy
DEBUG=0
usage() { echo "usage: rxe_vm.sh [--check | --build | --rebuild] [--share DIR]... [--share-ro DIR]... [--cwd DIR] [--env VAR=VAL]... [--veth] [--debug] [--] CMD [ARGS...]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --check) CHECK=1; shift;;
    --build) BUILD_ONLY=1; shift;;
    --rebuild) REBUILD=1; shift;;
    --share) [ $# -ge 2 ] || usage; SHARES+=("rw:$(realpath "$2")"); shift 2;;
    --share-ro) [ $# -ge 2 ] || usage; SHARES+=("ro:$(realpath "$2")"); shift 2;;
    --cwd) [ $# -ge 2 ] || usage; CWD=$(realpath "$2"); shift 2;;
    --env) [ $# -ge 2 ] || usage
           [[ $2 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || { echo "rxe_vm.sh: --env wants VAR=VALUE, got: $2" >&2; exit 2; }
           ENVS+=("$2"); shift 2;;
    --veth) MODE=veth; shift;;
    --debug) DEBUG=1; shift;;
    --) shift; break;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0;;
    -*) echo "rxe_vm.sh: unknown option $1" >&2; exit 2;;
    *) break;;
  esac
done
[ ${#SHARES[@]} -eq 0 ] && SHARES=("rw:$CWD")
for s in "${SHARES[@]}"; do
  case "$s" in *[[:space:]]*) echo "rxe_vm.sh: share paths with whitespace are not supported: ${s#*:}" >&2; exit 2;; esac
done
if [ $CHECK -eq 0 ] && [ $BUILD_ONLY -eq 0 ] && [ $# -eq 0 ]; then usage; fi

log() { echo "[rxe-vm $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 125; }

IMG=$VM_DIR/rootfs.img
KERNEL=$VM_DIR/vmlinuz
VMLINUX=$VM_DIR/vmlinux
INITRD=$VM_DIR/initrd.cpio.gz
STAMP=$VM_DIR/image.ok
LOCK=$VM_DIR/.lock

# ---------------------------------------------------------------- host packages
missing_host_pkgs() {  # prints the Debian packages whose tools are missing
  local missing=()
  command -v qemu-system-x86_64 >/dev/null || missing+=(qemu-system-x86)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  command -v mke2fs >/dev/null || missing+=(e2fsprogs)
  command -v cpio >/dev/null || missing+=(cpio)
  command -v gzip >/dev/null || missing+=(gzip)
  command -v flock >/dev/null || missing+=(util-linux)
  command -v timeout >/dev/null || missing+=(coreutils)
  echo "${missing[*]}"
}

apt_has() {  # $1=package: does apt know an installable candidate?
  local c
  c=$(apt-cache policy "$1" 2>/dev/null | awk '/Candidate:/{print $2}')
  [ -n "$c" ] && [ "$c" != "(none)" ]
}

install_host_pkgs() {  # $@=packages
  [ $# -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || die "missing host packages ($*) and not root to apt-get install them"
  command -v apt-get >/dev/null || die "missing host packages ($*) and no apt-get"
  log "installing host packages: $*"
  # apt-get update only if the package lists do not know the packages yet
  apt_has "$1" || apt-get update -qq || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } \
    || die "apt-get install $* failed"
}

host_pip() {  # sets PIP (array) to a working host pip
  if [ -n "${RXE_VM_PIP:-}" ]; then read -r -a PIP <<<"$RXE_VM_PIP"; return 0; fi
  local py
  for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null && "$py" -m pip --version >/dev/null 2>&1; then PIP=("$py" -m pip); return 0; fi
  done
  install_host_pkgs python3-pip
  PIP=(/usr/bin/python3 -m pip)
}

# ---------------------------------------------------------------- image build
image_hash() {
  # Anything that changes what is IN the image: the package list, the pinned
  # wheels (comments in the file do not count), and the build code itself (declare -f prints the functions without
  # comments, so comment edits do not force a rebuild; the guest init scripts
  # are written per run and are not part of it).
  { echo "$SUITE $GUEST_PKGS"; sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$REQS"; declare -f build_image; } \
    | sha256sum | cut -c1-16
}

image_current() {
  [ -f "$STAMP" ] && [ -f "$IMG" ] && [ -f "$INITRD" ] && { [ -f "$VMLINUX" ] || [ -f "$KERNEL" ]; } \
    && grep -qx "hash=$(image_hash)" "$STAMP"
}

build_image() {
  local t0=$SECONDS b r kver
  mkdir -p "$VM_DIR"
  # Build the rootfs on tmpfs when there is room: dpkg fsyncs a lot, and
  # mke2fs -d reads every file; on a plain disk that made the build 2-4x
  # slower (161 s instead of 40-58 s).
  b=${RXE_VM_BUILD_TMP:-}
  if [ -z "$b" ]; then
    if [ "$(df -Pm /dev/shm 2>/dev/null | awk 'NR==2{print $4}')" -gt 4096 ] 2>/dev/null; then
      b=/dev/shm/smb2-rxe-vm-build.$$
    else
      b=$VM_DIR/build
    fi
  fi
  BUILD_TMPDIR=$b
  trap 'rm -rf "$BUILD_TMPDIR"' EXIT
  rm -rf "$b" "$STAMP" "$IMG" "$KERNEL" "$VMLINUX" "$INITRD"
  mkdir -p "$b/wheels"
  r=$b/rootfs

  # 1. Wheels for the guest, fetched by the HOST's pip (its configuration,
  # indexes and caches are the ones the host venv used, so the same files
  # come back) for the guest interpreter: CPython 3.11, glibc 2.36.
  host_pip
  log "downloading guest wheels with ${PIP[*]} (-r ${REQS##*/})"
  local plats=() v
  for v in $(seq 36 -1 17); do plats+=(--platform "manylinux_2_${v}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  "${PIP[@]}" download -q --disable-pip-version-check --only-binary=:all: \
      --python-version 3.11 --implementation cp --abi cp311 "${plats[@]}" \
      -d "$b/wheels" -r "$REQS" >"$b/pip-download.log" 2>&1 \
    || { tail -20 "$b/pip-download.log" >&2; die "pip download of the guest wheels failed"; }
  cp "$REQS" "$b/wheels/requirements.txt"

  # 2. Guest apt sources: the host's own (same mirror the host already uses),
  # else mmdebstrap's default.
  local SOURCES=()
  if grep -qs "^Suites:.*\b$SUITE\b" /etc/apt/sources.list.d/debian.sources; then
    SOURCES=(/etc/apt/sources.list.d/debian.sources)
  elif grep -qs "^deb .* $SUITE " /etc/apt/sources.list; then
    SOURCES=(/etc/apt/sources.list)
  fi
  # Hooks run as `sh -c HOOK exec ROOTFS`; they are files so quoting stays sane.
  # The kernel is NOT put in --include: that would pull initramfs-tools and run
  # update-initramfs (slow, and we use our own tiny initramfs). It is unpacked
  # here instead (apt-get download inside the chroot). NOT with `dpkg -x`: that
  # replaces the usr-merge symlink /lib by a real directory and breaks every
  # binary in the chroot; tar --keep-directory-symlink keeps it. The generic
  # amd64 flavour is needed: Debian's cloud kernel has neither RDMA_RXE nor 9p.
  cat >"$b/hook-kernel.sh" <<'EOF'
set -e
kpkg=$(chroot "$1" apt-cache depends linux-image-amd64 | sed -n 's/.*Depends: \(linux-image-[0-9].*-amd64\)$/\1/p' | head -1)
echo "kernel package: $kpkg"
mkdir -p "$1/tmp/k"
chroot "$1" sh -c "cd /tmp/k && apt-get download -q $kpkg"
dpkg-deb --fsys-tarfile "$1"/tmp/k/*.deb | tar -x --keep-directory-symlink -C "$1"
rm -rf "$1/tmp/k"
echo rxevm > "$1/etc/hostname"; echo "127.0.1.1 rxevm" >> "$1/etc/hosts"
EOF
  # Offline install with the GUEST's pip: it checks the wheel tags against the
  # real guest interpreter and writes proper dist-info/entry points to
  # /usr/local (found before /usr/lib/python3/dist-packages on import). env -i:
  # the host's PIP_* variables name files that do not exist in the chroot.
  cat >"$b/hook-pip.sh" <<'EOF'
set -e
mkdir -p "$1/tmp/wheels"
cp "$2"/* "$1/tmp/wheels/"
chroot "$1" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
  python3 -m pip install -q --no-index --find-links /tmp/wheels --break-system-packages \
  --root-user-action=ignore --no-warn-script-location --disable-pip-version-check \
  -r /tmp/wheels/requirements.txt
rm -rf "$1/tmp/wheels" "$1/root/.cache"
EOF
  log "mmdebstrap $SUITE rootfs (packages: $GUEST_PKGS; sources: ${SOURCES[*]:-mmdebstrap default}) + pip install"
  mmdebstrap --mode=root --variant=apt --include="$GUEST_PKGS" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --customize-hook="sh $b/hook-kernel.sh \"\$1\"" \
    --customize-hook="sh $b/hook-pip.sh \"\$1\" $b/wheels" \
    "$SUITE" "$r" "${SOURCES[@]}" \
    >"$b/mmdebstrap.log" 2>&1 || { tail -30 "$b/mmdebstrap.log" >&2; die "mmdebstrap failed (log: $b/mmdebstrap.log)"; }

  kver=$(ls "$r/lib/modules" | head -1)
  [ -n "$kver" ] && [ -f "$r/boot/vmlinuz-$kver" ] || die "no kernel in rootfs"
  log "kernel $kver; pruning unneeded module trees"
  ( cd "$r/lib/modules/$kver/kernel" && rm -rf sound drivers/gpu drivers/media drivers/net/wireless \
      drivers/net/ethernet drivers/usb drivers/staging drivers/iio drivers/hwmon drivers/scsi drivers/bluetooth \
      drivers/input drivers/hid drivers/video drivers/mmc drivers/isdn drivers/ata net/wireless net/mac80211 net/bluetooth )
  chroot "$r" depmod "$kver"
  cp "$r/boot/vmlinuz-$kver" "$KERNEL.tmp"
  # Debian's bzImage is XZ-compressed; under TCG its self-decompression takes
  # ~5 s of EVERY boot. qemu boots the uncompressed ELF vmlinux directly via
  # its PVH entry note (CONFIG_PVH=y), so unpack it once (with the guest's
  # python3: the host's may lack lzma). On failure the bzImage is booted.
  chroot "$r" python3 - "/boot/vmlinuz-$kver" >"$VMLINUX.tmp" <<'PY' && mv "$VMLINUX.tmp" "$VMLINUX" \
    || { rm -f "$VMLINUX.tmp"; log "vmlinux extraction failed, will boot the bzImage (slower)"; }
import lzma, sys
data = open(sys.argv[1], 'rb').read()
off = data.find(b'\xfd7zXZ\x00')
if off < 0:
    sys.exit(1)
out = lzma.LZMADecompressor().decompress(data[off:])
if out[:4] != b'\x7fELF':
    sys.exit(1)
sys.stdout.buffer.write(out)
PY

  log "building busybox initramfs"
  local ird=$b/initrd mods m
  mkdir -p "$ird"/{bin,proc,sys,dev,newroot,lib/modules}
  cp "$r/bin/busybox" "$ird/bin/busybox"
  # modules needed to mount the root disk and the 9p control share, in load order
  mods=$(for m in virtio_pci virtio_blk crc32c_generic libcrc32c ext4 9pnet_virtio 9p; do
           chroot "$r" modprobe --show-depends -S "$kver" "$m"; done | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++')
  : >"$ird/modules.list"
  for m in $mods; do cp "$r$m" "$ird/lib/modules/"; basename "$m" >>"$ird/modules.list"; done
  # Generic /init: early mounts by STATIC busybox (every exec of a dynamically
  # linked binary costs ~0.1-0.2 s under TCG), mount the 9p control dir and
  # hand over to the per-run stage1.sh written by this script (so guest logic
  # changes need no image rebuild).
  cat >"$ird/init" <<'EOF'
#!/bin/busybox sh
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t sysfs sysfs /sys
$B mount -t devtmpfs devtmpfs /dev
for m in $($B cat /modules.list); do $B insmod /lib/modules/$m 2>/dev/null; done
$B mkdir -p /ctl
if ! $B mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none rxevm_ctl /ctl; then
  echo "rxe-vm initramfs: cannot mount the 9p control dir"; $B poweroff -f
fi
exec $B sh /ctl/stage1.sh
EOF
  chmod +x "$ird/init"
  ( cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1 ) >"$INITRD.tmp"

  log "making ext4 image"
  local used_mb size_mb
  used_mb=$(du -sm "$r" | cut -f1)
  size_mb=$(( used_mb * 13 / 10 + 256 ))
  rm -rf "${r:?}/boot"/* "${r:?}/var/cache/apt/archives/"*.deb
  mke2fs -q -t ext4 -L rxeroot -E root_owner=0:0 -O ^has_journal -d "$r" "$b/rootfs.img" "${size_mb}M" >/dev/null \
    || die "mke2fs failed"
  cp --sparse=always "$b/rootfs.img" "$IMG.tmp"
  mv "$IMG.tmp" "$IMG"; mv "$KERNEL.tmp" "$KERNEL"; mv "$INITRD.tmp" "$INITRD"
  cp "$b/mmdebstrap.log" "$VM_DIR/mmdebstrap.log"
  printf 'kernel=%s\nhash=%s\n' "$kver" "$(image_hash)" >"$STAMP"
  rm -rf "$b"
  trap - EXIT
  log "image ready in $((SECONDS - t0)) s: $(du -h --apparent-size "$IMG" | cut -f1) image ($(du -h "$IMG" | cut -f1) used)"
}

ensure_image() {
  # fd 9 holds a lock on $LOCK for the rest of this process (and its qemu):
  # shared while a VM uses the image, exclusive while it is (re)built, so a
  # rebuild never deletes the files under a VM that is about to open them.
  { mkdir -p "$VM_DIR" && exec 9>>"$LOCK"; } 2>/dev/null || die "cannot write $VM_DIR (not root?)"
  flock -s 9
  if [ $REBUILD -eq 1 ] || ! image_current; then
    flock -x 9
    if [ $REBUILD -eq 1 ] || ! image_current; then
      if [ -f "$STAMP" ] && [ $REBUILD -eq 0 ]; then log "image is stale (guest packages, requirements or build code changed): rebuilding"; fi
      log "building the guest image in $VM_DIR (about 1 min with a warm apt/pip; progress below)"
      build_image
    fi
    flock -s 9
  fi
}

# ---------------------------------------------------------------- accel choice
pick_accel() {
  case "$ACCEL" in
    kvm) echo kvm;;
    tcg) echo tcg;;
    auto)
      # /dev/kvm backed by kvm_pvm (Pagetable-based VM, used by some nested
      # sandboxes/Firecracker hosts) answers the KVM API and creates VMs, but
      # only boots PVM-enabled guest kernels: a stock Debian kernel hangs right
      # after "Probing EDD" with no output at all. Use TCG there.
      if [ -d /sys/module/kvm_pvm ]; then echo tcg; return; fi
      if [ -r /dev/kvm ] && [ -w /dev/kvm ] && command -v python3 >/dev/null && python3 - <<'EOF' 2>/dev/null
import os, fcntl
fd = os.open('/dev/kvm', os.O_RDWR)
assert fcntl.ioctl(fd, 0xAE00) == 12          # KVM_GET_API_VERSION
vm = fcntl.ioctl(fd, 0xAE01, 0)                # KVM_CREATE_VM
os.close(vm)
EOF
      then echo kvm; else echo tcg; fi;;
    *) die "RXE_VM_ACCEL must be auto, kvm or tcg";;
  esac
}

# ---------------------------------------------------------------- --check
check_machine() {  # one line on stdout; exit 0 = can run, 1 = cannot (the line is the reason)
  no() { echo "$*"; exit 1; }
  [ "$(uname -s)" = Linux ] || no "not Linux"
  [ "$(uname -m)" = x86_64 ] || no "host is $(uname -m), not x86_64 (the host-built extension must run in an amd64 guest)"
  [ "$(id -u)" = 0 ] || no "not root (apt-get, mmdebstrap and chroot need root)"
  local missing p notes=() updated=0
  missing=$(missing_host_pkgs)
  if [ -n "$missing" ]; then
    command -v apt-get >/dev/null || no "no apt-get to install the missing host packages: $missing"
    for p in $missing; do
      if ! apt_has "$p" && [ $updated -eq 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; updated=1; fi
      apt_has "$p" || no "host package $p cannot be installed (apt has no candidate for it)"
    done
    notes+=("will apt-get install: $missing")
  fi
  if image_current; then
    notes+=("image ready in $VM_DIR")
  else
    local free_mb dir=$VM_DIR
    while [ ! -d "$dir" ]; do dir=$(dirname "$dir"); done
    free_mb=$(df -Pm "$dir" | awk 'NR==2{print $4}')
    [ "${free_mb:-0}" -ge 2048 ] || no "less than 2 GiB free in $dir for the guest image"
    if [ -z "${RXE_VM_PIP:-}" ] && ! python3 -m pip --version >/dev/null 2>&1 \
        && ! /usr/bin/python3 -m pip --version >/dev/null 2>&1; then
      if ! apt_has python3-pip && [ $updated -eq 0 ]; then apt-get update -qq >/dev/null 2>&1 || true; fi
      apt_has python3-pip || no "no pip on the host to download the guest's Python wheels, and python3-pip cannot be installed"
    fi
    notes+=("image will be built in $VM_DIR first (~1-2 min)")
  fi
  local line n
  line="ok: soft-RoCE VM tier can run (qemu $(pick_accel))"
  for n in "${notes[@]}"; do line+="; $n"; done
  echo "$line"
  exit 0
}

# ---------------------------------------------------------------- guest init
write_guest_init() {
  # stage1.sh: busybox sh in the initramfs (static busybox: every exec under TCG
  # costs ~0.1-0.2 s for a dynamically linked binary, much less for busybox).
  cat >"$1/stage1.sh" <<'EOF'
B=/bin/busybox
. /ctl/params.sh
fail() { echo "rxe-vm stage1: $*"; echo 125 > /ctl/rc; $B sync; $B poweroff -f; }
read up x < /proc/uptime; echo "initramfs $up" >> /ctl/stages
i=0; while [ ! -b /dev/vda ] && [ $i -lt 1000 ]; do $B usleep 10000; i=$((i+1)); done
$B mount -t ext4 -o rw,noatime /dev/vda /newroot || fail "cannot mount /dev/vda"
$B mount -t tmpfs -o mode=755,size=64m tmpfs /newroot/run
$B mkdir -p /newroot/run/rxevm
$B mount --move /ctl /newroot/run/rxevm
$B mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
i=0
for spec in $RXE_SHARES; do
  s=${spec#*:}
  # rw shares: cache=none (host and guest see each other's writes at once);
  # ro shares: read-only + cache=loose (page cache: much faster imports)
  if [ "${spec%%:*}" = ro ]; then o=ro,cache=loose; else o=cache=none; fi
  $B mkdir -p "/newroot$s"
  $B mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,access=any,$o "share$i" "/newroot$s" || fail "cannot mount share $s"
  i=$((i+1))
done
echo rxevm > /proc/sys/kernel/hostname
$B ip link set lo up
$B mount --move /proc /newroot/proc
$B mount --move /sys /newroot/sys
$B mount --move /dev /newroot/dev
$B mkdir -p /newroot/dev/pts /newroot/dev/shm
$B mount -t devpts -o gid=5,mode=620 devpts /newroot/dev/pts
$B mount -t tmpfs -o mode=1777 tmpfs /newroot/dev/shm
$B ln -sf /proc/self/fd /newroot/dev/fd
exec $B switch_root /newroot /bin/bash /run/rxevm/guest-init.sh
EOF
  # guest-init.sh: PID 1 (bash) in the real root after switch_root.
  cat >"$1/guest-init.sh" <<'EOF'
#!/bin/bash
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 TERM=dumb
CTL=/run/rxevm
. $CTL/params.sh
finish() {
  echo "$1" > $CTL/rc
  sync
  # console loglevel 0: no "reboot: Power down" (an emergency-level message)
  # after the command's last output line
  [ "$RXE_DEBUG" = 1 ] || echo "0 4 0 7" > /proc/sys/kernel/printk
  /bin/busybox poweroff -f 2>/dev/null || echo o > /proc/sysrq-trigger
  sleep 30
}
stage() { local up x; read -r up x < /proc/uptime; echo "$1 $up" >> $CTL/stages; }
[ "$RXE_DEBUG" = 1 ] && set -x
# the serial console adds \r to every \n (ONLCR) otherwise
stty -F /dev/console -onlcr 2>/dev/null
stage switch_root
# (shell builtins and `ip -batch` where possible: fork+exec is slow under TCG)
if [ "$RXE_MODE" = veth ]; then
  # Both ends stay in the init netns: rdma_rxe in 6.1 opens its UDP 4791
  # socket in init_net only, so an rxe on a netdev in another netns never
  # receives anything. With both addresses local, the kernel would route
  # 192.0.2.1 -> 192.0.2.2 via lo (modify_qp(RTR) fails with ETIMEDOUT), so
  # policy routing sends traffic whose output device is veth0/veth1 out of the
  # veth ("loopback cable" trick); the local table is consulted after those
  # rules; static neighbours instead of ARP; accept_local/rp_filter so the
  # receiving side accepts a packet whose source address is local.
  modprobe -a rdma_rxe ib_uverbs rdma_ucm veth || finish 125
  ip -batch - <<'IP' || finish 125
link add veth0 type veth peer name veth1
addr add 192.0.2.1/24 dev veth0
addr add 192.0.2.2/24 dev veth1
rule add pref 100 oif veth0 lookup 100
rule add pref 101 oif veth1 lookup 101
rule add pref 1000 lookup local
rule del pref 0 lookup local
link set veth0 up
link set veth1 up
route add 192.0.2.0/24 dev veth0 src 192.0.2.1 table 100
route add 192.0.2.0/24 dev veth1 src 192.0.2.2 table 101
IP
  read -r m0 < /sys/class/net/veth0/address; read -r m1 < /sys/class/net/veth1/address
  ip -batch - <<IP || finish 125
neigh replace 192.0.2.2 lladdr $m1 dev veth0 nud permanent
neigh replace 192.0.2.1 lladdr $m0 dev veth1 nud permanent
IP
  for c in all default veth0 veth1; do
    echo 1 > /proc/sys/net/ipv4/conf/$c/accept_local; echo 0 > /proc/sys/net/ipv4/conf/$c/rp_filter
  done
  rdma link add rxe0 type rxe netdev veth0 || finish 125
  rdma link add rxe1 type rxe netdev veth1 || finish 125
  export RXE_DEV=rxe0 RXE_NETDEV=veth0 RXE_IPV4=192.0.2.1 RXE_DEV2=rxe1 RXE_NETDEV2=veth1 RXE_IPV4_2=192.0.2.2
else
  # TEST-NET-1 address on a dummy netdev; the guest has no NIC at all, and rxe
  # short-circuits traffic whose source and destination IP are equal.
  # numdummies=0: plain `modprobe dummy` creates a stray dummy0.
  modprobe -a rdma_rxe ib_uverbs rdma_ucm || finish 125
  modprobe dummy numdummies=0 || finish 125
  ip -batch - <<'IP' || finish 125
link add rxenet0 type dummy
addr add 192.0.2.1/24 dev rxenet0
link set rxenet0 up
IP
  rdma link add rxe0 type rxe netdev rxenet0 || finish 125
  export RXE_DEV=rxe0 RXE_NETDEV=rxenet0 RXE_IPV4=192.0.2.1
fi
# wait for PORT_ACTIVE and for the IPv4-mapped (RoCE v2) GID to show up
GIDX=
gid_index() {  # $1=dev $2=ipv4 -> GIDX = index of the ::ffff:ipv4 GID
  local want f v IFS=.
  set -- "$1" $2
  printf -v want '0000:0000:0000:0000:0000:ffff:%02x%02x:%02x%02x' "$2" "$3" "$4" "$5"
  GIDX=
  for f in /sys/class/infiniband/$1/ports/1/gids/*; do
    v=; read -r v < "$f" 2>/dev/null
    if [ "$v" = "$want" ]; then GIDX=${f##*/}; return 0; fi
  done
  return 1
}
dev_ready() {  # $1=dev $2=ipv4
  local st=; read -r st < /sys/class/infiniband/$1/ports/1/state 2>/dev/null
  [[ $st == *ACTIVE* ]] && gid_index "$1" "$2"
}
for ((n = 0; n < 1000; n++)); do
  dev_ready rxe0 "$RXE_IPV4" && { [ "$RXE_MODE" != veth ] || dev_ready rxe1 "$RXE_IPV4_2"; } && break
  sleep 0.01
done
dev_ready rxe0 "$RXE_IPV4" && export RXE_GID_INDEX=$GIDX
[ "$RXE_MODE" = veth ] && dev_ready rxe1 "$RXE_IPV4_2" && export RXE_GID_INDEX2=$GIDX
[ -n "${RXE_GID_INDEX:-}" ] || { echo "rxe-vm: rxe0 did not come up"; rdma link; finish 125; }
stage rxe_ready
set +x
bash $CTL/cmd.sh </dev/null
rc=$?
stage cmd_done
finish $rc
EOF
}

# ---------------------------------------------------------------- main
[ $CHECK -eq 1 ] && check_machine
# shellcheck disable=SC2046  # word splitting of the package list is intended
install_host_pkgs $(missing_host_pkgs)
ensure_image
if [ $BUILD_ONLY -eq 1 ]; then log "image: $IMG ($(grep '^kernel=' "$STAMP"))"; exit 0; fi
BOOT_KERNEL=$KERNEL; [ -f "$VMLINUX" ] && BOOT_KERNEL=$VMLINUX

ACC=$(pick_accel)
CTL=$(mktemp -d "${TMPDIR:-/tmp}/smb2-rxe-vm-run.XXXXXX")
QPID=
cleanup() { [ -n "$QPID" ] && kill "$QPID" 2>/dev/null; rm -rf "$CTL"; }
trap cleanup EXIT
trap 'exit 130' INT TERM
write_guest_init "$CTL"
{
  printf 'RXE_SHARES=%q\n' "${SHARES[*]}"
  printf 'RXE_MODE=%q\nRXE_DEBUG=%q\n' "$MODE" "$DEBUG"
} >"$CTL/params.sh"
{
  printf 'cd %q || exit 126\n' "$CWD"
  for e in "${ENVS[@]+"${ENVS[@]}"}"; do printf 'export %q=%q\n' "${e%%=*}" "${e#*=}"; done
  printf 'exec'; printf ' %q' "$@"; printf '\n'
} >"$CTL/cmd.sh"

QEMU=(qemu-system-x86_64 -nodefaults -no-user-config -nographic -no-reboot
  -machine q35 -m "$MEM" -smp "$CPUS"
  -kernel "$BOOT_KERNEL" -initrd "$INITRD"
  -drive "file=$IMG,if=virtio,format=raw,snapshot=on,cache=unsafe"
  -virtfs "local,path=$CTL,mount_tag=rxevm_ctl,security_model=none,multidevs=remap"
  -nic none -serial stdio -monitor none)
# shellcheck disable=SC2054  # commas inside qemu option values are intended
if [ "$ACC" = kvm ]; then QEMU+=(-accel kvm -cpu host); else QEMU+=(-accel tcg,thread=multi -cpu max); fi
# qboot: minimal firmware (Debian's qemu-system-data), quieter and a bit
# faster than SeaBIOS (which also puts escape codes on the console)
[ -f /usr/share/qemu/qboot.rom ] && QEMU+=(-bios /usr/share/qemu/qboot.rom)
i=0
for s in "${SHARES[@]}"; do
  ro=; [ "${s%%:*}" = ro ] && ro=,readonly=on
  QEMU+=(-virtfs "local,path=${s#*:},mount_tag=share$i,security_model=none,multidevs=remap$ro")
  i=$((i+1))
done
if [ $DEBUG = 1 ]; then LOGLEVEL="loglevel=7"; else LOGLEVEL="quiet loglevel=1"; fi
QEMU+=(-append "console=ttyS0 panic=-1 $LOGLEVEL mitigations=off tsc=reliable")

log "booting ($ACC, ${CPUS} vCPU, ${MEM} MiB); shares: ${SHARES[*]}"
T0=$(date +%s.%N)
timeout --foreground -k 5 "$TIMEOUT" "${QEMU[@]}" </dev/null &
QPID=$!
set +e
wait $QPID
QRC=$?
set -e
QPID=
T1=$(date +%s.%N)
if [ -f "$CTL/stages" ]; then
  log "guest uptime at stages (s): $(tr '\n' ' ' <"$CTL/stages")"
fi
log "VM wall time: $(awk "BEGIN{printf \"%.2f\", $T1 - $T0}") s"
if [ $QRC -eq 124 ] || [ $QRC -eq 137 ]; then log "TIMEOUT after $TIMEOUT s"; exit 124; fi
[ -f "$CTL/rc" ] || die "guest did not report an exit code (qemu exit $QRC)"
RC=$(cat "$CTL/rc")
log "command exit code: $RC"
exit "$RC"
