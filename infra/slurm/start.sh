#!/usr/bin/env bash
# Start a real local Slurm 22.05 cluster (1 slurmctld + 4 emulated GPU nodes
# gpu01..gpu04, one partition "gpu") for trainmedic's integration tests.
#
# Idempotent: daemons that are already running (live pid file) are left alone;
# only missing ones are started. State lives in ${TRAINMEDIC_SLURM_DIR}.
# See docs/environment.md ("Slurm on one host") for why each setting is what it is.
#
# Usage: infra/slurm/start.sh        then: . "${TRAINMEDIC_SLURM_DIR:-/tmp/trainmedic-slurm}/env.sh"
# Env:   TRAINMEDIC_SLURM_DIR (default /tmp/trainmedic-slurm)
#        TRAINMEDIC_SLURMCTLD_PORT (default 16817)
#        TRAINMEDIC_SLURMD_BASE_PORT (default 17000; nodes use base+1..base+4)
#        TRAINMEDIC_SLURM_WAIT (seconds to wait for idle nodes, default 60)
#        TRAINMEDIC_SLURMDBD_PORT (default 16819)
#
# Accounting (so that `sacctmgr ... AdminLevel=Operator` exists, and the
# executor can run as a non-root operator): a MariaDB server run as user
# mysql with its data dir and socket under $DIR/mysql (no TCP), slurmdbd
# (slurmdbd.conf mode 0600, owned by SlurmUser root) and
# AccountingStorageType=accounting_storage/slurmdbd. Slurm users, all in
# account "trainmedic" and created as system users when missing:
#   tmexec  AdminLevel=Administrator: the executor. Draining a node is an
#           UPDATE_NODE RPC, which slurmctld allows only root, SlurmUser and
#           Administrator (validate_super_user); Operator is refused it.
#   tmop    AdminLevel=Operator: may requeue, hold, release, update and cancel
#           any user's job, but not drain or resume a node.
#   tmuser  no rights: an ordinary user.
# A
# slurmctld still running with the old accounting_storage/none is restarted
# (its saved state, jobs included, is kept).
set -euo pipefail

DIR="${TRAINMEDIC_SLURM_DIR:-/tmp/trainmedic-slurm}"
CTLD_PORT="${TRAINMEDIC_SLURMCTLD_PORT:-16817}"
SLURMD_BASE_PORT="${TRAINMEDIC_SLURMD_BASE_PORT:-17000}"
WAIT_S="${TRAINMEDIC_SLURM_WAIT:-60}"
DBD_PORT="${TRAINMEDIC_SLURMDBD_PORT:-16819}"
NODES=(gpu01 gpu02 gpu03 gpu04)
# user:AdminLevel (see the header: why the executor needs Administrator)
SLURM_USERS=(tmexec:Administrator tmop:Operator tmuser:None)

die() { echo "start.sh: ERROR: $*" >&2; exit 1; }
log() { echo "start.sh: $*" >&2; }

