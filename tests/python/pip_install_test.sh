#!/usr/bin/env bash
# pip install of the shardps package, as a user does it offline on Debian (docs/python.md):
# `pip install --no-build-isolation` into a fresh target directory, then, from another directory
# and with no build tree on any path: import shardps, its version, a local cluster run by the
# package's own daemons trained for 3 steps (weights checked), and the console scripts.
# Run by ctest (python.pip_install). Bounded; the target directory is removed on exit.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-/usr/bin/python3}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
if ! timeout 1200 "$PY" -m pip install --no-build-isolation --no-deps --no-index \
     --target "$T/site" "$ROOT" >"$T/pip.log" 2>&1; then
  tail -40 "$T/pip.log" >&2
  echo "pip install failed" >&2
  exit 1
fi
cd /
env -u SHARDPS_BUILD_DIR -u PYTHONPATH PYTHONPATH="$T/site" GLOG_minloglevel=2 "$PY" - "$T/site" <<'PY'
import os, sys
import numpy as np
import shardps, shardps.launch, shardps.daemons
site = sys.argv[1]
assert shardps.__file__.startswith(site), shardps.__file__
assert shardps.daemons.path("shardps_server").startswith(site), shardps.daemons.path("shardps_server")
print("shardps", shardps.__version__, "from", os.path.dirname(shardps.__file__))
with shardps.launch.LocalCluster(servers=2, workers=1, lr=0.5, grace=1.0) as cl:
    with shardps.Client(cl.address, cluster_token=cl.token, transport="tcp",
                        bind_ip="127.0.0.1", setup_timeout_ms=20000) as c:
        w = np.zeros(40, dtype=np.float32)
        g = np.full(40, 2.0, dtype=np.float32)
        c.register("w", w, g)
        c.start()
        for _ in range(3):
            c.step()
        assert np.all(w == np.float32(-3.0)), w
print("installed package trained: w ==", float(w[0]))
PY
env -u SHARDPS_BUILD_DIR PYTHONPATH="$T/site" "$T/site/bin/shardps-run" --help >/dev/null
# gflags' --help exits 1 after printing: look at what it printed.
out=$(env -u SHARDPS_BUILD_DIR PYTHONPATH="$T/site" "$T/site/bin/shardps-server" --help 2>&1 || true)
grep -q -- "-spare" <<<"$out" || { echo "shardps-server did not run the packaged daemon" >&2; exit 1; }
echo "pip install: ok"
