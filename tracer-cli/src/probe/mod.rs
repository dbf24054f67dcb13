//! Probing: what to attach and where. `discover` finds the CUDA libraries (mapped by processes,
//! installed, statically linked) and the libraries holding PyTorch's probes; `usdt` reads their
//! notes; `attach` loads the eBPF object and attaches its programs (`multi` loads the uprobe
//! programs for uprobe_multi links and makes them; `perf` makes the uprobe perf events and
//! links of kernels without those); `privileges` says whether this process
//! may; `libwatch` hears in the kernel of each library a process opens, `btf` reading the
//! kernel structure offsets it needs, `tracefs` the tracepoints' field offsets; `release` removes them without making anyone wait for the kernel; `stage` empties the
//! kernel programs' per-CPU stages of call events into the ring; `check` proves that tracing
//! works on this machine.

pub mod attach;
mod btf;
pub mod check;
pub mod discover;
pub mod libwatch;
mod multi;
mod perf;
pub mod privileges;
mod release;
pub mod stage;
mod tracefs;
pub mod usdt;
