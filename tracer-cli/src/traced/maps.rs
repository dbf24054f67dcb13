//! A process's file mappings (/proc/PID/maps): where its libraries are loaded, to find an
//! interpreter's state and to turn a native address into (file, offset) that stays resolvable
//! after the process exits.

use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// File offset of `start`.
    pub offset: u64,
    pub executable: bool,
    pub writable: bool,
    pub path: PathBuf,
    /// The file was deleted (or replaced) since it was mapped.
    pub deleted: bool,
    /// The file's device (as stat's st_dev) and inode.
    pub dev: u64,
    pub inode: u64,
}

/// Parses one maps line: "start-end perms offset dev inode   path". Anonymous mappings and
/// pseudo-files ([heap], [vdso]) have no path and are skipped.
pub(crate) fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let dev = fields.next()?;
    let inode = fields.next()?;
    let path = fields.next()?.trim_start();
    if !path.starts_with('/') {
        return None;
    }
    let (start, end) = range.split_once('-')?;
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        offset: u64::from_str_radix(offset, 16).ok()?,
        executable: perms.as_bytes().get(2) == Some(&b'x'),
        writable: perms.as_bytes().get(1) == Some(&b'w'),
        path: PathBuf::from(path.strip_suffix(" (deleted)").unwrap_or(path)),
        deleted: path.ends_with(" (deleted)"),
        dev: {
            let (major, minor) = dev.split_once(':')?;
            libc::makedev(
                u32::from_str_radix(major, 16).ok()?,
                u32::from_str_radix(minor, 16).ok()?,
            )
        },
        inode: inode.parse().ok()?,
    })
}

/// Whether the process maps one of `files` ((dev, inode) pairs): it uses a probed library.
pub fn maps_any(pid: u32, files: &std::collections::HashSet<(u64, u64)>) -> bool {
    read(pid).is_ok_and(|maps| maps.iter().any(|m| files.contains(&(m.dev, m.inode))))
}

pub fn read(pid: u32) -> std::io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    Ok(text.lines().filter_map(parse_line).collect())
}

/// A mapped file's path as this process can open it: the path itself when it names the same
/// file here (it stays valid after the process exits), else through the process's root (a
/// file in another mount namespace, valid while the process lives).
pub fn path_in(pid: u32, path: &Path) -> PathBuf {
    use std::os::unix::fs::MetadataExt as _;
    let inside =
        PathBuf::from(format!("/proc/{pid}/root")).join(path.strip_prefix("/").unwrap_or(path));
    match (std::fs::metadata(path), std::fs::metadata(&inside)) {
        (Ok(here), Ok(there)) if (here.dev(), here.ino()) == (there.dev(), there.ino()) => {
            path.to_owned()
        }
        (_, Ok(_)) => inside,
        _ => path.to_owned(),
    }
}

/// Where this process can open the file of mapping `m` of `pid`: its path here when that names
/// the very file mapped (same device and inode: it stays valid after the process exits), else
/// through the process's root (valid while the process lives).
pub fn open_path(pid: u32, m: &Mapping) -> PathBuf {
    use std::os::unix::fs::MetadataExt as _;
    if let Ok(here) = std::fs::metadata(&m.path) {
        if (here.dev(), here.ino()) == (m.dev, m.inode) {
            return m.path.clone();
        }
    }
    path_in(pid, &m.path)
}

/// The executable mapping holding `addr`, and the file offset of `addr` in it.
pub fn locate(maps: &[Mapping], addr: u64) -> Option<(&Mapping, u64)> {
    let m = maps
        .iter()
        .find(|m| m.executable && addr >= m.start && addr < m.end)?;
    Some((m, addr - m.start + m.offset))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_file_mappings_only() {
        let text = "7f00a000-7f00c000 r-xp 00002000 08:01 1234   /usr/lib/libcudart.so.12\n\
                    7f00c000-7f00d000 rw-p 00000000 00:00 0 \n\
                    7ffd0000-7ffd2000 r-xp 00000000 00:00 0   [vdso]\n\
                    55550000-55551000 r-xp 00001000 08:01 99   /tmp/a b (deleted)";
        let maps: Vec<Mapping> = text.lines().filter_map(parse_line).collect();
        assert_eq!(maps.len(), 2);
        assert_eq!(maps[0].path, PathBuf::from("/usr/lib/libcudart.so.12"));
        assert!(maps[0].executable);
        assert_eq!(maps[1].path, PathBuf::from("/tmp/a b"));
        assert!(maps[1].deleted && !maps[0].deleted);
        assert_eq!((maps[0].dev, maps[0].inode), (libc::makedev(8, 1), 1234));
        let (m, off) = locate(&maps, 0x7f00a010).unwrap();
        assert_eq!((m.start, off), (0x7f00a000, 0x2010));
        assert!(locate(&maps, 0x7f00c010).is_none());
    }
}
