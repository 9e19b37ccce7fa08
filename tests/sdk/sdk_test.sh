#!/usr/bin/env bash
# The SDK from outside the tree (docs/sdk.md): `cmake --install` into a fresh prefix, then
#   1. the installed tree holds the libraries, the public headers only, the daemons and tools,
#      the CMake package and the pkg-config file;
#   2. libshardps.so exports the public API only (the C API and shardps:: of client.h/status.h:
#      no protobuf, glog, std:: or internal shardps:: symbols);
#   3. a C++ trainer (tests/sdk/consumer) configured with find_package(shardps) against that
#      prefix, linked once with shardps::shardps and once with shardps::shardps_static, trains
#      on a cluster of the INSTALLED coordinator and server and checks its weights after every
#      step;
#   4. the C API test (tests/capi/c_api_test.c) compiled with `pkg-config --cflags --libs
#      shardps` only, run against the installed daemons;
#   5. CPack's .deb: its contents, and the C test built again against the extracted package.
# usage: sdk_test.sh SOURCE_DIR BUILD_DIR          exit 0 pass, 1 fail
set -euo pipefail
# No `producer | grep -q` here: grep -q exits at the first match, the producer may then die of
# SIGPIPE, and pipefail turns a match into a failure (seen once in CI: "Client::Connect not
# exported" while it was). `grep ... >/dev/null` reads all its input.
SRC=$(cd "$1" && pwd)
BUILD=$(cd "$2" && pwd)
T=$(mktemp -d "${TMPDIR:-/tmp}/shardps-sdk.XXXXXX")
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  rm -rf "$T"
}
trap cleanup EXIT
fail() { echo "sdk_test: FAIL: $*" >&2; exit 1; }
step() { echo "sdk_test: $*"; }

P=$T/prefix
step "cmake --install $BUILD --prefix $P"
cmake --install "$BUILD" --prefix "$P" >"$T/install.log" 2>&1 || { cat "$T/install.log"; fail "install"; }
LIBDIR=$(dirname "$(find "$P" -name 'libshardps.so' | head -1)")
[[ -d $LIBDIR ]] || fail "no libshardps.so installed"

# 1. The installed tree.
for f in include/shardps/client.h include/shardps/status.h include/shardps/c_api.h \
         include/shardps/export.h include/shardps/version.h bin/shardps bin/shardps_server \
         bin/shardps_coordinator bin/shardps_checkpoint bin/shardps_plan bin/shardps_aggregator; do
  [[ -e $P/$f ]] || fail "not installed: $f"
done
for f in libshardps.so libshardps.a cmake/shardps/shardpsConfig.cmake \
         cmake/shardps/shardpsConfigVersion.cmake pkgconfig/shardps.pc; do
  [[ -e $LIBDIR/$f ]] || fail "not installed: ${LIBDIR#$P/}/$f"
done
extra=$(find "$P/include" -type f ! -path '*/shardps/client.h' ! -path '*/shardps/status.h' \
        ! -path '*/shardps/c_api.h' ! -path '*/shardps/export.h' ! -path '*/shardps/version.h')
[[ -z $extra ]] || fail "internal headers installed: $extra"
# Every installed public header compiles on its own.
for h in client.h status.h c_api.h export.h version.h; do
  echo "#include <shardps/$h>" | c++ -std=c++17 -fsyntax-only -I"$P/include" -x c++ - \
    || fail "shardps/$h does not compile on its own"
done
echo '#include <shardps/c_api.h>' | cc -std=c11 -fsyntax-only -I"$P/include" -x c - \
  || fail "shardps/c_api.h is not C"
"$P/bin/shardps_server" --version | grep '^shardps_server [0-9]' >/dev/null || fail "shardps_server --version"
step "installed: $(cd "$P" && find . -type f | wc -l) files; $("$P/bin/shardps" --version)"

# 2. Exported symbols.
nm -D --defined-only "$LIBDIR/libshardps.so" | awk '$2 != "A" {print $3}' | sed 's/@@SHARDPS_[0-9.]*$//' >"$T/syms"
total=$(wc -l <"$T/syms")
c_api=$(grep -c '^shardps_' "$T/syms" || true)
declared=$(grep -oE '\bshardps_[a-z_]+\(' "$P/include/shardps/c_api.h" | sort -u | wc -l)
c++filt <"$T/syms" | grep -vE '^shardps_|^shardps::|^(typeinfo|typeinfo name|vtable) for shardps::' \
  >"$T/foreign" || true
c++filt <"$T/syms" | grep -E '^shardps::(transport|control|worker|server|tools)::|^(typeinfo|typeinfo name|vtable) for shardps::(transport|control|worker|server)' \
  >>"$T/foreign" || true
step "libshardps.so exports $total symbols: $c_api of the C API ($declared declared in c_api.h)"
[[ -s $T/foreign ]] && { head -20 "$T/foreign"; fail "$(wc -l <"$T/foreign") non-public symbols exported"; }
[[ $c_api -eq $declared ]] || fail "C API: $c_api exported, $declared declared"
c++filt <"$T/syms" | grep '^shardps::Client::Connect' >/dev/null || fail "shardps::Client::Connect not exported"

