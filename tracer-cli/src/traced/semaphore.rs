//! A USDT semaphore in a traced process's memory, raised and lowered by tracer itself
//! (`--allocator auto`): PyTorch's allocator sites run only while their semaphore is above
//! zero, so raising it in one process arms its sites there and nowhere else, without making or
//! removing a uprobe (each removal costs the kernel a grace period, about 0.1 s).
//!
//! Only processes tracer traces (they made CUDA calls through a probed library) are written,
//! through `/proc/PID/mem` and only at the two bytes of a semaphore of a library the process
//! maps writable, found by the file's device and inode.

use std::{
    fs::{File, OpenOptions},
    os::unix::fs::{FileExt as _, OpenOptionsExt as _},
};

use anyhow::{anyhow, Context as _, Result};

use super::maps;

/// Where a semaphore (at file offset `file_offset` of the library `(dev, inode)`) lies in
/// `pid`'s memory: in the library's writable mapping that holds that offset.
pub fn address(
    pid: u32,
    mappings: &[maps::Mapping],
    (dev, inode): (u64, u64),
    file_offset: u64,
) -> Result<u64> {
    mappings
        .iter()
        .find(|m| {
            m.writable
                && (m.dev, m.inode) == (dev, inode)
                && m.offset <= file_offset
                && file_offset + 2 <= m.offset + (m.end - m.start)
        })
        .map(|m| m.start + (file_offset - m.offset))
        .ok_or_else(|| {
            anyhow!("process {pid} maps no writable part of the library holding the semaphore at file offset {file_offset:#x}")
        })
}

/// A process's memory, open for the semaphores' two bytes.
pub struct Memory {
    pid: u32,
    file: File,
}

impl Memory {
    pub fn open(pid: u32) -> Result<Memory> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(format!("/proc/{pid}/mem"))
            .with_context(|| format!("open the memory of process {pid}"))?;
        Ok(Memory { pid, file })
    }

    /// Adds `delta` to the u16 at `addr` (not below 0 nor past u16::MAX); its value after.
    pub fn adjust(&self, addr: u64, delta: i32) -> Result<u16> {
        let mut b = [0u8; 2];
        self.file
            .read_exact_at(&mut b, addr)
            .with_context(|| format!("read the semaphore at {addr:#x} of process {}", self.pid))?;
        let now = u16::from_ne_bytes(b);
        let new = (i32::from(now) + delta).clamp(0, i32::from(u16::MAX)) as u16;
        self.file
            .write_all_at(&new.to_ne_bytes(), addr)
            .with_context(|| format!("write the semaphore at {addr:#x} of process {}", self.pid))?;
        Ok(new)
    }
}
