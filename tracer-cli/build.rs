use std::path::PathBuf;

use anyhow::{anyhow, Context as _};
use aya_build::{Package, Toolchain};

/// Builds the eBPF object (tracer-ebpf) with the nightly toolchain; the binary embeds it.
fn main() -> anyhow::Result<()> {
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR not set")?;
    let ebpf_dir = PathBuf::from(manifest_dir).join("..").join("tracer-ebpf");
    let ebpf_dir = ebpf_dir
        .canonicalize()
        .with_context(|| format!("find the eBPF crate at {}", ebpf_dir.display()))?;
    let root_dir = ebpf_dir
        .to_str()
        .ok_or_else(|| anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    aya_build::build_ebpf(
        [Package {
            name: "tracer-ebpf",
            root_dir,
            ..Default::default()
        }],
        Toolchain::default(),
    )
}
