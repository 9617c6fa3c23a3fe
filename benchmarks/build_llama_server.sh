#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama-cpp-python source distribution (PyPI), once, into a
# cache outside the repository. Prints the path of the binary. Nothing built here is committed.
#   PDSERVE_HOME (default ~/.cache/pdserve)   LLAMA_CPP_PYTHON_VERSION (default: latest)
set -euo pipefail
home="${PDSERVE_HOME:-$HOME/.cache/pdserve}"
dest="$home/llama.cpp"
bin="$dest/build/bin/llama-server"
if [[ -x "$bin" ]]; then echo "$bin"; exit 0; fi
mkdir -p "$dest/src"
python="${PYTHON:-python3}"
spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
"$python" -m pip download --quiet --no-deps --no-binary :all: --dest "$dest/src" "$spec" >&2
sdist="$(ls -t "$dest"/src/llama_cpp_python-*.tar.gz | head -1)"
tar -xzf "$sdist" -C "$dest/src"
root="$(ls -d "$dest"/src/llama_cpp_python-*/vendor/llama.cpp | head -1)"
echo "building llama-server from $root" >&2
cmake -S "$root" -B "$dest/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DGGML_NATIVE=ON >&2
cmake --build "$dest/build" --target llama-server llama-bench -j "$(nproc)" >&2
echo "$bin"
