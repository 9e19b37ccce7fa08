"""The launch defaults every ShardPS launcher shares (launch_defaults.env, beside this file).

The shell launchers (scripts/launch-local.sh, mpirun.sh, launch-hostfile.sh,
scripts/slurm/shardps.sbatch) source the same file; `python -m shardps.run` reads it here.
An environment variable of the same name overrides a value from the file.
"""
import os

_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_defaults.env")


def load(path=_FILE, environ=None):
    """Returns {NAME: value} (strings), the file's values overridden by the environment's."""
    environ = os.environ if environ is None else environ
    values = {}
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.isidentifier():
                raise ValueError(f"{path}:{n}: not KEY=VALUE: {line!r}")
            values[key] = value
    for key in values:
        if key in environ and environ[key] != "":
            values[key] = environ[key]
    return values


def get(name, cast=str):
    """One default, e.g. get("SHARDPS_SERVERS", int)."""
    return cast(load()[name])
