#!/usr/bin/env bash
# Conventional command lines (issue 17): for every program given, `--help` exits 0 and prints
# the usage and then the program's own flags, before any glog flag, with no build path in it;
# `--helpfull` exits 0 and lists glog's flags too; `--version` exits 0 and prints
# "NAME X.Y.Z (git ...; ...)"; an unknown flag exits non-zero.
# usage: cli_test.sh SOURCE_DIR PROGRAM[:SUBCOMMAND] ...
set -uo pipefail
SRC=$1
shift
fails=0
fail() { echo "cli_test: FAIL: $*" >&2; fails=$((fails + 1)); }
for spec in "$@"; do
  bin=${spec%%:*}
  sub=""
  [[ $spec == *:* ]] && sub=${spec#*:}
  name=$(basename "$bin")${sub:+ $sub}
  cmd=("$bin" ${sub:+"$sub"})
  help=$("${cmd[@]}" --help 2>&1) || fail "$name --help exits $?"
  first_flag=$(grep -m1 -E '^ +--[a-z]' <<<"$help" | sed -E 's/^ +--([a-z0-9_]+).*/\1/')
  [[ -n $first_flag ]] || fail "$name --help lists no flag"
  case $first_flag in
    alsologtoemail|alsologtostderr|colorlogtostderr|log_dir|logtostderr|minloglevel|v|vmodule|flagfile|fromenv)
      fail "$name --help starts with glog/gflags' --$first_flag" ;;
  esac
  grep -q -- "--logbuflevel" <<<"$help" && fail "$name --help lists glog's flags (--helpfull does)"
  grep -q "$SRC" <<<"$help" && fail "$name --help shows the build path $SRC"
  grep -q -- "--helpfull" <<<"$help" || fail "$name --help does not mention --helpfull"
  full=$("${cmd[@]}" --helpfull 2>&1) || fail "$name --helpfull exits $?"
  grep -q -- "-logtostderr" <<<"$full" || fail "$name --helpfull lacks glog's flags"
  version=$("${cmd[@]}" --version 2>&1) || fail "$name --version exits $?"
  grep -qE "^$name [0-9]+\.[0-9]+\.[0-9]+ \(git [^;]+; [A-Za-z]+; verbs (on|off); cuda (on|off); " \
    <<<"$version" || fail "$name --version printed '$version'"
  if "${cmd[@]}" --no_such_flag_anywhere >/dev/null 2>&1; then
    fail "$name accepts an unknown flag"
  fi
  echo "cli_test: $name: --help lists --$first_flag first ($(grep -cE '^ +--[a-z]' <<<"$help") flags); $version"
done
[[ $fails -eq 0 ]] && echo "cli_test: PASS" || { echo "cli_test: $fails failure(s)"; exit 1; }
