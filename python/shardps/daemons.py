"""The daemons this package carries (or its build's), as console scripts:
shardps-coordinator and shardps-server run shardps_coordinator / shardps_server with the
arguments given. path("shardps_server") names the binary."""
import os
import sys

from . import _build_info


def path(name):
    build = os.environ.get("SHARDPS_BUILD_DIR") or _build_info.BUILD_DIR
    return os.path.join(build, "server", name)


def _exec(name):
    p = path(name)
    if not os.access(p, os.X_OK):
        sys.exit(f"shardps: {p} is missing (build first, or reinstall the package)")
    os.execv(p, [p] + sys.argv[1:])


def coordinator():
    _exec("shardps_coordinator")


def server():
    _exec("shardps_server")
