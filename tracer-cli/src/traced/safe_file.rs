//! Reading files a traced process uses, as root, without letting their owner crash tracer. A
//! file mapped into memory and truncated by someone raises SIGBUS at the next read of a page
//! past its new end: only files that no one but root can change are mapped. Others are read
//! through bounded reads (a truncation is then an error for that file), or, for the
//! symbolizer that maps files itself, copied into a private folder first.

use std::{
    collections::HashMap,
    fs::{File, Metadata},
    os::unix::fs::{MetadataExt as _, OpenOptionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

/// Whether only root can change the file's bytes: a regular file owned by root that neither its
/// group nor others may write.
pub fn immutable_to_users(meta: &Metadata) -> bool {
    meta.file_type().is_file() && meta.uid() == 0 && meta.mode() & 0o022 == 0
}

/// Opens a file to read it without ever blocking (a FIFO planted in place of a library must not
/// hang tracer); what it is is checked on the descriptor.
pub fn open(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .with_context(|| format!("open {}", path.display()))
}

/// A file's bytes to parse: mapped when only root can change them, else read on demand.
pub enum Bytes {
    Mapped(memmap2::Mmap),
    Read(object::read::ReadCache<File>),
}

/// The file at `path`, ready to parse (`path` may pass through /proc/PID/root).
pub fn bytes(path: &Path) -> Result<Bytes> {
    let file = open(path)?;
    let meta = file
        .metadata()
        .with_context(|| format!("inspect {}", path.display()))?;
    anyhow::ensure!(
        meta.file_type().is_file(),
        "{} is not a regular file",
        path.display()
    );
    if immutable_to_users(&meta) {
        // SAFETY: a private read-only map of a file only root can change (tracer runs as root
        // and does not change it), so it cannot shrink under the map.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("map {}", path.display()))?;
        Ok(Bytes::Mapped(map))
    } else {
        Ok(Bytes::Read(object::read::ReadCache::new(file)))
    }
}

/// Copies of files their owners can change, for a reader that maps what it reads (blazesym):
/// one copy per file version, keyed by device, inode, size and modification time, in a private
/// folder removed when this is dropped.
#[derive(Default)]
pub struct PrivateCopies {
    dir: Option<tempfile::TempDir>,
    copies: HashMap<(u64, u64, u64, i64, i64), PathBuf>,
}

/// Files larger than this are not copied (their frames stay unsymbolized rather than risk a
/// crash or fill the disk).
pub const MAX_COPY_BYTES: u64 = 4 << 30;

impl PrivateCopies {
    /// A path to map `path` through: itself when only root can change it, else a private copy.
    pub fn mappable(&mut self, path: &Path) -> Result<PathBuf> {
        let mut file = open(path)?;
        let meta = file.metadata()?;
        if immutable_to_users(&meta) {
            return Ok(path.to_owned());
        }
        anyhow::ensure!(
            meta.file_type().is_file() && meta.len() <= MAX_COPY_BYTES,
            "{} is not a regular file of at most {MAX_COPY_BYTES} bytes",
            path.display()
        );
        let key = (
            meta.dev(),
            meta.ino(),
            meta.len(),
            meta.mtime(),
            meta.mtime_nsec(),
        );
        if let Some(copy) = self.copies.get(&key) {
            return Ok(copy.clone());
        }
        if self.dir.is_none() {
            self.dir = Some(
                tempfile::Builder::new()
                    .prefix("tracer-files-")
                    .tempdir()
                    .context("make a private folder for copies of user files")?,
            );
        }
        let dir = self
            .dir
            .as_ref()
            .map(|d| d.path().to_owned())
            .unwrap_or_default();
        let copy = dir.join(format!("{}-{}-{}", key.0, key.1, self.copies.len()));
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&copy)
            .with_context(|| format!("create {}", copy.display()))?;
        // Bounded: a file that grows while copied stops at the size seen.
        std::io::copy(&mut std::io::Read::take(&mut file, meta.len()), &mut out)
            .with_context(|| format!("copy {}", path.display()))?;
        self.copies.insert(key, copy.clone());
        Ok(copy)
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;

    #[test]
    fn a_file_its_owner_can_change_is_read_not_mapped_and_copied_for_mappers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lib.so");
        std::fs::write(&path, vec![7u8; 10_000]).unwrap();
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        assert!(matches!(bytes(&path).unwrap(), Bytes::Read(_)));
        let mut copies = PrivateCopies::default();
        let copy = copies.mappable(&path).unwrap();
        assert_ne!(copy, path);
        assert_eq!(std::fs::read(&copy).unwrap(), vec![7u8; 10_000]);
        // The same version is copied once; a changed file gets a new copy.
        assert_eq!(copies.mappable(&path).unwrap(), copy);
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"more")
            .unwrap();
        let again = copies.mappable(&path).unwrap();
        assert_ne!(again, copy);
        assert_eq!(std::fs::read(&again).unwrap().len(), 10_004);
        // A FIFO in place of a library is refused at once, never waited on.
        let fifo = dir.path().join("fifo.so");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        assert!(bytes(&fifo).is_err());
        assert!(copies.mappable(&fifo).is_err());
    }
}

#[cfg(test)]
pub(crate) mod truncation {
    use super::*;

    /// A copy of this test binary (an ELF file with symbols and notes) that anyone may change.
    pub(crate) fn writable_elf(dir: &Path) -> PathBuf {
        let lib = dir.join("libwritable.so");
        std::fs::copy("/proc/self/exe", &lib).unwrap();
        std::fs::set_permissions(&lib, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .unwrap();
        lib
    }

    /// Its owner cuts the file to `len` bytes.
    pub(crate) fn truncate(lib: &Path, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(lib)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    #[test]
    fn a_library_truncated_while_read_is_an_error_not_a_crash() {
        let dir = tempfile::tempdir().unwrap();
        let lib = writable_elf(dir.path());
        let held = bytes(&lib).unwrap();
        let Bytes::Read(cache) = &held else {
            panic!("a file others can write was mapped");
        };
        // Its owner truncates it while tracer holds it (elf.rs and probe/usdt.rs test their
        // readers alike): with a map, the next read of its pages would raise SIGBUS.
        truncate(&lib, 0);
        assert!(object::File::parse(cache).is_err());
        // Truncated half-way: still an error or a partial answer, never a signal.
        let lib = writable_elf(dir.path());
        let len = std::fs::metadata(&lib).unwrap().len();
        let half = bytes(&lib).unwrap();
        truncate(&lib, len / 2);
        if let Bytes::Read(cache) = &half {
            if let Ok(obj) = object::File::parse(cache) {
                use object::{Object as _, ObjectSymbol as _};
                let _ = obj.symbols().filter_map(|s| s.name().ok()).count();
            }
        }
    }
}
