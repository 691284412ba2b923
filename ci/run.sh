#!/usr/bin/env bash
# Set up (ci/setup.sh) and run the main job: python -m dsv4_rocm run, with any arguments given here.
set -euo pipefail
cd "$(dirname "$0")/.."
. ci/setup.sh
exec python3 -m dsv4_rocm run "$@"
