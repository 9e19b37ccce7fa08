"""Builds the shardps Python package with CMake: the extension (shardps._shardps), the
pure-Python modules, and the daemons (shardps_coordinator, shardps_server) inside the package,
so that an installed shardps runs from any directory with no build tree beside it.

    pip install --no-build-isolation .          (a venv, --user, or --target DIR)

The CMake build directory is build-pip/ (SHARDPS_PIP_BUILD_DIR overrides it); a second install
reuses it. Version: CMakeLists.txt's project(VERSION).
"""
import os
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))
os.makedirs(os.path.join(ROOT, "build-pip"), exist_ok=True)  # egg_base below must exist


def version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(shardps VERSION ([0-9.]+)", f.read()).group(1)


class CMakeBuild(build_py):
    """Runs the CMake build and assembles the package from its output."""

    def run(self):
        build = os.environ.get("SHARDPS_PIP_BUILD_DIR", os.path.join(ROOT, "build-pip"))
        subprocess.check_call(["cmake", "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                               "-DSHARDPS_WITH_PYTHON=ON", "-DPython3_EXECUTABLE=" + sys.executable])
        subprocess.check_call(["cmake", "--build", build, "-j", str(os.cpu_count() or 2),
                               "--target", "shardps_python", "shardps_server",
                               "shardps_coordinator_bin"])
        dst = os.path.join(self.build_lib, "shardps")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(build, "python", "shardps"), dst,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        bindir = os.path.join(dst, "_bin", "server")
        os.makedirs(bindir, exist_ok=True)
        for b in ("shardps_coordinator", "shardps_server"):
            shutil.copy2(os.path.join(build, "server", b), bindir)
        with open(os.path.join(dst, "_build_info.py"), "w") as f:
            f.write("# Written by setup.py: an installed package runs its own daemons.\n"
                    "import os\n"
                    "BUILD_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_bin')\n"
                    "VERSION = %r\n" % version())


class BinaryDistribution(Distribution):
    def has_ext_modules(self):  # the package carries a compiled extension and daemons
        return True


setup(
    name="shardps",
    version=version(),
    description="ShardPS: a parameter server over RDMA (one-sided push/pull), worker client",
    python_requires=">=3.9",
    install_requires=["numpy"],
    packages=["shardps"],
    package_dir={"": "python"},
    cmdclass={"build_py": CMakeBuild},
    distclass=BinaryDistribution,
    entry_points={"console_scripts": [
        "shardps-run=shardps.run:main",
        "shardps-coordinator=shardps.daemons:coordinator",
        "shardps-server=shardps.daemons:server",
    ]},
    zip_safe=False,
    # setuptools' own staging goes beside the CMake build, not into build/ (the main build).
    options={"build": {"build_base": os.path.join("build-pip", "setuptools")},
             "egg_info": {"egg_base": "build-pip"}},
)
