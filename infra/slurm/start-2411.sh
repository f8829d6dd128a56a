#!/usr/bin/env bash
# Start a real Slurm 24.11 cluster (Debian trixie's slurm-wlm) beside the 22.05
# one of start.sh: 1 slurmctld + 4 emulated GPU nodes gpu01..gpu04 (partition
# "gpu"), on other ports, plus an sshd "login node" for the SSH backend.
#
# 24.11 needs a newer libc than this bookworm host has, so it runs in a trixie
# root built once with debootstrap. Everything runs in a private mount
# namespace held by one "holder" process: the bind mounts of /proc, /dev, /sys
# and /tmp into the root exist only there, never in the host's mount table, so
# nothing on the host (an `rm -rf` of the state folder included) can walk
# through them into the real /dev or /tmp.
#
# Idempotent: if the holder and every daemon (live pid files) are up and
# `sinfo` answers, nothing is touched. Stop with infra/slurm/stop-2411.sh.
#
# Wrappers squeue/sinfo/scontrol/sbatch/scancel/sacct in $DIR/bin run the 24.11
# clients inside the root, with its slurm.conf, so anything that takes Slurm
# from PATH talks to 24.11 unchanged: `. $DIR/env.sh` puts them first on PATH.
# Needs root (chroot, namespaces, mknod).
#
# Usage: infra/slurm/start-2411.sh   then: . "${TRAINMEDIC_SLURM2411_DIR:-/tmp/trainmedic-slurm2411}/env.sh"
# Env:   TRAINMEDIC_SLURM2411_DIR   state folder (default /tmp/trainmedic-slurm2411)
#        TRAINMEDIC_SLURM2411_ROOT  the trixie root (default $DIR/root)
#        TRAINMEDIC_SLURM2411_CTLD_PORT (default 16827)
#        TRAINMEDIC_SLURM2411_SLURMD_BASE_PORT (default 17010; nodes use base+1..base+4)
#        TRAINMEDIC_SLURM2411_SSH_PORT (default 12227, sshd on 127.0.0.1)
#        TRAINMEDIC_SLURM2411_WAIT  seconds to wait for idle nodes (default 90)
#        TRAINMEDIC_DEBIAN_MIRROR   Debian URI for debootstrap (default: the one
#                                   this machine's apt sources use)
#        TRAINMEDIC_SLURM2411_DBD_PORT slurmdbd's port (default 16829)
#
# Accounting, as start.sh for 22.05: MariaDB and slurmdbd in the root, and the
# Slurm users tmexec (Administrator), tmop (Operator), tmuser (none), who can
# also log in to the login node with the test key (see start.sh for why the
# executor needs Administrator).
set -euo pipefail

DIR="${TRAINMEDIC_SLURM2411_DIR:-/tmp/trainmedic-slurm2411}"
ROOT="${TRAINMEDIC_SLURM2411_ROOT:-$DIR/root}"
CTLD_PORT="${TRAINMEDIC_SLURM2411_CTLD_PORT:-16827}"
SLURMD_BASE_PORT="${TRAINMEDIC_SLURM2411_SLURMD_BASE_PORT:-17010}"
SSH_PORT="${TRAINMEDIC_SLURM2411_SSH_PORT:-12227}"
DBD_PORT="${TRAINMEDIC_SLURM2411_DBD_PORT:-16829}"
SLURM_USERS=(tmexec:Administrator tmop:Operator tmuser:None)
WAIT_S="${TRAINMEDIC_SLURM2411_WAIT:-90}"
NODES=(gpu01 gpu02 gpu03 gpu04)
SUITE=trixie
PACKAGES=slurmctld,slurmd,slurm-client,munge,openssh-server,openssh-client

die() { echo "start-2411.sh: ERROR: $*" >&2; exit 1; }
log() { echo "start-2411.sh: $*" >&2; }

for v in DIR ROOT; do
  case "${!v}" in
    /?*) ;;
    *) die "$v must be an absolute path other than / (got '${!v}')" ;;
  esac
