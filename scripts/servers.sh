#!/usr/bin/env bash
# Real servers for integration tests and benchmarks, on loopback only:
#   redis          single Redis on 127.0.0.1:16379, no persistence
#   redis-cluster  3-node Redis Cluster on 127.0.0.1:17001-17003, no persistence
#   s3             Ceph (1 mon, 1 OSD on a sparse file) + RADOS Gateway, S3 on
#                  http://127.0.0.1:17481, user tierkv-test / tierkv-test-secret
#   rgw            (stop/start only) the gateway alone: simulates an S3 outage
#
# Usage: scripts/servers.sh start|stop|status|clean [redis|redis-cluster|s3|rgw|all]
#   start   installs what is missing (apt, needs root), starts what is not
#           running, waits until it answers; a no-op for what already runs.
#   stop    SIGTERM in dependency order (rgw, osd, mon); Ceph data is kept,
#           so a later start serves the same objects.
#   status  one line per server; exit 1 if any requested server is down.
#   clean   stop, then delete all state.
# State lives in ${TIERKV_SERVERS_DIR:-/tmp/tierkv-servers}; $DIR/env holds
# `export TIERKV_TEST_*=...` lines for the servers that are up (tests read it).
set -euo pipefail

DIR=${TIERKV_SERVERS_DIR:-/tmp/tierkv-servers}
REDIS_PORT=16379
CLUSTER_PORTS=(17001 17002 17003)
MON_ADDR=127.0.0.1:13300
S3_PORT=17481
S3_ACCESS=tierkv-test
S3_SECRET=tierkv-test-secret
CEPH=$DIR/ceph
CONF=$CEPH/ceph.conf

log() { echo "servers: $*"; }
die() { echo "servers: error: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# ---------------------------------------------------------------- helpers

# apt_install CMD... -- PKG...: install PKGs unless every CMD is on PATH.
apt_install() {
  local cmds=() missing=0
  while [ "$1" != "--" ]; do cmds+=("$1"); shift; done
  shift
  for c in "${cmds[@]}"; do command -v "$c" >/dev/null || missing=1; done
  [ "$missing" = 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need ${*} (apt-get install as root), or put ${cmds[*]} on PATH"
  local t0; t0=$(now)
  log "apt-get install $*"
  local apt=(apt-get -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends install "$@")
  # A fresh machine may have no package lists yet: update once, then retry.
  if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >"$DIR/apt.log" 2>&1; then
    apt-get -qq -o DPkg::Lock::Timeout=300 update >>"$DIR/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$DIR/apt.log" 2>&1 \
      || { tail -20 "$DIR/apt.log" >&2; die "apt-get install $* failed"; }
  fi
  log "installed $* in $(since "$t0") s"
}

# alive PIDFILE: the process named in PIDFILE is running and is one of our
# daemons (a stale file may name a recycled pid: never signal a stranger).
alive() {
  [ -s "$1" ] || return 1
  local comm; comm=$(cat "/proc/$(cat "$1")/comm" 2>/dev/null) || return 1
  case "$comm" in redis-server|ceph-mon|ceph-osd|radosgw) return 0;; *) return 1;; esac
}

# wait_until SECONDS WHAT CMD...: poll CMD until it succeeds.
wait_until() {
  local limit=$1 what=$2 t0; shift 2
  t0=$(date +%s)
  until "$@" >/dev/null 2>&1; do
    [ $(( $(date +%s) - t0 )) -lt "$limit" ] || die "$what did not come up within ${limit}s (logs in $DIR)"
    sleep 0.2
  done
}

any_alive() { local p; for p in "$@"; do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }

