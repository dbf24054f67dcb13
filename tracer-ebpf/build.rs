use which::which;

/// The eBPF crate links with bpf-linker; rebuild when it changes.
fn main() {
    match which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(err) => println!("cargo:warning=bpf-linker not found ({err}): run scripts/setup.sh"),
    }
}