done
[ "$(id -u)" = 0 ] || die "must run as root (chroot, mount namespace, mknod)"
export PATH="$PATH:/usr/sbin:/sbin"

# DATA holds config, state, logs and keys; it is visible at the SAME path inside
# the root, so a slurm.conf path, a job's --output or a key path means the same
# file on both sides.
DATA="$DIR/data"
ETC="$DATA/etc"
MUNGE="$DATA/munge"
RUN="$DATA/run"
LOGD="$DATA/log"
SSHD="$DATA/ssh"
BIN="$DIR/bin"
CONF="$ETC/slurm.conf"
DBD_CONF="$ETC/slurmdbd.conf"
ACCT_DONE="$DATA/state/accounting-users.done"
HOLDER_PID="$RUN/holder.pid"
mkdir -p "$DIR" "$RUN"

# pid_alive PIDFILE COMM: the pid in PIDFILE is a live process named COMM.
pid_alive() {
  local pf="$1" comm="$2" pid
  [ -s "$pf" ] || return 1
  pid="$(tr -dc '0-9' <"$pf")"
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$comm" ]
}

# The holder is a `sleep infinity` in its own mount namespace (not ours).
holder_alive() {
  local pid
  pid_alive "$HOLDER_PID" sleep || return 1
  pid="$(tr -dc '0-9' <"$HOLDER_PID")"
  [ "$(readlink "/proc/$pid/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]
}

ns() { nsenter -t "$(tr -dc '0-9' <"$HOLDER_PID")" -m -- "$@"; }
in_root() {
  ns chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root SLURM_CONF="$CONF" "$@"
}

all_running() {
  holder_alive || return 1
  pid_alive "$MUNGE/munged.pid" munged || return 1
  pid_alive "$RUN/slurmctld.pid" slurmctld || return 1
  local n
  for n in "${NODES[@]}"; do pid_alive "$RUN/slurmd-$n.pid" slurmd || return 1; done
  pid_alive "$RUN/sshd.pid" sshd || return 1
  pid_alive "$DATA/mysql/mysqld.pid" mariadbd || return 1
  pid_alive "$RUN/slurmdbd.pid" slurmdbd || return 1
  [ "$(cat "$ACCT_DONE" 2>/dev/null)" = "${SLURM_USERS[*]}" ] || return 1
  grep -qx 'AccountingStorageType=accounting_storage/slurmdbd' "$CONF" 2>/dev/null || return 1
}

write_env() {
  {
    printf '# Slurm 24.11 (trixie root %s): its clients first on PATH\n' "$ROOT"
    printf 'export PATH=%q:"$PATH"\n' "$BIN"
    printf 'export SLURM_CONF=%q\n' "$CONF"
    printf 'export TRAINMEDIC_SLURM2411_BIN=%q\n' "$BIN"
    printf 'export TRAINMEDIC_SLURM2411_SSH=%q\n' "root@127.0.0.1:$SSH_PORT"
    printf 'export TRAINMEDIC_SLURM2411_SSH_KEY=%q\n' "$SSHD/user_key"
    printf 'export TRAINMEDIC_SLURM2411_KNOWN_HOSTS=%q\n' "$SSHD/known_hosts"
  } >"$DIR/env.sh.tmp.$$"
  # A temporary file of this run's own: slurmrestd.sh runs this script too, and two runs at once
  # (two test workers) must not move each other's file away.
  mv -f "$DIR/env.sh.tmp.$$" "$DIR/env.sh"
}

if all_running && timeout 10 "$BIN/sinfo" -h >/dev/null 2>&1; then
  write_env
  echo "slurm 24.11 cluster already up: SLURM_CONF=$CONF (source $DIR/env.sh)"
  exit 0
fi

t_start=$EPOCHREALTIME