# terminate NAME PIDFILE...: SIGTERM them all, wait up to 20 s, then SIGKILL.
terminate() {
  local name=$1 f pids=() i; shift
  for f in "$@"; do
    if alive "$f"; then pids+=("$(cat "$f")"); kill -TERM "${pids[-1]}" 2>/dev/null || true; fi
  done
  for i in $(seq 200); do any_alive "${pids[@]}" || break; sleep 0.1; done
  for f in "${pids[@]}"; do
    if kill -0 "$f" 2>/dev/null; then log "$name ($f) ignored SIGTERM; killing"; kill -KILL "$f" 2>/dev/null || true; fi
  done
  rm -f "$@"
}

# spawn PIDFILE LOG CMD...: run CMD detached (own session, no inherited fds).
spawn() {
  local pidfile=$1 logf=$2; shift 2
  setsid "$@" </dev/null >>"$logf" 2>&1 9>&- &
  echo $! >"$pidfile"
}

http_answers() {  # any HTTP status line from the S3 port
  exec 3<>"/dev/tcp/127.0.0.1/$S3_PORT" || return 1
  printf 'GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
  local line; IFS= read -r -t 2 line <&3 || true
  exec 3<&- 3>&-
  [[ "$line" == HTTP/* ]]
}

redis_ping() { [ "$(redis-cli -h 127.0.0.1 -p "$1" ping 2>/dev/null)" = PONG ]; }
cluster_ok() { redis-cli -h 127.0.0.1 -p "${CLUSTER_PORTS[0]}" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; }
ceph_cli() { timeout 30 ceph -c "$CONF" --connect-timeout 20 "$@"; }
osd_up() { ceph_cli osd stat 2>/dev/null | grep -q ' 1 up'; }

# ---------------------------------------------------------------- redis

redis_up() { alive "$DIR/redis/redis.pid" && redis_ping "$REDIS_PORT"; }

start_redis() {
  redis_up && { log "redis: already running on $REDIS_PORT"; return 0; }
  apt_install redis-server redis-cli -- redis-server
  local t0; t0=$(now)
  mkdir -p "$DIR/redis"
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no --daemonize yes \
    --pidfile "$DIR/redis/redis.pid" --logfile "$DIR/redis/redis.log" --dir "$DIR/redis" 9>&-
  wait_until 20 redis redis_up
  log "redis: up on 127.0.0.1:$REDIS_PORT in $(since "$t0") s"
}

stop_redis() { terminate redis "$DIR/redis/redis.pid"; }

cluster_up() {
  local p
  for p in "${CLUSTER_PORTS[@]}"; do alive "$DIR/redis-cluster/$p/redis.pid" || return 1; done
  cluster_ok
}

start_cluster() {
  cluster_up && { log "redis-cluster: already running on ${CLUSTER_PORTS[*]}"; return 0; }
  apt_install redis-server redis-cli -- redis-server
  local t0 p addrs=(); t0=$(now)
  stop_cluster  # a partial cluster is rebuilt from scratch: it holds nothing durable
  for p in "${CLUSTER_PORTS[@]}"; do
    mkdir -p "$DIR/redis-cluster/$p"
    redis-server --bind 127.0.0.1 --port "$p" --save '' --appendonly no --daemonize yes \
      --cluster-enabled yes --cluster-config-file "$DIR/redis-cluster/$p/nodes.conf" \
      --pidfile "$DIR/redis-cluster/$p/redis.pid" --logfile "$DIR/redis-cluster/$p/redis.log" \
      --dir "$DIR/redis-cluster/$p" 9>&-
    addrs+=("127.0.0.1:$p")
  done
  for p in "${CLUSTER_PORTS[@]}"; do wait_until 20 "redis node $p" redis_ping "$p"; done
  redis-cli --cluster create "${addrs[@]}" --cluster-replicas 0 --cluster-yes >"$DIR/redis-cluster/create.log" 2>&1 \
    || { cat "$DIR/redis-cluster/create.log" >&2; die "redis-cli --cluster create failed"; }
  wait_until 20 "redis cluster" cluster_ok
  log "redis-cluster: up on ${addrs[*]} in $(since "$t0") s"
}

stop_cluster() {
  local p files=()
  for p in "${CLUSTER_PORTS[@]}"; do files+=("$DIR/redis-cluster/$p/redis.pid"); done
  terminate redis-cluster "${files[@]}"
  rm -rf "$DIR/redis-cluster"
}

# ---------------------------------------------------------------- ceph + rgw

write_ceph_conf() {
  [ -f "$CONF" ] && return 0
  mkdir -p "$CEPH/run" "$CEPH/log" "$CEPH/rgw"
  cat >"$CONF" <<EOF
[global]
fsid = $(cat /proc/sys/kernel/random/uuid)
mon_host = [v2:$MON_ADDR]
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
# without these two radosgw hangs for minutes negotiating auth
ms_client_mode = crc
ms_mon_client_mode = crc
ms_bind_ipv6 = false
run_dir = $CEPH/run
admin_socket = $CEPH/run/\$name.asok
pid_file = $CEPH/run/\$name.pid
log_file = $CEPH/log/\$name.log
osd_pool_default_size = 1
osd_pool_default_min_size = 1
mon_allow_pool_size_one = true
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_data_avail_warn = 1

[mon.a]
mon_data = $CEPH/mon
public_addr = 127.0.0.1

[osd.0]
osd_data = $CEPH/osd
osd_objectstore = bluestore
# the block file must live outside osd_data, else mkfs fails (symlink loop)
bluestore_block_path = $CEPH/osd-block.img
bluestore_block_create = true
bluestore_block_size = 10737418240
osd_memory_target = 1073741824

[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$S3_PORT
rgw_data = $CEPH/rgw
EOF
}

start_mon() {
  alive "$CEPH/mon.pid" && return 0
  if [ ! -f "$CEPH/mon/.made" ]; then
    rm -rf "$CEPH/mon"
    monmaptool --clobber --create --addv a "[v2:$MON_ADDR]" --fsid "$(awk '/^fsid/ {print $3}' "$CONF")" \
      "$CEPH/monmap" >/dev/null
    ceph-mon -c "$CONF" --mkfs -i a --monmap "$CEPH/monmap" >>"$CEPH/log/setup.log" 2>&1
    touch "$CEPH/mon/.made"
  fi
  spawn "$CEPH/mon.pid" "$CEPH/log/mon.out" ceph-mon -c "$CONF" -i a -f
}

start_osd() {
  alive "$CEPH/osd.pid" && return 0
  if [ ! -f "$CEPH/osd/.made" ]; then
    local uuid; uuid=$(cat /proc/sys/kernel/random/uuid)
    rm -rf "$CEPH/osd" "$CEPH/osd-block.img"
    mkdir -p "$CEPH/osd"
    ceph_cli osd new "$uuid" >>"$CEPH/log/setup.log" 2>&1 || die "ceph osd new failed (see $CEPH/log)"
    ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$uuid" >>"$CEPH/log/setup.log" 2>&1 \
      || die "ceph-osd --mkfs failed (see $CEPH/log/setup.log)"
    touch "$CEPH/osd/.made"
  fi
  spawn "$CEPH/osd.pid" "$CEPH/log/osd.out" ceph-osd -c "$CONF" -i 0 -f
}

start_rgw() {
  alive "$CEPH/rgw.pid" && return 0
  spawn "$CEPH/rgw.pid" "$CEPH/log/rgw.out" radosgw -c "$CONF" -n client.rgw.a -f
}

s3_user() {
  [ -f "$CEPH/.user" ] && return 0
  timeout 60 radosgw-admin -c "$CONF" -n client.rgw.a user info --uid="$S3_ACCESS" >/dev/null 2>&1 \
    || timeout 60 radosgw-admin -c "$CONF" -n client.rgw.a user create --uid="$S3_ACCESS" \
      --display-name="tierkv tests" --access-key="$S3_ACCESS" --secret-key="$S3_SECRET" \
      >>"$CEPH/log/setup.log" 2>&1 || die "radosgw-admin user create failed (see $CEPH/log/setup.log)"
  touch "$CEPH/.user"
}

s3_up() { alive "$CEPH/rgw.pid" && http_answers; }

start_s3() {
  s3_up && { log "s3: already running on http://127.0.0.1:$S3_PORT"; return 0; }
  apt_install radosgw radosgw-admin ceph-mon ceph-osd ceph monmaptool -- radosgw ceph-mon ceph-osd
  local t0; t0=$(now)
  write_ceph_conf
  start_mon
  start_osd
  wait_until 90 "ceph osd" osd_up
  start_rgw
  wait_until 120 "radosgw" s3_up
  s3_user
  log "s3: up on http://127.0.0.1:$S3_PORT in $(since "$t0") s"
}

stop_rgw() { terminate radosgw "$CEPH/rgw.pid"; }

stop_s3() {
  local t0; t0=$(now)
  alive "$CEPH/rgw.pid" || alive "$CEPH/osd.pid" || alive "$CEPH/mon.pid" || return 0
  stop_rgw
  terminate ceph-osd "$CEPH/osd.pid"
  terminate ceph-mon "$CEPH/mon.pid"
  log "s3: stopped in $(since "$t0") s"
}

# ---------------------------------------------------------------- env + status

write_env() {
  local tmp="$DIR/env.tmp"
  : >"$tmp"
  if redis_up; then echo "export TIERKV_TEST_REDIS_URL=redis://127.0.0.1:$REDIS_PORT/0" >>"$tmp"; fi
  if cluster_up; then
    local IFS=,; echo "export TIERKV_TEST_REDIS_CLUSTER=${CLUSTER_PORTS[*]/#/127.0.0.1:}" >>"$tmp"
  fi
  if s3_up; then
    { echo "export TIERKV_TEST_S3_ENDPOINT=http://127.0.0.1:$S3_PORT"
      echo "export TIERKV_TEST_S3_ACCESS_KEY=$S3_ACCESS"
      echo "export TIERKV_TEST_S3_SECRET_KEY=$S3_SECRET"; } >>"$tmp"
  fi
  mv "$tmp" "$DIR/env"
}

status_one() {  # status_one NAME CHECK...
  local name=$1; shift
  if "$@" 2>/dev/null; then log "$name: up"; return 0; fi
  log "$name: down"; return 1
}

# ---------------------------------------------------------------- main

cmd=${1:-}
shift || true
targets=("${@:-all}")
[ "${targets[*]}" = all ] && targets=(redis redis-cluster s3)
for t in "${targets[@]}"; do
  case "$t" in redis|redis-cluster|s3|rgw) ;; *) die "unknown server '$t' (redis|redis-cluster|s3|rgw|all)";; esac
done

mkdir -p "$DIR"
exec 9>"$DIR/.lock"
flock 9  # concurrent callers (parallel test sessions) take turns; daemons never inherit fd 9

case "$cmd" in
  start)
    for t in "${targets[@]}"; do
      case "$t" in redis) start_redis;; redis-cluster) start_cluster;; s3|rgw) start_s3;; esac
    done
    write_env
    log "env: $DIR/env";;
  stop)
    for t in "${targets[@]}"; do
      case "$t" in redis) stop_redis;; redis-cluster) stop_cluster;; s3) stop_s3;; rgw) stop_rgw;; esac
    done
    write_env;;
  status)
    rc=0
    for t in "${targets[@]}"; do
      case "$t" in
        redis) status_one redis redis_up || rc=1;;
        redis-cluster) status_one redis-cluster cluster_up || rc=1;;
        s3|rgw) status_one s3 s3_up || rc=1;;
      esac
    done
    exit $rc;;
  clean)
    stop_s3; stop_cluster; stop_redis
    flock -u 9
    rm -rf "$DIR"
    log "removed $DIR";;
  *) die "usage: $0 start|stop|status|clean [redis|redis-cluster|s3|rgw|all]";;
esac
