#!/usr/bin/env bash
# A Docker engine of our own for the compose harness, and its complete teardown.
#
#   engine.sh install   docker.io, docker-compose (v1), debootstrap, iptables from Debian when missing
#   engine.sh start     dockerd with its own --data-root/--exec-root/--pidfile/socket under
#                       $PDPROC_COMPOSE_ROOT (the data root on a tmpfs unless
#                       PDPROC_COMPOSE_KEEP=1 or PDPROC_COMPOSE_TMPFS=0); waits until it answers
#   engine.sh stop      stops it and puts the host back as it was: no dockerd, containerd or
#                       shim left, no mount under the root, no docker0 / br-* link, no DOCKER
#                       iptables chain, FORWARD policy and the forwarding sysctls as before the
#                       start, the root removed (PDPROC_COMPOSE_KEEP=1 keeps it). Safe to run
#                       any number of times, also after a crash.
#
# dockerd runs with --iptables=false --ip-forward=false: the stack needs no NAT (the builds
# are offline, the containers talk over one bridge, published ports go through
# docker-proxy on 127.0.0.1), so the host's firewall and sysctls are not changed at all. The
# teardown still removes what a dockerd with the defaults would have left.
set -euo pipefail
. "$(dirname "$0")/lib.sh"

STATE=$PDPROC_COMPOSE_ROOT/host-state
PIDFILE=$PDPROC_COMPOSE_ROOT/dockerd.pid
SYSCTLS="net.ipv4.ip_forward net.ipv6.conf.all.forwarding net.bridge.bridge-nf-call-iptables net.bridge.bridge-nf-call-ip6tables"

install() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v docker-compose >/dev/null || "$DOCKER" compose version >/dev/null 2>&1 || missing+=(docker-compose)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v iptables >/dev/null || missing+=(iptables)
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]} from Debian"
  # Another apt run on the machine holds the lock for a while: wait for it, not fail.
  apt-get -o DPkg::Lock::Timeout=600 update -qq
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    "${missing[@]}" >/dev/null
}