# ---------------------------------------------------------------- root
debian_mirror() {
  # The Debian URI this machine's apt already uses (deb822 .sources or one-line lists).
  local uri
  uri="$(grep -hsE '^\s*URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null \
           | awk '{for (i = 2; i <= NF; i++) print $i}' | grep -E '/debian/?$' | head -n1 || true)"
  if [ -z "$uri" ]; then
    uri="$(grep -hsE '^\s*deb\s' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
             | sed -E 's/\[[^]]*\]//' | awk '{print $2}' | grep -E '/debian/?$' | head -n1 || true)"
  fi
  echo "$uri"
}

if [ ! -x "$ROOT/usr/sbin/slurmctld" ] || [ ! -x "$ROOT/usr/sbin/sshd" ]; then
  MIRROR="${TRAINMEDIC_DEBIAN_MIRROR:-$(debian_mirror)}"
  [ -n "$MIRROR" ] || die "no Debian mirror found in /etc/apt/sources.list.d/; set TRAINMEDIC_DEBIAN_MIRROR"
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap >&2 \
      || { DEBIAN_FRONTEND=noninteractive apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y debootstrap >&2; } \
      || die "cannot install debootstrap"
  fi
  partial="$ROOT.partial"
  # A half-built root from an interrupted run: nothing is mounted in it (mounts live
  # only in the holder's namespace), so it can be removed as plain files.
  if grep -qsF " $partial/" /proc/mounts; then die "$partial has mounts; run stop-2411.sh first"; fi
  rm -rf --one-file-system -- "$partial"
  log "building the $SUITE root in $ROOT from $MIRROR (debootstrap, about a minute)"
  t_boot=$EPOCHREALTIME
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$partial" "$MIRROR" >"$DIR/debootstrap.log" 2>&1 \
    || { tail -n 20 "$DIR/debootstrap.log" >&2; die "debootstrap failed (log: $DIR/debootstrap.log)"; }
  [ ! -e "$ROOT" ] || rm -rf --one-file-system -- "$ROOT"
  mv "$partial" "$ROOT"
  log "root built in $(awk -v a="$t_boot" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s"
fi
printf '127.0.0.1 localhost\n::1 localhost ip6-localhost\n' >"$ROOT/etc/hosts"

# ---------------------------------------------------------------- namespace
if ! holder_alive; then
  # Daemons left over from a dead holder cannot be reached any more: stop them first.
  for spec in "$RUN/sshd.pid:sshd" "$RUN/slurmctld.pid:slurmctld" "$MUNGE/munged.pid:munged" \
              "$RUN/slurmdbd.pid:slurmdbd" "$DATA/mysql/mysqld.pid:mariadbd" "$RUN"/slurmd-*.pid; do
    pf="${spec%%:*}" comm="${spec##*:}"
    [ "$comm" = "$spec" ] && comm=slurmd
    if pid_alive "$pf" "$comm"; then
      log "stopping $comm left from an earlier namespace"
      kill -TERM "$(tr -dc '0-9' <"$pf")" 2>/dev/null || true
    fi
  done
  sleep 1
  setsid unshare --mount --propagation private -- sleep infinity </dev/null >/dev/null 2>&1 &
  echo $! >"$HOLDER_PID"
  for _ in $(seq 1 50); do holder_alive && break; sleep 0.05; done
  holder_alive || die "could not start the mount-namespace holder"
fi

bind_in() {  # bind_in SRC TARGET [ro]: bind-mount SRC at ROOT/TARGET inside the namespace, once
  local src="$1" target="$ROOT$2"
  ns mountpoint -q "$target" && return 0
  ns mkdir -p "$target"
  ns mount --bind "$src" "$target"
  [ "${3:-}" != ro ] || ns mount -o remount,bind,ro "$target"
}
bind_in /proc /proc
bind_in /sys /sys ro
bind_in /dev /dev
bind_in /tmp /tmp
mkdir -p "$DATA"
# DATA outside /tmp: give it its own bind at the same path.
if [ "$(stat -c %d:%i "$DATA")" != "$(ns stat -c %d:%i "$ROOT$DATA" 2>/dev/null || true)" ]; then
  bind_in "$DATA" "$DATA"
