# Sourced by bench/pslite_rows.sh and bench/pslite_dense.sh: builds ps-lite's library from a
# checkout and runs one ps-lite cluster (scheduler + servers + workers on this host).
# Needs: g++, protoc + libprotobuf-dev, libzmq3-dev. Nothing lands in ShardPS's build tree:
# ps-lite's library goes to $PSLITE_DIR/build-sys (its own sources compiled directly with g++
# against the system protobuf and ZeroMQ; ps-lite's Makefile would download its own).

# pslite_build_lib: $PSLITE_DIR/build-sys/libps.a, once per checkout.
pslite_build_lib() {
  [ -f "$PSLITE_DIR/include/ps/ps.h" ] || { echo "no ps-lite checkout at $PSLITE_DIR" >&2; return 1; }
  PSLITE_LIB="$PSLITE_DIR/build-sys"
  [ -f "$PSLITE_LIB/libps.a" ] && return 0
  echo "building ps-lite ($(git -C "$PSLITE_DIR" rev-parse HEAD 2>/dev/null || echo '?')) in $PSLITE_LIB" >&2
  mkdir -p "$PSLITE_LIB/gen"
  protoc --cpp_out="$PSLITE_LIB/gen" --proto_path="$PSLITE_DIR/src" "$PSLITE_DIR/src/meta.proto"
  local f
  for f in customer postoffice van; do
    g++ -std=c++14 -O3 -fPIC -pthread -w -I"$PSLITE_DIR/include" -I"$PSLITE_DIR/src" \
      -I"$PSLITE_LIB/gen" -c "$PSLITE_DIR/src/$f.cc" -o "$PSLITE_LIB/$f.o"
  done
  g++ -std=c++14 -O3 -fPIC -w -I"$PSLITE_LIB/gen" -c "$PSLITE_LIB/gen/meta.pb.cc" -o "$PSLITE_LIB/meta.pb.o"
  rm -f "$PSLITE_LIB/libps.a.tmp"
  ar crs "$PSLITE_LIB/libps.a.tmp" "$PSLITE_LIB"/customer.o "$PSLITE_LIB"/postoffice.o \
    "$PSLITE_LIB"/van.o "$PSLITE_LIB"/meta.pb.o
  mv "$PSLITE_LIB/libps.a.tmp" "$PSLITE_LIB/libps.a"
}

# pslite_build_driver SRC OUT: a driver linked against the library.
pslite_build_driver() {
  g++ -std=c++14 -O3 -pthread -w -I"$PSLITE_DIR/include" -I"$PSLITE_LIB/gen" \
    "$1" "$PSLITE_LIB/libps.a" -lprotobuf -lzmq -o "$2"
}

pslite_free_port() {  # a port nothing listens on, below Linux's ephemeral range (32768-60999)
  local p
  while :; do
    p=$((10000 + RANDOM % 22000))
    if ! (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then echo "$p"; return; fi
  done
}

PSLITE_PIDS=()
pslite_cleanup() {
  local p
  for p in "${PSLITE_PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
}

# pslite_run_cluster S W LIMIT_S RUN_DIR BIN ARGS...: scheduler + S servers + W workers of BIN,
# each bounded by LIMIT_S, logs in RUN_DIR. Returns 0, 1 (a process failed or timed out), or 2
# (the scheduler could not bind its port: call again).
pslite_run_cluster() {
  local S=$1 W=$2 limit=$3 run=$4 bin=$5
  shift 5
  export DMLC_PS_ROOT_URI=127.0.0.1 DMLC_PS_ROOT_PORT=$(pslite_free_port) DMLC_NODE_HOST=127.0.0.1
  export DMLC_NUM_SERVER=$S DMLC_NUM_WORKER=$W
  PSLITE_PIDS=()
  DMLC_ROLE=scheduler timeout "$limit" "$bin" "$@" > "$run/scheduler.log" 2>&1 &
  PSLITE_PIDS+=($!)
  local i
  for ((i = 0; i < S; ++i)); do
    DMLC_ROLE=server timeout "$limit" "$bin" "$@" > "$run/server$i.log" 2>&1 &
    PSLITE_PIDS+=($!)
  done
  for ((i = 0; i < W; ++i)); do
    DMLC_ROLE=worker timeout "$limit" "$bin" "$@" > "$run/worker$i.log" 2>&1 &
    PSLITE_PIDS+=($!)
  done
  echo "ps-lite ${S}x$W: scheduler + $S server(s) + $W worker(s), port $DMLC_PS_ROOT_PORT," \
       "logs in $run; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  # Wait for all; the first to fail (crash or timeout) takes the others down with it, since
  # ps-lite's peers would otherwise wait for it until their own timeout.
  local failed=0 live=("${PSLITE_PIDS[@]}") rest rc done_pid p
  while [ "${#live[@]}" -gt 0 ]; do
    rc=0
    done_pid=""
    wait -n -p done_pid "${live[@]}" || rc=$?
    [ -n "$done_pid" ] || break  # nothing left to wait for
    rest=()
    for p in "${live[@]}"; do [ "$p" != "$done_pid" ] && rest+=("$p"); done
    live=("${rest[@]+"${rest[@]}"}")
    if [ "$rc" != 0 ] && [ "$failed" = 0 ]; then
      failed=1
      sleep 1
      for p in "${live[@]+"${live[@]}"}"; do kill "$p" 2>/dev/null || true; done
    fi
  done
  PSLITE_PIDS=()
  if [ "$failed" = 0 ]; then return 0; fi
  if grep -q "bind failed" "$run/scheduler.log"; then return 2; fi
  echo "ps-lite ${S}x$W: a process failed or timed out (limit ${limit}s); logs:" >&2
  tail -n 5 "$run"/*.log >&2 || true
  return 1
}
