#!/usr/bin/env bash
# Run a real slurmrestd 24.11 (Debian trixie's) against the 24.11 cluster of
# start-2411.sh, on 127.0.0.1, with JWT authentication.
#
#   infra/slurm/slurmrestd.sh start   idempotent; then: . "$DIR/rest/env.sh"
#   infra/slurm/slurmrestd.sh stop    stops slurmrestd by its pid file
#
# What start does, each step only when needed:
# - starts the 24.11 cluster (start-2411.sh, idempotent) and installs the
#   slurmrestd and slurm-wlm-jwt-plugin packages into its trixie root;
# - makes the HS256 key $ETC/jwt_hs256.key (root only). start-2411.sh adds
#   AuthAltTypes=auth/jwt + AuthAltParameters=jwt_key=... to slurm.conf when
#   the key exists; a slurmctld started before the key is restarted once (by
#   its pid file, state kept in StateSaveLocation) so that it accepts tokens;
# - creates the system user "slurmrestd" in the root: slurmrestd refuses to
#   run as root or as SlurmUser (root here), so it drops to that user;
# - starts slurmrestd (-a rest_auth/jwt) and writes a token for root made by
#   `scontrol token` to $DIR/rest/token (mode 600): the token lives in a file,
#   never on a command line; and one per non-root Slurm user of the cluster
#   (tmexec, tmop, tmuser when start-2411.sh made them) to $DIR/rest/token-USER.
# Needs root (the root's apt, chroot, the cluster's namespace).
#
# Env: TRAINMEDIC_SLURM2411_DIR       the 24.11 state folder (default /tmp/trainmedic-slurm2411)
#      TRAINMEDIC_SLURMRESTD_PORT     (default 16830)
#      TRAINMEDIC_SLURMRESTD_LIFESPAN token lifespan in seconds (default 86400)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${TRAINMEDIC_SLURM2411_DIR:-/tmp/trainmedic-slurm2411}"
ROOT="${TRAINMEDIC_SLURM2411_ROOT:-$DIR/root}"
PORT="${TRAINMEDIC_SLURMRESTD_PORT:-16830}"
LIFESPAN="${TRAINMEDIC_SLURMRESTD_LIFESPAN:-86400}"
DATA="$DIR/data"
ETC="$DATA/etc"
RUN="$DATA/run"
LOGD="$DATA/log"
CONF="$ETC/slurm.conf"
KEY="$ETC/jwt_hs256.key"
REST="$DIR/rest"
PIDFILE="$RUN/slurmrestd.pid"
HOLDER_PID="$RUN/holder.pid"
REST_USER=slurmrestd

die() { echo "slurmrestd.sh: ERROR: $*" >&2; exit 1; }
log() { echo "slurmrestd.sh: $*" >&2; }

pid_of() {  # pid_of PIDFILE COMM: the live pid in PIDFILE when its process is COMM
  local pf="$1" comm="$2" pid
  [ -s "$pf" ] || return 1
  pid="$(tr -dc '0-9' <"$pf")"
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$comm" ] || return 1
  echo "$pid"
}

stop_pid() {  # stop_pid PIDFILE COMM: TERM, wait up to 10 s, then KILL
  local pid
  pid="$(pid_of "$1" "$2")" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 100); do [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$2" ] || return 0; sleep 0.1; done
  log "$2 ($pid) ignored SIGTERM; sending SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
}

[ "$(id -u)" = 0 ] || die "must run as root"
case "${1:-}" in
  start) ;;
  stop) stop_pid "$PIDFILE" slurmrestd; rm -f "$PIDFILE"; echo "slurmrestd stopped"; exit 0 ;;
  *) die "usage: $0 start|stop" ;;
esac

ns() { nsenter -t "$(tr -dc '0-9' <"$HOLDER_PID")" -m -- "$@"; }
in_root() {
  ns chroot "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C HOME=/root SLURM_CONF="$CONF" "$@"
}
ping_rest() {  # the server answers HTTP at all (401 without a token is an answer)
  timeout 5 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null
}

"$HERE/start-2411.sh" >&2

# ---------------------------------------------------------------- packages
if [ ! -x "$ROOT/usr/sbin/slurmrestd" ] || [ ! -e "$ROOT/usr/lib/x86_64-linux-gnu/slurm-wlm/auth_jwt.so" ]; then
  log "installing slurmrestd + slurm-wlm-jwt-plugin into $ROOT"
  in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      slurmrestd slurm-wlm-jwt-plugin >"$LOGD/apt-slurmrestd.log" 2>&1 \
    || { in_root env DEBIAN_FRONTEND=noninteractive apt-get update >>"$LOGD/apt-slurmrestd.log" 2>&1 \
         && in_root env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
              slurmrestd slurm-wlm-jwt-plugin >>"$LOGD/apt-slurmrestd.log" 2>&1; } \
    || { tail -n 20 "$LOGD/apt-slurmrestd.log" >&2; die "cannot install slurmrestd into the root"; }
fi

# ---------------------------------------------------------------- JWT in slurmctld
if [ ! -s "$KEY" ]; then
  log "making the JWT key $KEY"
  umask 077
  head -c 32 /dev/urandom >"$KEY.tmp"
  mv -f "$KEY.tmp" "$KEY"
  umask 022
fi
chmod 600 "$KEY"
if ! grep -q '^AuthAltTypes=auth/jwt' "$CONF"; then
  # start-2411.sh writes the JWT lines once the key exists; a slurmctld started
  # before that has no JWT: restart it through start-2411.sh (state is kept).
  log "slurmctld has no auth/jwt yet: restarting it with the key"
  stop_pid "$RUN/slurmctld.pid" slurmctld
  "$HERE/start-2411.sh" >&2
  grep -q '^AuthAltTypes=auth/jwt' "$CONF" \
    || die "start-2411.sh did not add AuthAltTypes=auth/jwt to $CONF (does it include the jwt_hs256.key lines?)"
