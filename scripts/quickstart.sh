#!/usr/bin/env bash
# Installs what is missing, then runs `tracer demo incident`: a training-like workload on the
# simulated CUDA runtime (no GPU needed) dies with "CUDA out of memory" while memory is reported
# free; tracer records every call (live with eBPF as root, else from the runtime's own log) and
# explains why.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
cargo build --locked --release -p tracer-cli >&2
exec target/release/tracer demo incident "$@"