fi

# Accounting packages, into a root built before they were needed too. Nothing may start
# by itself (the init scripts would start a mariadb of their own).
if [ ! -x "$ROOT/usr/sbin/slurmdbd" ] || [ ! -x "$ROOT/usr/sbin/mariadbd" ]; then
  log "installing slurmdbd mariadb-server in the $SUITE root"
  printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
  chmod 755 "$ROOT/usr/sbin/policy-rc.d"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmdbd mariadb-server \
    >"$DIR/apt-accounting.log" 2>&1 \
    || { in_root env DEBIAN_FRONTEND=noninteractive apt-get update >>"$DIR/apt-accounting.log" 2>&1 \
         && in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmdbd \
              mariadb-server >>"$DIR/apt-accounting.log" 2>&1; } \
    || { rm -f "$ROOT/usr/sbin/policy-rc.d"; tail -n 20 "$DIR/apt-accounting.log" >&2; die "cannot install slurmdbd mariadb-server in the root"; }
  rm -f "$ROOT/usr/sbin/policy-rc.d"
fi

# ---------------------------------------------------------------- config
FAKEGPU="$DATA/fakegpu"
mkdir -p "$ETC" "$MUNGE" "$FAKEGPU" "$DATA/state" "$DATA/spool" "$LOGD" "$RUN" "$SSHD" "$BIN"
for n in "${NODES[@]}"; do mkdir -p "$DATA/spool/$n"; done
chmod 755 "$DIR" "$DATA" "$MUNGE"   # munged's socket dir needs o+x
chmod 700 "$DATA/state"

if [ ! -s "$MUNGE/munge.key" ]; then
  in_root mungekey --create --keyfile="$MUNGE/munge.key"
fi
chmod 600 "$MUNGE/munge.key"

for i in 0 1 2 3 4 5 6 7; do
  dev="$FAKEGPU/nvidia$i"
  if [ ! -c "$dev" ]; then rm -f "$dev"; mknod "$dev" c 195 "$i"; fi
done

node_lines=""
idx=1
for n in "${NODES[@]}"; do
  node_lines+="NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((SLURMD_BASE_PORT + idx)) CPUs=8 RealMemory=16000 Gres=gpu:8 Features=rack$(((idx + 1) / 2)) State=UNKNOWN"$'\n'
  idx=$((idx + 1))
done

tmpconf="$(mktemp "$ETC/slurm.conf.XXXXXX")"
cat >"$tmpconf" <<EOF
# Generated by trainmedic infra/slurm/start-2411.sh; do not edit.
ClusterName=trainmedic2411
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE/munge.socket.2,cred_expire=5
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
AccountingStoragePass=$MUNGE/munge.socket.2
StateSaveLocation=$DATA/state
SlurmdSpoolDir=$DATA/spool/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGD/slurmctld.log
SlurmdLogFile=$LOGD/slurmd-%n.log
MailProg=/bin/true
SwitchType=switch/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOGD/jobcomp.txt
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=1
# trainmedic's reboot remediation (scontrol reboot ASAP) needs a RebootProgram. These nodes are
# emulated: nothing reboots, so slurmctld gives up after ResumeTimeout and sets the node DOWN.
RebootProgram=/bin/true
ResumeTimeout=30
SlurmdTimeout=10
KillWait=2
MinJobAge=600
JobRequeue=1
GresTypes=gpu
# Two leaf switches under one spine (topology.conf below: gpu01-03 share leaf1) and two racks (node features rack1,
# rack2): what trainmedic's fleet incidents read as shared components.
TopologyPlugin=topology/tree
${node_lines}PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
# JWT for slurmrestd (infra/slurm/slurmrestd.sh makes this key): once it exists,
# slurmctld also accepts tokens from `scontrol token`.
if [ -s "$ETC/jwt_hs256.key" ]; then
  printf 'AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key=%s\n' "$ETC/jwt_hs256.key" >>"$tmpconf"