fi

# ---------------------------------------------------------------- user + token
# The root and this host share one kernel: slurmrestd's uid must be nobody's on the host
# either (else it could signal or own what a host user owns), so pick one free in both.
uid_taken() {  # uid_taken N: N is a uid or gid of any user/group on the host or in the root
  awk -F: -v n="$1" '$3 == n { found = 1 } END { exit !found }' \
    /etc/passwd /etc/group "$ROOT/etc/passwd" "$ROOT/etc/group"
}
rest_uid="$(awk -F: -v u="$REST_USER" '$1 == u { print $3 }' "$ROOT/etc/passwd")"
if [ -n "$rest_uid" ] && awk -F: -v n="$rest_uid" '$3 == n { found = 1 } END { exit !found }' /etc/passwd /etc/group; then
  log "uid/gid $rest_uid of $REST_USER in the root is taken on the host: recreating the user"
  stop_pid "$PIDFILE" slurmrestd
  in_root userdel "$REST_USER"
  in_root groupdel "$REST_USER" 2>/dev/null || true
  rest_uid=""
fi
if [ -z "$rest_uid" ]; then
  rest_uid=""
  for n in $(seq 899 -1 800); do uid_taken "$n" || { rest_uid="$n"; break; }; done
  [ -n "$rest_uid" ] || die "no uid in 800-899 is free on both the host and the root"
  log "creating system user $REST_USER (uid $rest_uid) in the root"
  in_root groupadd --system --gid "$rest_uid" "$REST_USER"
  in_root useradd --system --uid "$rest_uid" --gid "$rest_uid" --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin "$REST_USER"
fi
mkdir -p "$REST"
chmod 700 "$REST"
token="$(in_root scontrol token username=root lifespan="$LIFESPAN")" || die "scontrol token failed"
token="${token#SLURM_JWT=}"
[ -n "$token" ] || die "scontrol token printed no token"
umask 077
printf '%s\n' "$token" >"$REST/token.tmp"
mv -f "$REST/token.tmp" "$REST/token"
# Tokens for the cluster's non-root Slurm users too (start-2411.sh's accounting users), so the
# backend can be tested with the rights each one has: token-USER.
for u in tmexec tmop tmuser; do
  grep -q "^$u:" "$ROOT/etc/passwd" || continue
  t="$(in_root scontrol token username="$u" lifespan="$LIFESPAN")" || die "scontrol token username=$u failed"
  printf '%s\n' "${t#SLURM_JWT=}" >"$REST/token-$u.tmp"
  mv -f "$REST/token-$u.tmp" "$REST/token-$u"
done
umask 022

# ---------------------------------------------------------------- slurmrestd
same_namespace() {  # the running slurmrestd lives in the current holder's mount namespace
  local pid
  pid="$(pid_of "$PIDFILE" slurmrestd)" || return 1
  [ "$(readlink "/proc/$pid/ns/mnt")" = "$(readlink "/proc/$(tr -dc '0-9' <"$HOLDER_PID")/ns/mnt")" ]
}
# One left from a cluster that was stopped and started again lives in the old namespace: replace it.
if ! same_namespace || ! ping_rest; then
  stop_pid "$PIDFILE" slurmrestd
  log "starting slurmrestd on 127.0.0.1:$PORT as $REST_USER"
  uid="$(awk -F: -v u="$REST_USER" '$1 == u { print $3 }' "$ROOT/etc/passwd")"
  gid="$(awk -F: -v u="$REST_USER" '$1 == u { print $4 }' "$ROOT/etc/passwd")"
  # nsenter, chroot and env exec in turn, so $! is slurmrestd's own pid.
  # SLURM_JWT=daemon: without it slurmrestd passes requests on with auth/munge,
  # which rejects every client token ("Rejecting thread config token for user").
  # -s openapi/slurmctld only: the slurmdbd plugin makes slurmrestd exit ("Failure
  # loading plugin path bindings") when there is no accounting storage.
  setsid nsenter -t "$(tr -dc '0-9' <"$HOLDER_PID")" -m -- chroot "$ROOT" /usr/bin/env -i \
    PATH=/usr/sbin:/usr/bin:/sbin:/bin LC_ALL=C SLURM_CONF="$CONF" SLURM_JWT=daemon \
    slurmrestd -s openapi/slurmctld -a rest_auth/jwt -u "$uid" -g "$gid" "127.0.0.1:$PORT" \
    </dev/null >>"$LOGD/slurmrestd.log" 2>&1 &
  echo $! >"$PIDFILE"
  for _ in $(seq 1 100); do ping_rest && break; sleep 0.1; done
  pid_of "$PIDFILE" slurmrestd >/dev/null && ping_rest \
    || { tail -n 20 "$LOGD/slurmrestd.log" >&2 || true; die "slurmrestd did not come up"; }
fi

{
  printf '# slurmrestd 24.11 for the 24.11 cluster of start-2411.sh\n'
  printf 'export TRAINMEDIC_SLURMRESTD_URL=%q\n' "http://127.0.0.1:$PORT"
  printf 'export TRAINMEDIC_SLURMRESTD_USER=root\n'
  printf 'export TRAINMEDIC_SLURMRESTD_TOKEN_FILE=%q\n' "$REST/token"
  printf 'export TRAINMEDIC_SLURMRESTD_TOKEN_DIR=%q\n' "$REST"
} >"$REST/env.sh.tmp"
mv -f "$REST/env.sh.tmp" "$REST/env.sh"
echo "slurmrestd up on http://127.0.0.1:$PORT (pid $(cat "$PIDFILE")); token in $REST/token (source $REST/env.sh)"
