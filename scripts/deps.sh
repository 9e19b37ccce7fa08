#!/usr/bin/env bash
# Installs the Debian 12 packages ShardPS builds and tests with. Idempotent: apt-get runs only
# when something is missing. Needs root (or sudo) on a fresh machine.
set -euo pipefail

PKGS=(
  cmake make g++ pkg-config git ccache
  libgflags-dev libgoogle-glog-dev libprotobuf-dev protobuf-compiler libssl-dev
  libgtest-dev libgmock-dev
  libibverbs-dev librdmacm-dev rdma-core ibverbs-utils perftest
  iperf3 python3
  python3-sklearn openmpi-bin python3-matplotlib
  python3-dev pybind11-dev python3-numpy python3-torch python3-pytest
  python3-pip python3-setuptools python3-wheel python3-venv
  clang libclang-rt-14-dev
  stress-ng etcd-server etcd-client
  slurm-wlm munge
  prometheus
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep "install ok installed" >/dev/null || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "[deps] installing: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "[deps] all ${#PKGS[@]} packages present"
fi