fi
mv -f "$tmpconf" "$CONF"
chmod 644 "$CONF"
# 24.11's slurmd refuses to start without a cgroup filesystem unless told not to use one.
printf 'CgroupPlugin=disabled\n' >"$ETC/cgroup.conf"
printf 'AutoDetect=off\nNodeName=gpu[01-04] Name=gpu File=%s/nvidia[0-7]\n' "$FAKEGPU" >"$ETC/gres.conf"
chmod 644 "$ETC/cgroup.conf" "$ETC/gres.conf"
printf 'SwitchName=leaf1 Nodes=gpu[01-03]\nSwitchName=leaf2 Nodes=gpu04\nSwitchName=spine Switches=leaf[1-2]\n' >"$ETC/topology.conf"
chmod 644 "$ETC/topology.conf"
# Clients inside the root (a login over SSH without SLURM_CONF) find it at the default place.
mkdir -p "$ROOT/etc/slurm"
ln -sfn "$CONF" "$ROOT/etc/slurm/slurm.conf"

# ---------------------------------------------------------------- wrappers
for cmd in squeue sinfo scontrol sbatch scancel sacct sprio sdiag sacctmgr; do
  cat >"$BIN/$cmd.tmp" <<EOF
#!/bin/sh
# Generated by trainmedic infra/slurm/start-2411.sh: Slurm 24.11's $cmd, run in
# the trixie root $ROOT with that cluster's slurm.conf (a caller's SLURM_CONF
# would point at another cluster, so it is not passed on). The working folder is
# kept when it exists inside the root (/tmp does), else it is /.
pid="\$(tr -dc '0-9' <'$HOLDER_PID' 2>/dev/null)"
if [ -z "\$pid" ] || [ ! -d "/proc/\$pid" ]; then
  echo "$cmd: the Slurm 24.11 cluster is not running (start infra/slurm/start-2411.sh)" >&2
  exit 1
fi
exec nsenter -t "\$pid" -m -- chroot '$ROOT' /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin \\
  LC_ALL=C HOME=/root SLURM_CONF='$CONF' /bin/sh -c 'cd "\$0" 2>/dev/null || cd /; exec "\$@"' "\$PWD" $cmd "\$@"
EOF
  chmod 755 "$BIN/$cmd.tmp"
  mv -f "$BIN/$cmd.tmp" "$BIN/$cmd"
done

# ---------------------------------------------------------------- daemons
if ! pid_alive "$MUNGE/munged.pid" munged; then
  log "starting munged (24.11 root)"
  rm -f "$MUNGE/munge.socket.2" "$MUNGE/munge.socket.2.lock"
  in_root munged --socket="$MUNGE/munge.socket.2" --key-file="$MUNGE/munge.key" \
    --pid-file="$MUNGE/munged.pid" --log-file="$LOGD/munged.log" --seed-file="$MUNGE/munged.seed"
fi
for _ in $(seq 1 50); do [ -S "$MUNGE/munge.socket.2" ] && break; sleep 0.1; done
[ -S "$MUNGE/munge.socket.2" ] || { tail -n 20 "$LOGD/munged.log" >&2 || true; die "munged did not create its socket"; }

