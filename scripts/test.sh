#!/usr/bin/env bash
# Installs what is missing, then runs every test: unit tests (no root needed) and the end-to-end
# tests against real processes (root: BPF and uprobes; under CI=true they fail without it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# House rules first: formatting and lints (the eBPF crate is checked by its build).
cargo fmt --all --check
cargo clippy --locked --all-targets -- -D warnings
cargo test --locked "$@"
