# Sourced by the shell launchers: sets the launch defaults of python/shardps/launch_defaults.env
# (the one set every launcher shares) as shell variables, each unless the environment already
# sets it (the environment overrides the file; the launcher's flags override both).
_shardps_defaults_file="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/python/shardps/launch_defaults.env"
while IFS= read -r _line || [[ -n $_line ]]; do
  [[ -z $_line || $_line == \#* ]] && continue
  _key=${_line%%=*}
  [[ -n ${!_key:-} ]] || printf -v "$_key" '%s' "${_line#*=}"
done <"$_shardps_defaults_file"
unset _line _key _shardps_defaults_file