# ---------------------------------------------------------------- accounting
# As start.sh does for 22.05: MariaDB (user mysql of the root, data dir and socket under
# $DATA/mysql, no TCP), slurmdbd, then cluster, account and the Slurm users with their
# AdminLevels; the users also exist in the root's /etc/passwd (with a shell: they log in
# to the login node over SSH with the test key).
DB="$DATA/mysql"
DB_SOCK="$DB/mysqld.sock"
in_root_db() {  # in_root, with libmariadb's "localhost" socket pointed at ours
  ns chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root SLURM_CONF="$CONF" \
    MYSQL_UNIX_PORT="$DB_SOCK" "$@"
}
mkdir -p "$DB/data"
in_root chown mysql: "$DB" "$DB/data"
chmod 750 "$DB/data"
if [ ! -d "$DB/data/mysql" ]; then
  log "initialising the accounting database in $DB/data (24.11 root)"
  in_root mariadb-install-db --no-defaults --user=mysql --datadir="$DB/data" \
    --auth-root-authentication-method=socket --skip-test-db >"$LOGD/mariadb-install.log" 2>&1 \
    || { tail -n 20 "$LOGD/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
if ! pid_alive "$DB/mysqld.pid" mariadbd; then
  log "starting mariadbd (24.11 root, socket $DB_SOCK)"
  rm -f "$DB_SOCK"
  setsid nsenter -t "$(tr -dc '0-9' <"$HOLDER_PID")" -m -- chroot "$ROOT" /usr/bin/env -i \
    PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root mariadbd --no-defaults --user=mysql \
    --datadir="$DB/data" --socket="$DB_SOCK" --pid-file="$DB/mysqld.pid" --log-error="$DB/mariadb.log" \
    --skip-networking --skip-name-resolve --innodb-buffer-pool-size=128M --innodb-log-file-size=64M \
    --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
fi
db_ok=0
for _ in $(seq 1 150); do
  if [ -S "$DB_SOCK" ] && in_root mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping >/dev/null 2>&1; then
    db_ok=1
    break
  fi
  sleep 0.2
done
[ "$db_ok" = 1 ] || { tail -n 20 "$DB/mariadb.log" >&2 || true; die "mariadbd does not answer on $DB_SOCK"; }
if [ ! -s "$DB/slurm.pass" ]; then
  (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DB/slurm.pass")
fi
chmod 600 "$DB/slurm.pass"
db_pass="$(cat "$DB/slurm.pass")"
printf "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '%s';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '%s';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';\n" "$db_pass" "$db_pass" \
  | in_root mariadb --no-defaults --socket="$DB_SOCK" -u root || die "could not create slurm_acct_db and its user"

tmpdbd="$(mktemp "$ETC/slurmdbd.conf.XXXXXX")"
chmod 600 "$tmpdbd"
printf '%s\n' "# Generated by trainmedic infra/slurm/start-2411.sh; do not edit. Mode 0600, owned by SlurmUser." \
  "AuthType=auth/munge" "AuthInfo=socket=$MUNGE/munge.socket.2" "DbdHost=localhost" "DbdPort=$DBD_PORT" \
  "SlurmUser=root" "StorageType=accounting_storage/mysql" "StorageHost=localhost" "StorageLoc=slurm_acct_db" \
  "StorageUser=slurm" "StoragePass=$db_pass" "PidFile=$RUN/slurmdbd.pid" "LogFile=$LOGD/slurmdbd.log" >"$tmpdbd"
if [ -s "$ETC/jwt_hs256.key" ]; then
  # slurmrestd's calls that reach slurmdbd (partitions/ asks it for TRES) carry the JWT too.
  printf 'AuthAltTypes=auth/jwt\nAuthAltParameters=jwt_key=%s\n' "$ETC/jwt_hs256.key" >>"$tmpdbd"
fi
chown root: "$tmpdbd"
mv -f "$tmpdbd" "$DBD_CONF"
if ! pid_alive "$RUN/slurmdbd.pid" slurmdbd; then
  log "starting slurmdbd 24.11 on port $DBD_PORT"
  in_root_db slurmdbd || { tail -n 30 "$LOGD/slurmdbd.log" >&2 || true; die "slurmdbd failed to start"; }
fi
dbd_ok=0
for _ in $(seq 1 60); do
  if timeout 5 "$BIN/sacctmgr" -n -P show cluster format=cluster >/dev/null 2>&1; then dbd_ok=1; break; fi
  sleep 0.3
done
[ "$dbd_ok" = 1 ] || { tail -n 30 "$LOGD/slurmdbd.log" >&2 || true; die "slurmdbd does not answer sacctmgr"; }
sacctmgr_add() {
  local out
  if ! out="$(timeout 30 "$BIN/sacctmgr" -i add "$@" 2>&1)"; then
    case "$out" in
      *"Nothing new added"*|*"already exists"*|*"Already existing"*|*"Nothing added"*) ;;
      *) echo "$out" >&2; die "sacctmgr add $* failed" ;;
    esac
  fi
}
# The marker holds the user list it was made for: a changed list is set up again.
if [ "$(cat "$ACCT_DONE" 2>/dev/null)" != "${SLURM_USERS[*]}" ]; then
  sacctmgr_add cluster trainmedic2411
  sacctmgr_add account trainmedic cluster=trainmedic2411 description=trainmedic-tests organization=trainmedic
  sacctmgr_add user root account=trainmedic cluster=trainmedic2411
  for spec in "${SLURM_USERS[@]}"; do
    u="${spec%%:*}" want="${spec##*:}"
    in_root id "$u" >/dev/null 2>&1 || in_root useradd --system --create-home --shell /bin/sh "$u"
    in_root usermod -p '*' "$u"   # no password, but not locked: sshd refuses a locked account even a key login
    sacctmgr_add user "$u" account=trainmedic cluster=trainmedic2411 adminlevel="$want"
    timeout 30 "$BIN/sacctmgr" -i modify user where name="$u" set adminlevel="$want" >/dev/null 2>&1 || true
    level="$(timeout 30 "$BIN/sacctmgr" -n -P show user "$u" format=adminlevel 2>/dev/null || true)"
    [ "$level" = "$want" ] || die "Slurm user $u has AdminLevel '${level:-?}', not $want"
  done
  printf '%s' "${SLURM_USERS[*]}" >"$ACCT_DONE"
