//! Folders and files made below the dump root: each opened through the one above without
//! following a link, owned by the process's user, new files made exclusively.

use std::{io::Write as _, os::fd::OwnedFd};

use anyhow::{anyhow, Context as _, Result};
use nix::{
    fcntl::{openat, OFlag},
    sys::stat::{fstat, mkdirat, Mode},
};

/// The folder `name` in `parent`, made (0700) or, unless `fresh`, opened where it is, never
/// through a link, and refused unless it is `uid`'s.
pub(super) fn subdir(
    parent: std::os::fd::BorrowedFd<'_>,
    name: &str,
    uid: u32,
    fresh: bool,
) -> Result<OwnedFd> {
    match mkdirat(parent, name, Mode::from_bits_truncate(0o700)) {
        Ok(()) => {}
        Err(nix::errno::Errno::EEXIST) if !fresh => {}
        Err(e) => return Err(anyhow!("make the folder {name}: {e}")),
    }
    let fd = openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| anyhow!("open the folder {name} (no link followed): {e}"))?;
    let st = fstat(&fd).map_err(|e| anyhow!("read the folder {name}: {e}"))?;
    if st.st_uid != uid {
        return Err(anyhow!(
            "the folder {name} belongs to uid {}, not the process's user {uid}",
            st.st_uid
        ));
    }
    Ok(fd)
}

/// A new file `name` in `dir` (0600, exclusive, no link followed) holding `bytes`.
pub(super) fn write_new(dir: std::os::fd::BorrowedFd<'_>, name: &str, bytes: &[u8]) -> Result<()> {
    let fd = openat(
        dir,
        name,
        OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::from_bits_truncate(0o600),
    )
    .map_err(|e| anyhow!("create {name}: {e}"))?;
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("write {name}"))
}
