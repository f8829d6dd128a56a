#!/usr/bin/env bash
# Stop the local Slurm cluster started by infra/slurm/start.sh.
#
# Cancels all jobs (so no orphaned job processes outlive slurmd), then stops
# slurmd x4, slurmctld, slurmdbd, mariadbd and munged by their pid files and
# waits for them to exit. Idempotent. `--purge` also removes the state dir.
#
# Usage: infra/slurm/stop.sh [--purge]
# Env:   TRAINMEDIC_SLURM_DIR (default /tmp/trainmedic-slurm)
set -euo pipefail

DIR="${TRAINMEDIC_SLURM_DIR:-/tmp/trainmedic-slurm}"
NODES=(gpu01 gpu02 gpu03 gpu04)
PURGE=0
for arg in "$@"; do
  case "$arg" in
    --purge) PURGE=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "stop.sh: unknown argument '$arg'" >&2; exit 2 ;;
  esac
done
case "$DIR" in
  /?*) ;;
  *) echo "stop.sh: TRAINMEDIC_SLURM_DIR must be an absolute path other than / (got '$DIR')" >&2; exit 2 ;;
esac
export PATH="$PATH:/usr/sbin:/sbin"
export SLURM_CONF="$DIR/etc/slurm.conf"

# pid_of PIDFILE COMM: print the pid in PIDFILE if it is a live process named COMM.
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
      echo "stop.sh: ${comms[$i]} (${pids[$i]}) ignored SIGTERM; sending SIGKILL" >&2
      kill -KILL "${pids[$i]}" 2>/dev/null || true
    fi
  done
  for spec in "$@"; do rm -f "${spec%%:*}"; done
}

if pid_of "$DIR/run/slurmctld.pid" slurmctld >/dev/null && [ -s "$SLURM_CONF" ]; then
  jobs="$(timeout 10 squeue -h -o '%i' 2>/dev/null || true)"
  if [ -n "$jobs" ]; then
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    # Give slurmd a moment to kill the job steps (KillWait=2).
    for _ in $(seq 1 50); do
      [ -z "$(timeout 5 squeue -h -t running,completing -o '%i' 2>/dev/null || true)" ] && break
      sleep 0.2
    done
  fi
fi

specs=("$DIR/run/slurmctld.pid:slurmctld")
for n in "${NODES[@]}"; do specs+=("$DIR/run/slurmd-$n.pid:slurmd"); done
stop_daemons "${specs[@]}"
stop_daemons "$DIR/run/slurmdbd.pid:slurmdbd"   # after slurmctld: it sends its last records there
stop_daemons "$DIR/mysql/mysqld.pid:mariadbd"
stop_daemons "$DIR/munge/munged.pid:munged"   # last: the others need it to shut down cleanly

if [ "$PURGE" = 1 ] && [ -d "$DIR" ]; then
  rm -rf -- "$DIR"
  echo "slurm cluster stopped; removed $DIR"
else
  echo "slurm cluster stopped (state kept in $DIR)"
fi