fi
if pid_alive "$RUN/slurmctld.pid" slurmctld \
  && ! grep -q 'AccountingStorageType *= *accounting_storage/slurmdbd' <<<"$(timeout 10 "$BIN/scontrol" show config 2>/dev/null)"; then
  log "restarting slurmctld 24.11: it runs without accounting_storage/slurmdbd (state is kept)"
  ctld_pid="$(tr -dc '0-9' <"$RUN/slurmctld.pid")"
  kill -TERM "$ctld_pid" 2>/dev/null || true
  for _ in $(seq 1 100); do [ -d "/proc/$ctld_pid" ] || break; sleep 0.1; done
  [ ! -d "/proc/$ctld_pid" ] || die "slurmctld ($ctld_pid) did not stop for the accounting restart"
  rm -f "$RUN/slurmctld.pid"
fi

# A state folder from before accounting holds a ClusterID slurmctld made up itself; slurmdbd
# gives the cluster another, and 24.11's slurmctld then stops with "fatal: CLUSTER ID
# MISMATCH". The first start with accounting drops that file, so the ID comes from slurmdbd.
if [ ! -e "$DATA/state/clustername.from-dbd" ] && ! pid_alive "$RUN/slurmctld.pid" slurmctld; then
  rm -f "$DATA/state/clustername"
  : >"$DATA/state/clustername.from-dbd"
fi
if ! pid_alive "$RUN/slurmctld.pid" slurmctld; then
  log "starting slurmctld 24.11 on port $CTLD_PORT"
  in_root slurmctld -f "$CONF" || { tail -n 30 "$LOGD/slurmctld.log" >&2 || true; die "slurmctld failed to start"; }
fi
ctld_ok=0
for _ in $(seq 1 100); do
  if timeout 5 "$BIN/scontrol" ping 2>/dev/null | grep -q 'is UP'; then ctld_ok=1; break; fi
  sleep 0.2
done
[ "$ctld_ok" = 1 ] || { tail -n 30 "$LOGD/slurmctld.log" >&2 || true; die "slurmctld does not answer 'scontrol ping'"; }

for n in "${NODES[@]}"; do
  if ! pid_alive "$RUN/slurmd-$n.pid" slurmd; then
    log "starting slurmd -N $n (24.11)"
    in_root slurmd -f "$CONF" -N "$n" || { tail -n 30 "$LOGD/slurmd-$n.log" >&2 || true; die "slurmd -N $n failed to start"; }
  fi
