#!/bin/sh
# Fill a wheelhouse with every wheel the server and trainer images install, for offline image builds
# (`--build-arg PIP_SOURCE=wheelhouse`): pip inside `docker build` then needs no network at all.
#
#   docker/wheelhouse.sh [DIR]       default DIR: docker/wheelhouse (the build context's copy)
#
# PYTHON picks the interpreter whose pip downloads (its version and platform must be the images':
# CPython 3.11 on linux/x86_64 for the defaults); TORCH the torch requirement. torch must be a CPU
# build: where pip's own sources give a CUDA one (PyPI's, with several GB of CUDA packages), it is
# taken from TORCH_INDEX instead (PyTorch's CPU wheels).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/wheelhouse}
py=${PYTHON:-python3}
torch=${TORCH:-torch==2.13.0}
mkdir -p "$out"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" "$torch"
if ! ls "$out" | grep -q '^torch-.*+cpu.*\.whl$'; then
    rm -f "$out"/torch-*.whl
    "$py" -m pip download -q --no-deps --only-binary=:all: -d "$out" \
        --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$torch"
fi
# Everything else; torch resolves to the CPU wheel just downloaded.
"$py" -m pip download -q --only-binary=:all: -d "$out" --find-links "$out" \
    "$torch" "$here/..[client,examples]" setuptools wheel
echo "$(ls "$out" | grep -c '\.whl$') wheels in $out" >&2