case "$DIR" in
  /*) ;;
  *) die "TRAINMEDIC_SLURM_DIR must be an absolute path (got '$DIR')" ;;
esac
[ "$DIR" != "/" ] || die "TRAINMEDIC_SLURM_DIR must not be /"

# ---------------------------------------------------------------- install
need_install=0
for bin in slurmctld slurmd sinfo scontrol munged mungekey slurmdbd sacctmgr mariadbd mariadb-install-db; do
  command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || need_install=1
done
if [ "$need_install" = 1 ]; then
  [ "$(id -u)" = 0 ] || die "slurm/munge/mariadb binaries missing and not root; install slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
  log "installing slurmctld slurmd slurm-client munge slurmdbd mariadb-server"
  export DEBIAN_FRONTEND=noninteractive
  # Nothing may start by itself (no systemd here; the init scripts would start a system-wide mariadb).
  made_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && made_policy=1
  fi
  apt-get update
  apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge slurmdbd mariadb-server
  [ "$made_policy" = 0 ] || rm -f /usr/sbin/policy-rc.d
fi
export PATH="$PATH:/usr/sbin:/sbin"

[ "$(id -u)" = 0 ] || die "must run as root (SlurmUser=root, mknod of fake GPU devices)"

ETC="$DIR/etc"
MUNGE="$DIR/munge"
FAKEGPU="$DIR/fakegpu"
CONF="$ETC/slurm.conf"
DBD_CONF="$ETC/slurmdbd.conf"
DB="$DIR/mysql"
DB_SOCK="$DB/mysqld.sock"
ACCT_DONE="$DIR/state/accounting-users.done"   # written once the cluster, account and users exist
export SLURM_CONF="$CONF"

# pid_alive PIDFILE COMM: the pid in PIDFILE is a live process named COMM.
pid_alive() {
  local pf="$1" comm="$2" pid
  [ -s "$pf" ] || return 1
  pid="$(tr -dc '0-9' <"$pf")"
  [ -n "$pid" ] || return 1
  [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm")" = "$comm" ]
}

all_running() {
  pid_alive "$MUNGE/munged.pid" munged || return 1
  pid_alive "$DB/mysqld.pid" mariadbd || return 1
  pid_alive "$DIR/run/slurmdbd.pid" slurmdbd || return 1
  [ "$(cat "$ACCT_DONE" 2>/dev/null)" = "${SLURM_USERS[*]}" ] || return 1
  grep -qx 'AccountingStorageType=accounting_storage/slurmdbd' "$CONF" 2>/dev/null || return 1
  pid_alive "$DIR/run/slurmctld.pid" slurmctld || return 1
  local n
  for n in "${NODES[@]}"; do pid_alive "$DIR/run/slurmd-$n.pid" slurmd || return 1; done
}

write_env() {
  printf 'export SLURM_CONF=%q\n' "$CONF" >"$DIR/env.sh"
}

if all_running && timeout 10 sinfo -h >/dev/null 2>&1; then
  write_env
  echo "slurm cluster already up: SLURM_CONF=$CONF (source $DIR/env.sh)"
  exit 0
fi

t_start=$EPOCHREALTIME

# ---------------------------------------------------------------- config
mkdir -p "$ETC" "$MUNGE" "$FAKEGPU" "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/run"
for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/$n"; done
chmod 755 "$DIR" "$MUNGE"   # munged's socket dir needs o+x, else "Socket is inaccessible"
chmod 700 "$DIR/state"

if [ ! -s "$MUNGE/munge.key" ]; then
  mungekey --create --keyfile="$MUNGE/munge.key"
fi
chmod 600 "$MUNGE/munge.key"

# gres.conf File= must be character devices; plain files are rejected.
for i in 0 1 2 3 4 5 6 7; do
  dev="$FAKEGPU/nvidia$i"
  if [ ! -c "$dev" ]; then
    rm -f "$dev"
    mknod "$dev" c 195 "$i"
  fi
done

node_lines=""
idx=1
for n in "${NODES[@]}"; do
  node_lines+="NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((SLURMD_BASE_PORT + idx)) CPUs=8 RealMemory=16000 Gres=gpu:8 Features=rack$(((idx + 1) / 2)) State=UNKNOWN"$'\n'
  idx=$((idx + 1))
done

tmpconf="$(mktemp "$ETC/slurm.conf.XXXXXX")"
cat >"$tmpconf" <<EOF
# Generated by trainmedic infra/slurm/start.sh; do not edit.
ClusterName=trainmedic
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
# The munge socket for the slurmdbd connection (clients and slurmctld); not a password here.
AccountingStoragePass=$MUNGE/munge.socket.2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
MailProg=/bin/true
SwitchType=switch/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
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
mv -f "$tmpconf" "$CONF"
chmod 644 "$CONF"

cat >"$ETC/gres.conf" <<EOF
AutoDetect=off
NodeName=gpu[01-04] Name=gpu File=$FAKEGPU/nvidia[0-7]
EOF
chmod 644 "$ETC/gres.conf"
printf 'SwitchName=leaf1 Nodes=gpu[01-03]\nSwitchName=leaf2 Nodes=gpu04\nSwitchName=spine Switches=leaf[1-2]\n' >"$ETC/topology.conf"
chmod 644 "$ETC/topology.conf"

# ---------------------------------------------------------------- daemons
if ! pid_alive "$MUNGE/munged.pid" munged; then
  log "starting munged"
  rm -f "$MUNGE/munge.socket.2" "$MUNGE/munge.socket.2.lock"
  munged --socket="$MUNGE/munge.socket.2" --key-file="$MUNGE/munge.key" \
    --pid-file="$MUNGE/munged.pid" --log-file="$DIR/log/munged.log" \
    --seed-file="$MUNGE/munged.seed"
fi
for _ in $(seq 1 50); do [ -S "$MUNGE/munge.socket.2" ] && break; sleep 0.1; done
[ -S "$MUNGE/munge.socket.2" ] || { tail -n 20 "$DIR/log/munged.log" >&2 || true; die "munged did not create its socket"; }

# ---------------------------------------------------------------- accounting
# MariaDB as its own user, data dir and socket under $DIR/mysql, no TCP at all.
id mysql >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin mysql
mkdir -p "$DB/data"
chown mysql: "$DB" "$DB/data"
chmod 750 "$DB/data"
if [ ! -d "$DB/data/mysql" ]; then
  log "initialising the accounting database in $DB/data"
  mariadb-install-db --no-defaults --user=mysql --datadir="$DB/data" --auth-root-authentication-method=socket \
    --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 \
    || { tail -n 20 "$DIR/log/mariadb-install.log" >&2; die "mariadb-install-db failed"; }
fi
if ! pid_alive "$DB/mysqld.pid" mariadbd; then
  log "starting mariadbd (socket $DB_SOCK)"
  rm -f "$DB_SOCK"
  setsid mariadbd --no-defaults --user=mysql --datadir="$DB/data" --socket="$DB_SOCK" \
    --pid-file="$DB/mysqld.pid" --log-error="$DB/mariadb.log" --skip-networking --skip-name-resolve \
    --innodb-buffer-pool-size=128M --innodb-log-file-size=64M --innodb-lock-wait-timeout=900 \
    </dev/null >/dev/null 2>&1 &
fi
db_ok=0
for _ in $(seq 1 150); do
  if [ -S "$DB_SOCK" ] && mariadb-admin --no-defaults --socket="$DB_SOCK" -u root ping >/dev/null 2>&1; then
    db_ok=1
    break
  fi
  sleep 0.2
done
[ "$db_ok" = 1 ] || { tail -n 20 "$DB/mariadb.log" >&2 || true; die "mariadbd does not answer on $DB_SOCK"; }

# The slurmdbd database user; its password is made once and kept beside the data (0600).
if [ ! -s "$DB/slurm.pass" ]; then
  (umask 077; head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' >"$DB/slurm.pass")
fi
chmod 600 "$DB/slurm.pass"
db_pass="$(cat "$DB/slurm.pass")"
mariadb --no-defaults --socket="$DB_SOCK" -u root <<SQL || die "could not create slurm_acct_db and its user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$db_pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$db_pass';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL

tmpdbd="$(mktemp "$ETC/slurmdbd.conf.XXXXXX")"
chmod 600 "$tmpdbd"
cat >"$tmpdbd" <<DBDCONF
# Generated by trainmedic infra/slurm/start.sh; do not edit. Mode 0600, owned by SlurmUser.
AuthType=auth/munge
AuthInfo=socket=$MUNGE/munge.socket.2
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageLoc=slurm_acct_db
StorageUser=slurm
StoragePass=$db_pass
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DBDCONF
chown root: "$tmpdbd"
mv -f "$tmpdbd" "$DBD_CONF"

if ! pid_alive "$DIR/run/slurmdbd.pid" slurmdbd; then
  log "starting slurmdbd on port $DBD_PORT"
  # libmariadb's "localhost" is a unix socket; MYSQL_UNIX_PORT points it at ours.
  MYSQL_UNIX_PORT="$DB_SOCK" slurmdbd || { tail -n 30 "$DIR/log/slurmdbd.log" >&2 || true; die "slurmdbd failed to start"; }
fi
dbd_ok=0
for _ in $(seq 1 60); do
  if timeout 5 sacctmgr -n -P show cluster format=cluster >/dev/null 2>&1; then dbd_ok=1; break; fi
  sleep 0.3
done
[ "$dbd_ok" = 1 ] || { tail -n 30 "$DIR/log/slurmdbd.log" >&2 || true; die "slurmdbd does not answer sacctmgr"; }

# sacctmgr_add WHAT...: add unless it exists already ("Nothing new added" is not an error here).
sacctmgr_add() {
  local out
  if ! out="$(timeout 30 sacctmgr -i add "$@" 2>&1)"; then
    case "$out" in
      *"Nothing new added"*|*"already exists"*|*"Already existing"*|*"Nothing added"*) ;;
      *) echo "$out" >&2; die "sacctmgr add $* failed" ;;
    esac
  fi
}
# The marker holds the user list it was made for: a changed list is set up again.
if [ "$(cat "$ACCT_DONE" 2>/dev/null)" != "${SLURM_USERS[*]}" ]; then
  sacctmgr_add cluster trainmedic
  sacctmgr_add account trainmedic cluster=trainmedic description=trainmedic-tests organization=trainmedic
  sacctmgr_add user root account=trainmedic cluster=trainmedic
  for spec in "${SLURM_USERS[@]}"; do
    u="${spec%%:*}" want="${spec##*:}"
    id "$u" >/dev/null 2>&1 || useradd --system --no-create-home --shell /usr/sbin/nologin "$u"
    sacctmgr_add user "$u" account=trainmedic cluster=trainmedic adminlevel="$want"
    # An existing user keeps its old level through "add": set it, and check it took.
    timeout 30 sacctmgr -i modify user where name="$u" set adminlevel="$want" >/dev/null 2>&1 || true
    level="$(timeout 30 sacctmgr -n -P show user "$u" format=adminlevel 2>/dev/null || true)"
    [ "$level" = "$want" ] || die "Slurm user $u has AdminLevel '${level:-?}', not $want"
  done
  printf '%s' "${SLURM_USERS[*]}" >"$ACCT_DONE"
fi

# A slurmctld started before accounting was configured keeps accounting_storage/none until restarted.
# (The config is read into a string first: `grep -q` on a pipe would SIGPIPE scontrol, failing it under pipefail.)
if pid_alive "$DIR/run/slurmctld.pid" slurmctld \
  && ! grep -q 'AccountingStorageType *= *accounting_storage/slurmdbd' <<<"$(timeout 10 scontrol show config 2>/dev/null)"; then
  log "restarting slurmctld: it runs without accounting_storage/slurmdbd (state is kept)"
  ctld_pid="$(tr -dc '0-9' <"$DIR/run/slurmctld.pid")"
  kill -TERM "$ctld_pid" 2>/dev/null || true
  for _ in $(seq 1 100); do [ -d "/proc/$ctld_pid" ] || break; sleep 0.1; done
  [ ! -d "/proc/$ctld_pid" ] || die "slurmctld ($ctld_pid) did not stop for the accounting restart"
  rm -f "$DIR/run/slurmctld.pid"
fi

if ! pid_alive "$DIR/run/slurmctld.pid" slurmctld; then
  log "starting slurmctld on port $CTLD_PORT"
  slurmctld -f "$CONF" || { tail -n 30 "$DIR/log/slurmctld.log" >&2 || true; die "slurmctld failed to start"; }
fi
ctld_ok=0
for _ in $(seq 1 100); do
  if timeout 5 scontrol ping 2>/dev/null | grep -q 'is UP'; then ctld_ok=1; break; fi
  sleep 0.2
done
[ "$ctld_ok" = 1 ] || { tail -n 30 "$DIR/log/slurmctld.log" >&2 || true; die "slurmctld does not answer 'scontrol ping'"; }

for n in "${NODES[@]}"; do
  if ! pid_alive "$DIR/run/slurmd-$n.pid" slurmd; then
    log "starting slurmd -N $n"
    slurmd -f "$CONF" -N "$n" || { tail -n 30 "$DIR/log/slurmd-$n.log" >&2 || true; die "slurmd -N $n failed to start"; }
  fi
done

# ---------------------------------------------------------------- wait for idle
# Nodes remembered as DOWN/DRAIN from an earlier run (saved state) are resumed;
# a trailing '*' means not responding yet, so those are only waited for.
deadline=$(( $(date +%s) + WAIT_S ))
while :; do
  states="$(timeout 10 sinfo -h -N -p gpu -o '%N %t' 2>/dev/null | sort -u || true)"
  idle=0
  while read -r name st; do
    [ -n "${name:-}" ] || continue
    case "$st" in
      idle) idle=$((idle + 1)) ;;
      inval*) echo "$states" >&2; tail -n 30 "$DIR/log/slurmctld.log" >&2 || true
              die "node $name is in state inval (bad gres.conf/slurm.conf?)" ;;
      *'*'|unk*) ;;  # not responding / unknown yet: wait
      down|drain|drng|drained|fail|failg|maint|resv|comp|boot*)
        case "$st" in
          down|drain|drng|drained|fail|failg)
            log "node $name is $st from an earlier run; resuming"
            scontrol update nodename="$name" state=resume >&2 || true ;;
        esac ;;
      *) ;;  # alloc/mix: jobs recovered from an earlier run; wait (fails at the deadline)
    esac
  done <<<"$states"
  [ "$idle" -ge "${#NODES[@]}" ] && break
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "--- sinfo:" >&2; echo "$states" >&2
    for f in "$DIR/log/slurmctld.log" "$DIR"/log/slurmd-*.log; do
      echo "--- tail $f:" >&2; tail -n 15 "$f" >&2 || true
    done
    die "not all ${#NODES[@]} nodes idle after ${WAIT_S}s"
  fi
  sleep 0.3
done

write_env
elapsed="$(awk -v a="$t_start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')"
echo "slurm cluster up (${#NODES[@]} nodes idle after ${elapsed}s): SLURM_CONF=$CONF (source $DIR/env.sh)"
