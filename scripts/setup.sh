#!/usr/bin/env bash
# Installs what building tracer and its demo need, only what is missing; with --tests, also
# what only the tests use (Prometheus, Chromium, the Python tools they drive).
# Idempotent: on a machine that has everything it returns in well under a second.
set -euo pipefail

log() { printf 'setup: %s\n' "$*" >&2; }
need_root() { if [ "$(id -u)" -ne 0 ]; then log "installing $1 needs root: run as root or install it yourself"; exit 1; fi; }

apt_updated=0
apt_install() {
  need_root "$*"
  if [ "$apt_updated" -eq 0 ]; then
    log "apt-get update"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >/dev/null
    apt_updated=1
  fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# Rust: stable builds the user side, nightly + rust-src builds the eBPF object (-Z build-std=core).
# Under sudo these are the invoking user's own toolchain and tools (scripts/as-user.sh).
source "$(dirname "$0")/as-user.sh"
if ! as_user sh -c 'command -v cargo' >/dev/null 2>&1; then
  log "cargo not found: install rustup (https://rustup.rs) first"; exit 1
fi
if ! as_user rustup toolchain list | grep -q '^nightly'; then
  log "rustup toolchain install nightly"; as_user rustup toolchain install nightly --profile minimal
fi
if ! as_user rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
  log "rustup component add rust-src --toolchain nightly"; as_user rustup component add rust-src --toolchain nightly
fi

# bpf-linker against LLVM 22 (the nightly's LLVM); see shared/toolchain.md.
if ! as_user sh -c 'command -v bpf-linker || [ -x "$HOME/.cargo/bin/bpf-linker" ]' >/dev/null 2>&1; then
  [ -x /usr/lib/llvm-22/bin/llvm-config ] || apt_install llvm-22-dev
  log "cargo install bpf-linker (about a minute)"
  as_user env LLVM_PREFIX=/usr/lib/llvm-22 cargo install --locked bpf-linker --version 0.13.0 \
    --no-default-features --features llvm-22 >&2
fi

# Tests and demos: gcc builds the simulated CUDA runtime, python3 runs the demo workloads;
# bpftrace is the benchmark's peer.
command -v cc >/dev/null 2>&1 || apt_install gcc
command -v python3 >/dev/null 2>&1 || apt_install python3
command -v bpftrace >/dev/null 2>&1 || apt_install bpftrace
# sys/sdt.h: USDT test programs (the benchmark's USDT site, the USDT parser's tests).
[ -f /usr/include/x86_64-linux-gnu/sys/sdt.h ] || [ -f /usr/include/sys/sdt.h ] || apt_install systemtap-sdt-dev

# The real CUDA 12 runtime, from its PyPI wheel, for the real-runtime test.
real_dir="${TRACER_REAL_CUDART_DIR:-$HOME/.cache/tracer/cuda-runtime-cu12}"
if [ ! -f "$real_dir/libcudart.so.12" ]; then
  log "fetching nvidia-cuda-runtime-cu12 from PyPI into $real_dir"
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" 'nvidia-cuda-runtime-cu12==12.9.79' >&2
  mkdir -p "$real_dir"
  python3 - "$tmp" "$real_dir" <<'PY'
import sys, zipfile, glob, os
whl = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(whl) as z:
    data = z.read("nvidia/cuda_runtime/lib/libcudart.so.12")
with open(os.path.join(sys.argv[2], "libcudart.so.12"), "wb") as f:
    f.write(data)
PY
  rm -rf "$tmp"
fi

# What only the tests use (scripts/test.sh asks with --tests; the quick start's demo does not).
[ "${1:-}" = "--tests" ] || exit 0

# The fleet tests: a real Prometheus server and promtool (Debian's package; its service, which
# the package starts, is stopped: the tests run their own on loopback) ...
if ! command -v promtool >/dev/null 2>&1; then
  # Keep the package's service from starting while it installs (policy-rc.d 101: "not now").
  need_root prometheus
  policy_made=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_made=1
  fi
  apt_install --no-install-recommends prometheus || { [ "$policy_made" -eq 0 ] || rm -f /usr/sbin/policy-rc.d; exit 1; }
  [ "$policy_made" -eq 0 ] || rm -f /usr/sbin/policy-rc.d
  if command -v systemctl >/dev/null 2>&1; then systemctl disable --now prometheus >/dev/null 2>&1 || true; fi
fi
# ... and the Python tools the tests drive, in a folder of their own: the Kubernetes schemas
# (kubernetes-validate, PyYAML), Perfetto's own protos (perfetto) to decode the exported
# traces, a real MCP client (mcp) for `tracer mcp`, and selenium to drive headless Chromium.
pylib="${TRACER_PYLIB:-$HOME/.cache/tracer/pylib}"
pylib_ok=1
for module in kubernetes_validate yaml perfetto mcp selenium opentelemetry/proto; do
  [ -d "$pylib/$module" ] || pylib_ok=0
done
if [ "$pylib_ok" -eq 0 ]; then
  log "pip install kubernetes-validate PyYAML perfetto mcp selenium opentelemetry-proto into $pylib"
  python3 -m pip install -q --disable-pip-version-check --upgrade --target "$pylib" \
    'kubernetes-validate==1.37.0' 'PyYAML==6.0.3' 'perfetto==0.59.1' 'protobuf==7.36.2' \
    'mcp==2.3.0' 'selenium==4.51.0' 'opentelemetry-proto==1.45.2' >&2
fi
# PyTorch's real libc10.so (where its OutOfMemoryError is built) from the 2.11 wheel the GPU
# check ran and the newest, only those files of each wheel: the message probe's test.
torch_libs="${TRACER_TORCH_LIBS:-$HOME/.cache/tracer/torch-libs}"
for version in 2.11.0 2.15.0; do
  if [ ! -f "$torch_libs/$version/libc10.so" ] || [ ! -f "$torch_libs/$version/_memory_viz.py" ]; then
    log "fetch libc10.so, libc10_cuda.so and _memory_viz.py of torch $version from PyPI into $torch_libs/$version"
    python3 "$(dirname "$0")/torch_libs.py" "$version" "$torch_libs/$version.part"
    rm -rf "${torch_libs:?}/$version" && mv "$torch_libs/$version.part" "$torch_libs/$version"
  fi
done
# The HTML report's test opens it in headless Chromium (Debian's, with its WebDriver).
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  need_root chromium
  apt_install --no-install-recommends chromium chromium-driver
fi