done

# sshd inside the root: a 24.11 login node for the SSH backend, keys made here.
if [ ! -s "$SSHD/host_key" ]; then
  rm -f "$SSHD/host_key" "$SSHD/host_key.pub"
  in_root ssh-keygen -q -t ed25519 -N '' -C trainmedic-2411-host -f "$SSHD/host_key"
fi
if [ ! -s "$SSHD/user_key" ]; then
  rm -f "$SSHD/user_key" "$SSHD/user_key.pub"
  in_root ssh-keygen -q -t ed25519 -N '' -C trainmedic-2411-user -f "$SSHD/user_key"
fi
cp "$SSHD/user_key.pub" "$SSHD/authorized_keys"
printf '[127.0.0.1]:%s %s\n' "$SSH_PORT" "$(cut -d' ' -f1,2 "$SSHD/host_key.pub")" >"$SSHD/known_hosts"
chmod 600 "$SSHD/host_key" "$SSHD/user_key"
chmod 644 "$SSHD/authorized_keys" "$SSHD/known_hosts"
if ! pid_alive "$RUN/sshd.pid" sshd; then
  log "starting sshd (24.11 login node) on 127.0.0.1:$SSH_PORT"
  mkdir -p "$ROOT/run/sshd"
  chmod 755 "$ROOT/run/sshd"
  in_root /usr/sbin/sshd -f /dev/null -h "$SSHD/host_key" -p "$SSH_PORT" -o ListenAddress=127.0.0.1 \
    -o AuthorizedKeysFile="$SSHD/authorized_keys" -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no \
    -o PermitRootLogin=prohibit-password -o PidFile="$RUN/sshd.pid" -o StrictModes=no \
    -E "$LOGD/sshd.log" || { tail -n 20 "$LOGD/sshd.log" >&2 || true; die "sshd failed to start"; }
  for _ in $(seq 1 50); do pid_alive "$RUN/sshd.pid" sshd && break; sleep 0.1; done
  pid_alive "$RUN/sshd.pid" sshd || { tail -n 20 "$LOGD/sshd.log" >&2 || true; die "sshd did not write its pid file"; }
fi

# ---------------------------------------------------------------- wait for idle
deadline=$(( $(date +%s) + WAIT_S ))
while :; do
  states="$(timeout 10 "$BIN/sinfo" -h -N -p gpu -o '%N %t' 2>/dev/null | sort -u || true)"
  idle=0
  while read -r name st; do
    [ -n "${name:-}" ] || continue
    case "$st" in
      idle) idle=$((idle + 1)) ;;
      inval*) echo "$states" >&2; tail -n 30 "$LOGD/slurmctld.log" >&2 || true
              die "node $name is in state inval (bad gres.conf/slurm.conf?)" ;;
      *'*'|unk*) ;;
      down|drain|drng|drained|fail|failg)
        log "node $name is $st from an earlier run; resuming"
        "$BIN/scontrol" update nodename="$name" state=resume >&2 || true ;;
      *) ;;
    esac
  done <<<"$states"
  [ "$idle" -ge "${#NODES[@]}" ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "--- sinfo:" >&2; echo "$states" >&2
    for f in "$LOGD/slurmctld.log" "$LOGD"/slurmd-*.log; do
      echo "--- tail $f:" >&2; tail -n 15 "$f" >&2 || true
    done
    die "not all ${#NODES[@]} nodes idle after ${WAIT_S}s"
  fi
  sleep 0.3
done

write_env
elapsed="$(awk -v a="$t_start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
version="$("$BIN/sinfo" -V 2>/dev/null || true)"
echo "slurm 24.11 cluster up ($version, ${#NODES[@]} nodes idle after ${elapsed}s): SLURM_CONF=$CONF, login node root@127.0.0.1:$SSH_PORT (source $DIR/env.sh)"