# A one-worker SGD cluster of the installed daemons: start_cluster NAME -> $ADDR.
TOKEN=sdk-test-token
start_cluster() {
  local d=$T/$1
  mkdir -p "$d"
  timeout -s KILL 120 "$P/bin/shardps_coordinator" --listen=127.0.0.1:0 \
    --address_file="$d/coord.addr" --cluster_token=$TOKEN --num_servers=1 --num_workers=1 \
    --consistency=bsp --data_transport=tcp --partition_bytes=4096 --exit_when_done \
    >"$d/coordinator.log" 2>&1 &
  PIDS+=($!)
  disown $!
  for _ in $(seq 150); do [[ -s $d/coord.addr ]] && break; sleep 0.1; done
  [[ -s $d/coord.addr ]] || { cat "$d/coordinator.log"; fail "$1: no coordinator address"; }
  ADDR=$(<"$d/coord.addr")
  timeout -s KILL 120 "$P/bin/shardps_server" --coordinator="$ADDR" --cluster_token=$TOKEN \
    --transport=tcp --bind_ip=127.0.0.1 --optimizer=sgd --lr=0.25 --exit_when_done \
    >"$d/server.log" 2>&1 &
  PIDS+=($!)
  disown $!
}

# 3. The C++ consumer, through find_package(shardps).
step "consumer: find_package(shardps) with CMAKE_PREFIX_PATH=$P"
cmake -S "$SRC/tests/sdk/consumer" -B "$T/consumer" -DCMAKE_PREFIX_PATH="$P" \
  -DCMAKE_BUILD_TYPE=Release >"$T/consumer-cmake.log" 2>&1 \
  || { cat "$T/consumer-cmake.log"; fail "configuring the consumer"; }
cmake --build "$T/consumer" -j 2 >"$T/consumer-build.log" 2>&1 \
  || { cat "$T/consumer-build.log"; fail "building the consumer"; }
grep -q "shardps 0" "$T/consumer-cmake.log" || fail "find_package did not report the version"
if ldd "$T/consumer/consumer_static" | grep libshardps >/dev/null; then
  fail "consumer_static loads libshardps.so"
fi
ldd "$T/consumer/consumer_shared" | grep "$LIBDIR/libshardps.so" >/dev/null \
  || fail "consumer_shared does not load the installed libshardps.so"
for kind in shared static; do
  start_cluster "cpp-$kind"
  timeout -s KILL 60 "$T/consumer/consumer_$kind" "$ADDR" $TOKEN 5 0.25 \
    | tee "$T/consumer-$kind.out" || fail "consumer_$kind"
  grep -q "consumer: PASS" "$T/consumer-$kind.out" || fail "consumer_$kind did not pass"
done

# 4. The C API test, compiled with pkg-config only.
export PKG_CONFIG_PATH=$LIBDIR/pkgconfig
step "C: cc c_api_test.c \$(pkg-config --cflags --libs shardps) = $(pkg-config --cflags --libs shardps)"
cc -std=c11 -o "$T/c_api_test" "$SRC/tests/capi/c_api_test.c" $(pkg-config --cflags --libs shardps) \
  -Wl,-rpath,"$LIBDIR" -lpthread -lm || fail "compiling c_api_test with pkg-config"
timeout -s KILL 90 "$T/c_api_test" "$P/bin/shardps_coordinator" "$P/bin/shardps_server" "$T/capi" \
  >"$T/capi.out" 2>&1 || { tail -20 "$T/capi.out"; fail "c_api_test against the installed tree"; }
tail -1 "$T/capi.out"
# Static, from C: the archive and pkg-config's Libs.private.
cc -std=c11 -o "$T/c_api_test_static" "$SRC/tests/capi/c_api_test.c" \
  $(pkg-config --cflags shardps) "$LIBDIR/libshardps.a" \
  $(pkg-config --static --libs shardps | sed 's/-lshardps\b//') || fail "static link from C"
timeout -s KILL 90 "$T/c_api_test_static" "$P/bin/shardps_coordinator" "$P/bin/shardps_server" \
  "$T/capi-static" >"$T/capi-static.out" 2>&1 \
  || { tail -20 "$T/capi-static.out"; fail "static c_api_test"; }

# 5. The .deb.
step "cpack -G DEB"
(cd "$BUILD" && cpack -G DEB -B "$T/deb" >"$T/cpack.log" 2>&1) || { cat "$T/cpack.log"; fail "cpack"; }
deb=$(find "$T/deb" -maxdepth 1 -name 'shardps_*.deb' | head -1)
[[ -n $deb ]] || fail "no .deb produced"
dpkg-deb --info "$deb" | grep -E ' (Package|Version|Depends):' | sed 's/^/sdk_test:   /'
dpkg-deb -c "$deb" >"$T/deb.list"
for f in ./usr/include/shardps/client.h ./usr/bin/shardps_server ./usr/lib/libshardps.a \
         ./usr/lib/pkgconfig/shardps.pc ./usr/lib/cmake/shardps/shardpsConfig.cmake; do
  grep -q " $f\$" "$T/deb.list" || fail "$(basename "$deb") lacks $f"
done
dpkg-deb -x "$deb" "$T/debroot"
PKG_CONFIG_PATH=$T/debroot/usr/lib/pkgconfig
cc -std=c11 -o "$T/c_api_test_deb" "$SRC/tests/capi/c_api_test.c" \
  $(PKG_CONFIG_PATH=$PKG_CONFIG_PATH pkg-config --cflags --libs shardps) \
  -Wl,-rpath,"$T/debroot/usr/lib" -lpthread -lm || fail "building against the extracted .deb"
timeout -s KILL 90 "$T/c_api_test_deb" "$T/debroot/usr/bin/shardps_coordinator" \
  "$T/debroot/usr/bin/shardps_server" "$T/capi-deb" >"$T/capi-deb.out" 2>&1 \
  || { tail -20 "$T/capi-deb.out"; fail "c_api_test against the .deb"; }
step "$(basename "$deb"): $(wc -l <"$T/deb.list") entries; the C test passes against it"
echo "sdk_test: PASS"