alive() { [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null; }

save_host_state() {
  [ -f "$STATE" ] && return 0 # a crashed run's state is the one from before it
  mkdir -p "$PDPROC_COMPOSE_ROOT"
  {
    for key in $SYSCTLS; do
      value=$(sysctl -n "$key" 2>/dev/null) && echo "sysctl $key $value"
    done
    if command -v iptables >/dev/null; then
      echo "policy $(iptables -S FORWARD | awk '$1 == "-P" {print $3; exit}')"
    fi
    for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do echo "link $link"; done
  } >"$STATE.tmp"
  mv "$STATE.tmp" "$STATE"
}

start() {
  alive && die "a dockerd already runs from $PDPROC_COMPOSE_ROOT (pid $(cat "$PIDFILE")): engine.sh stop"
  save_host_state
  mkdir -p "$PDPROC_COMPOSE_ROOT/data" "$PDPROC_COMPOSE_ROOT/exec"
  # A throwaway data root lives in memory (~1 GiB for the stack): builds need no disk I/O and
  # the teardown is an unmount instead of deleting a few hundred MB of layers file by file.
  if [ "${PDPROC_COMPOSE_KEEP:-0}" != 1 ] && [ "${PDPROC_COMPOSE_TMPFS:-1}" = 1 ] &&
    ! mountpoint -q "$PDPROC_COMPOSE_ROOT/data"; then
    mount -t tmpfs -o "size=${PDPROC_COMPOSE_TMPFS_SIZE:-6g},mode=0711" pdproc-compose "$PDPROC_COMPOSE_ROOT/data"
  fi
  log "starting dockerd (root $PDPROC_COMPOSE_ROOT)"
  # setsid: its own process group, so no signal meant for the caller's job reaches it and the
  # teardown can stop it (and what it started) by pid.
  setsid dockerd \
    --data-root "$PDPROC_COMPOSE_ROOT/data" \
    --exec-root "$PDPROC_COMPOSE_ROOT/exec" \
    --pidfile "$PIDFILE" \
    --host "$DOCKER_HOST" \
    --iptables=false --ip-forward=false --ip-masq=false \
    --storage-driver overlay2 \
    --log-level warn \
    >"$PDPROC_COMPOSE_ROOT/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 120); do
    if "$DOCKER" version >/dev/null 2>&1; then
      log "dockerd ready: $("$DOCKER" version --format 'engine {{.Server.Version}}')"
      return 0
    fi
    sleep 0.5
  done
  tail -20 "$PDPROC_COMPOSE_ROOT/dockerd.log" >&2 || true
  die "dockerd did not answer within 60 s"
}

# Pids of the processes whose command line names our root (dockerd, its containerd, shims).
ours() {
  local pid
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    [ "$pid" = $$ ] && continue
    if tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline" | grep -qF -- "$PDPROC_COMPOSE_ROOT/"; then
      echo "$pid"
    fi
  done
}

stop_processes() {
  if alive; then
    local pid
    pid=$(cat "$PIDFILE")
    log "stopping dockerd (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$pid" 2>/dev/null && { log "dockerd ignored SIGTERM for 30 s: SIGKILL"; kill -KILL "$pid" 2>/dev/null || true; }
  fi
  local left
  left=$(ours)
  if [ -n "$left" ]; then
    log "stopping what dockerd left: $(echo $left)"
    kill -TERM $left 2>/dev/null || true
    sleep 2
    left=$(ours)
    [ -n "$left" ] && kill -KILL $left 2>/dev/null || true
  fi
  return 0
}

unmount_all() {
  local mnt
  # Deepest first.
  for mnt in $(awk -v root="$PDPROC_COMPOSE_ROOT/" 'index($2, root) == 1 {print $2}' /proc/mounts | sort -r); do
    umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || log "cannot unmount $mnt"
  done
}

restore_network() {
  local link
  for link in $(ip -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
    case $link in
      docker0 | br-* | veth*)
        if ! grep -qx "link $link" "$STATE" 2>/dev/null; then
          ip link delete "$link" 2>/dev/null && log "removed link $link" || true
        fi ;;
    esac
  done
  if command -v iptables >/dev/null; then
    local table rule chain
    for table in filter nat; do
      # Jumps into Docker's chains from the built-in ones, then the chains themselves.
      iptables -t "$table" -S 2>/dev/null | grep -E '^-A (INPUT|FORWARD|OUTPUT|PREROUTING|POSTROUTING) .*(-j DOCKER|docker0|br-)' |
        while read -r rule; do
          eval "iptables -t $table ${rule/-A/-D}" && log "removed iptables -t $table $rule"
        done || true
      for chain in DOCKER DOCKER-USER DOCKER-ISOLATION-STAGE-1 DOCKER-ISOLATION-STAGE-2; do
        if iptables -t "$table" -S "$chain" >/dev/null 2>&1; then
          iptables -t "$table" -F "$chain" && iptables -t "$table" -X "$chain" && log "removed chain $table/$chain"
        fi
      done
    done
    local policy
    policy=$(awk '$1 == "policy" {print $2}' "$STATE" 2>/dev/null)
    [ -n "$policy" ] && iptables -P FORWARD "$policy"
  fi
  local key value
  while read -r kind key value; do
    [ "$kind" = sysctl ] || continue
    [ "$(sysctl -n "$key" 2>/dev/null)" = "$value" ] || { sysctl -qw "$key=$value" && log "restored $key=$value"; }
  done <"$STATE" 2>/dev/null || true
}

stop() {
  stop_processes
  unmount_all
  [ -f "$STATE" ] && restore_network
  if [ "${PDPROC_COMPOSE_KEEP:-0}" != 1 ] && [ -d "$PDPROC_COMPOSE_ROOT" ]; then
    log "removing $PDPROC_COMPOSE_ROOT ($(du -sh "$PDPROC_COMPOSE_ROOT" 2>/dev/null | cut -f1))"
    rm -rf "$PDPROC_COMPOSE_ROOT"
  else
    rm -f "$STATE"
  fi
  log "engine stopped, host restored"
}

case ${1:-} in
  install) install ;;
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 install|start|stop" >&2; exit 2 ;;
esac
