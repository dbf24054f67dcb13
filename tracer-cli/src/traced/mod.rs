//! What is read from traced processes and their files, as root: safely (`safe_file`: a file a
//! user can change is read bounded or copied, never mapped), their ELF files (`elf`), memory
//! maps (`maps`) and the kernel's side band of every mapping made (`mappings`), /proc metadata
//! (`procinfo`), interpreters and their frames (`python`), call sites (`sites`), pods
//! (`pods`) and, through NVIDIA's management library, who holds each GPU (`nvml`). Nothing here
//! keeps a recording's state.

pub mod elf;
pub mod mappings;
pub mod maps;
pub mod nvml;
pub mod pods;
pub mod procinfo;
pub mod python;
pub mod safe_file;
pub mod semaphore;
pub mod sites;
