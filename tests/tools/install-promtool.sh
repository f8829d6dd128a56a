#!/usr/bin/env bash
# Installs promtool alone (no Prometheus server, nothing started): Debian 12's `prometheus` package
# is downloaded, not installed, and unpacked into DEST; tests/unit/test_alert_rules_promtool.py runs
# DEST/usr/bin/promtool (DEST defaults to .venv/tools/prometheus, where the tests look).
# Usage: tests/tools/install-promtool.sh [DEST]
set -euo pipefail
dest=$(realpath -m "${1:-.venv/tools/prometheus}")
if [ -x "$dest/usr/bin/promtool" ]; then
  echo "promtool: already in $dest ($("$dest/usr/bin/promtool" --version 2>&1 | head -1))"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# apt-get download writes into the current folder (as root it warns that the _apt user cannot
# write there and downloads as root instead: harmless).
# A fresh machine may have no package lists yet: read them once, then try again.
if ! (cd "$work" && apt-get download prometheus); then
  [ "$(id -u)" = 0 ] || { echo "promtool: apt-get download failed and not root to run apt-get update" >&2; exit 1; }
  apt-get update -qq
  (cd "$work" && apt-get download prometheus)
fi
mkdir -p "$dest"
dpkg -x "$work"/prometheus_*.deb "$work/x"
mkdir -p "$dest/usr/bin"
cp "$work/x/usr/bin/promtool" "$dest/usr/bin/promtool"
echo "promtool: $("$dest/usr/bin/promtool" --version 2>&1 | head -1) in $dest"
