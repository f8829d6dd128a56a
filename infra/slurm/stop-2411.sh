#!/usr/bin/env bash
# Stop the Slurm 24.11 cluster started by infra/slurm/start-2411.sh.
#
# Cancels all jobs, stops sshd, slurmd x4, slurmctld and munged by their pid
# files (SIGTERM, SIGKILL after 15 s), unmounts /proc, /dev, /sys, /tmp from
# the root and ends the mount-namespace holder, so nothing of it stays mounted.
# Idempotent. `--purge` also removes the state folder and the trixie root
# (only after checking that nothing is mounted under it).
#
# Usage: infra/slurm/stop-2411.sh [--purge]
# Env:   TRAINMEDIC_SLURM2411_DIR (default /tmp/trainmedic-slurm2411)
#        TRAINMEDIC_SLURM2411_ROOT (default $DIR/root)
set -euo pipefail

DIR="${TRAINMEDIC_SLURM2411_DIR:-/tmp/trainmedic-slurm2411}"
ROOT="${TRAINMEDIC_SLURM2411_ROOT:-$DIR/root}"
NODES=(gpu01 gpu02 gpu03 gpu04)
PURGE=0
for arg in "$@"; do
  case "$arg" in
    --purge) PURGE=1 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "stop-2411.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
for v in DIR ROOT; do
  case "${!v}" in
    /?*) ;;
    *) echo "stop-2411.sh: $v must be an absolute path other than / (got '${!v}')" >&2; exit 2 ;;
  esac
done
export PATH="$PATH:/usr/sbin:/sbin"
DATA="$DIR/data"
RUN="$DATA/run"
BIN="$DIR/bin"
HOLDER_PID="$RUN/holder.pid"

pid_of() {
  local pf="$1" comm="$2" pid
  [ -s "$pf" ] || return 1
  pid="$(tr -dc '0-9' <"$pf")"
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$comm" ] || return 1
  echo "$pid"
}

# stop_daemons PIDFILE:COMM...: SIGTERM all at once, wait up to 15 s, then SIGKILL.
stop_daemons() {
  local spec pf comm pid pids=() comms=() i alive
  for spec in "$@"; do
    pf="${spec%%:*}" comm="${spec##*:}"
    if pid="$(pid_of "$pf" "$comm")"; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid") comms+=("$comm")
    fi
  done
  for _ in $(seq 1 150); do
    alive=0
    for i in "${!pids[@]}"; do
      [ "$(cat "/proc/${pids[$i]}/comm" 2>/dev/null)" = "${comms[$i]}" ] && alive=1
    done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    if [ "$(cat "/proc/${pids[$i]}/comm" 2>/dev/null)" = "${comms[$i]}" ]; then
      echo "stop-2411.sh: ${comms[$i]} (${pids[$i]}) ignored SIGTERM; sending SIGKILL" >&2
      kill -KILL "${pids[$i]}" 2>/dev/null || true
    fi
  done
  for spec in "$@"; do rm -f "${spec%%:*}"; done
}

if pid_of "$RUN/slurmctld.pid" slurmctld >/dev/null && [ -x "$BIN/squeue" ]; then
  jobs="$(timeout 10 "$BIN/squeue" -h -o '%i' 2>/dev/null || true)"
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    timeout 10 "$BIN/scancel" $jobs 2>/dev/null || true
    for _ in $(seq 1 50); do
      [ -z "$(timeout 5 "$BIN/squeue" -h -t running,completing -o '%i' 2>/dev/null || true)" ] && break
      sleep 0.2
    done
  fi
fi

specs=("$RUN/slurmrestd.pid:slurmrestd" "$RUN/sshd.pid:sshd" "$RUN/slurmctld.pid:slurmctld")
for n in "${NODES[@]}"; do specs+=("$RUN/slurmd-$n.pid:slurmd"); done
stop_daemons "${specs[@]}"
stop_daemons "$RUN/slurmdbd.pid:slurmdbd"   # after slurmctld: it sends its last records there
stop_daemons "$DATA/mysql/mysqld.pid:mariadbd"
stop_daemons "$DATA/munge/munged.pid:munged"   # last: the others need it to shut down cleanly

# The mounts live only in the holder's namespace: unmount them there, then end it.
if holder="$(pid_of "$HOLDER_PID" sleep)" && [ "$(readlink "/proc/$holder/ns/mnt")" != "$(readlink /proc/self/ns/mnt)" ]; then
  for target in "$ROOT$DATA" "$ROOT/tmp" "$ROOT/dev" "$ROOT/sys" "$ROOT/proc"; do
    if nsenter -t "$holder" -m -- mountpoint -q "$target" 2>/dev/null; then
      nsenter -t "$holder" -m -- umount "$target" 2>/dev/null \
        || nsenter -t "$holder" -m -- umount -l "$target" \
        || echo "stop-2411.sh: cannot unmount $target (namespace ends with the holder anyway)" >&2
    fi
  done
  stop_daemons "$HOLDER_PID:sleep"
fi

if [ "$PURGE" = 1 ] && [ -d "$DIR" ]; then
  if grep -qsF " $ROOT/" /proc/mounts || grep -qsF " $DIR/" /proc/mounts; then
    echo "stop-2411.sh: something is still mounted under $DIR or $ROOT; not removing" >&2
    exit 1
  fi
  rm -rf --one-file-system -- "$DIR"
  [ "$ROOT" = "$DIR/root" ] || rm -rf --one-file-system -- "$ROOT"
  echo "slurm 24.11 cluster stopped; removed $DIR"
else
  echo "slurm 24.11 cluster stopped (state and root kept in $DIR)"
fi
