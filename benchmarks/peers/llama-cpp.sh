#!/usr/bin/env bash
# llama.cpp's server on this CPU, as a peer to benchmark fulcrum against. Not a dependency of
# fulcrum. Built from the llama.cpp source that llama-cpp-python's source package vendors (the
# package registry is the one source reachable here), for this CPU (GGML_NATIVE).
#
#   llama-cpp.sh install [DIR]                   one-time, ~20 min on 2 cores, into DIR (default
#                                                ~/.cache/fulcrum-peers/llama.cpp)
#   llama-cpp.sh gguf MODEL_DIR OUT.gguf [bf16|q8_0]   a shape folder gets random weights first
#   llama-cpp.sh serve GGUF PORT [ARGS..]        runs llama-server on 127.0.0.1:PORT in the foreground
#
# Serve with -t set to the cores (the default here) and -np to the most requests served at once,
# each with -c / -np tokens of context: e.g. -c 512 -np 1 for one request of up to 512 tokens.
set -euo pipefail
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/fulcrum-peers/llama.cpp}
VERSION=0.3.36  # llama-cpp-python's; its vendored llama.cpp is what gets built
cmd=${1:-}; shift || true
case "$cmd" in
install)
  DIR=${1:-$DIR}
  mkdir -p "$DIR"
  tmp=$(mktemp -d)
  pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
  tar xzf "$tmp"/llama_cpp_python-$VERSION.tar.gz -C "$tmp"
  rm -rf "$DIR/src" && mv "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp" "$DIR/src"
  rm -rf "$tmp"
  cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$DIR/build" --target llama-server -j "$(nproc)" >/dev/null
  echo "vendored in llama-cpp-python $VERSION" > "$DIR/version"
  "$DIR/build/bin/llama-server" --version
  ;;
gguf)
  python "$(dirname "$0")/llama_cpp_gguf.py" "$DIR/src" "$1" "$2" --outtype "${3:-bf16}"
  ;;
serve)
  model=$1; port=$2; shift 2
  exec "$DIR/build/bin/llama-server" -m "$model" --host 127.0.0.1 --port "$port" \
       -t "$(nproc)" --no-webui "$@"
  ;;
*) sed -n '2,12p' "$0"; exit 2 ;;
esac
