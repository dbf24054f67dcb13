#!/usr/bin/env bash
# Installs what is missing, then runs `tracer demo incident`: a training-like workload on the
# simulated CUDA runtime (no GPU needed) dies with "CUDA out of memory" while memory is reported
# free; tracer records every call (live with eBPF as root, else from the runtime's own log) and
# explains why.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/as-user.sh
bash scripts/setup.sh
# Built as the invoking user under sudo; the demo itself builds the simulated runtime as them too.
as_user cargo build --locked --release -p tracer-cli >&2
exec target/release/tracer demo incident "$@"
