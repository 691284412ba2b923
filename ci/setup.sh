# Sourced by ci/test.sh and ci/run.sh (from the repository root, under set -e): put the Python packages
# in a virtual environment, the active one if python3 is already in one, else ./.venv (created here),
# and leave it active for the rest of the calling script.
#   - torch==2.13.0: a CPU build where pip's index serves one; an unpinned torch is a ~4 GB CUDA build
#   - triton==3.6.0, numpy, tqdm, and this package editable, with the extras named in $DSV4_EXTRAS
say() { echo "ci/$(basename "$0"): $*"; }
if ! python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  [ -x .venv/bin/python3 ] || { say "creating .venv"; python3 -m venv .venv; }
  . .venv/bin/activate
fi
say "installing torch==2.13.0 triton==3.6.0 dsv4_rocm${DSV4_EXTRAS:+[$DSV4_EXTRAS]} into $(python3 -c 'import sys; print(sys.prefix)')"
python3 -m pip install -q --disable-pip-version-check torch==2.13.0 triton==3.6.0 -e ".${DSV4_EXTRAS:+[$DSV4_EXTRAS]}"
# pip hides what the build printed (whether and why it skipped the HIP extension): say it here. info's output
# is captured whole before it is searched: a grep that stops at its first match, reading info through a pipe,
# could close the pipe under info and, with pipefail, report a successful info as failed.
info_line() {
  local out
  out=$(python3 -m dsv4_rocm info 2>/dev/null) || { echo "python -m dsv4_rocm info failed"; return; }
  grep -m1 '^HIP extension' <<<"$out" || echo "python -m dsv4_rocm info printed no 'HIP extension' line"
}
say "$(info_line)"
