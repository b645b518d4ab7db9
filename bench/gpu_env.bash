# Sourced (not run) by the GPU-machine scripts (gpu_check.sh, tune_tiles.sh, ab_builds.sh) from
# the repository root: the compiler and job settings of their builds, and their --help.
# The GPU image's default CXX (/opt/gcc wrapper) built an extension whose error-message
# formatting segfaulted (libstdc++ mismatch with the runtime); the system compiler is fine.
if [[ -x /usr/bin/g++ && "${CXX:-}" == /opt/gcc/* ]]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
export MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
# The script's header comment (from its second line to `set -uo pipefail`) as its usage.
print_header_usage() { sed -n '2,/^set /p' "$1" | sed '$d' | sed 's/^# \{0,1\}//'; }
