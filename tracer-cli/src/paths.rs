//! Where the database lives and who owns it: under sudo, the invoking user (SUDO_USER), so that
//! `tracer explain` and `tracer query` work afterwards without sudo.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use nix::unistd::{Gid, Uid, User};

pub const DB_ENV: &str = "TRACER_DB";

/// The user tracer acts for: SUDO_UID/SUDO_GID when root was reached through sudo.
pub struct Invoker {
    pub home: Option<PathBuf>,
    /// Set when files must be handed to this uid/gid (we are root on someone's behalf).
    pub owner: Option<(u32, u32)>,
}

pub fn invoker() -> Invoker {
    let euid = Uid::effective();
    if euid.is_root() {
        let sudo_uid = std::env::var("SUDO_UID")
            .ok()
            .and_then(|v| v.parse::<u32>().ok());
        let sudo_gid = std::env::var("SUDO_GID")
            .ok()
            .and_then(|v| v.parse::<u32>().ok());
        if let (Some(uid), Some(gid)) = (sudo_uid, sudo_gid) {
            if uid != 0 {
                let home = User::from_uid(Uid::from_raw(uid))
                    .ok()
                    .flatten()
                    .map(|u| u.dir);
                return Invoker {
                    home,
                    owner: Some((uid, gid)),
                };
            }
        }
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .or_else(|| User::from_uid(euid).ok().flatten().map(|u| u.dir));
    Invoker { home, owner: None }
}

/// --db, else TRACER_DB (clap fills both into `explicit`), else $XDG_DATA_HOME/tracer/tracer.db
/// (for sudo: the invoking user's ~/.local/share/tracer/tracer.db).
pub fn db_path(explicit: Option<&Path>, who: &Invoker) -> Result<PathBuf> {
    if let Some(p) = explicit {
        return Ok(p.to_owned());
    }
    let xdg = if who.owner.is_none() {
        std::env::var_os("XDG_DATA_HOME").map(PathBuf::from)
    } else {
        None
    };
    let base = match (xdg, &who.home) {
        (Some(x), _) if x.is_absolute() => x,
        (_, Some(home)) => home.join(".local").join("share"),
        _ => anyhow::bail!(
            "cannot find a home directory for the database: pass --db FILE or set TRACER_DB"
        ),
    };
    Ok(base.join("tracer").join("tracer.db"))
}

/// While alive, the calling thread creates and opens files with `owner`'s file-system ids
/// (setfsuid/setfsgid act on one thread): the kernel checks every path as that user would, so a
/// symlink or a directory they planted cannot lead root's writes anywhere they could not write
/// themselves, and what is created is theirs. Dropping it gives the thread root's ids back.
/// Without an owner (root on its own behalf) it changes nothing.
#[must_use = "the user's ids last only as long as the guard"]
pub struct ActingAs {
    previous: Option<(Uid, Gid)>,
}

pub fn act_as(owner: Option<(u32, u32)>) -> ActingAs {
    let previous = owner.map(|(uid, gid)| {
        // The group first: changing the fs uid from 0 drops the capabilities that would allow
        // changing the group afterwards.
        let gid = nix::unistd::setfsgid(Gid::from_raw(gid));
        let uid = nix::unistd::setfsuid(Uid::from_raw(uid));
        (uid, gid)
    });
    ActingAs { previous }
}

impl Drop for ActingAs {
    fn drop(&mut self) {
        if let Some((uid, gid)) = self.previous {
            nix::unistd::setfsuid(uid);
            nix::unistd::setfsgid(gid);
        }
    }
}

/// The one directory a server writes in (`tracer mcp --export-dir`): opened once, as the
/// invoking user and without following a link; each file is made new in it through that
/// descriptor (never replacing one, never through a link, never elsewhere), as that user.
pub struct ExportDir {
    dir: std::os::fd::OwnedFd,
    path: PathBuf,
    owner: Option<(u32, u32)>,
}

impl ExportDir {
    pub fn open(path: &Path, who: &Invoker) -> Result<ExportDir> {
        use nix::fcntl::{open, OFlag};
        let _as_user = act_as(who.owner);
        let dir = open(
            path,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .map_err(|e| {
            crate::exit::user_error(format!(
                "export directory {}: {e}: give an existing directory (not a link) you can write",
                path.display()
            ))
        })?;
        Ok(ExportDir {
            dir,
            path: path.to_owned(),
            owner: who.owner,
        })
    }

    /// Writes `bytes` as a new file `name` (letters, digits, '-', '_' and '.', not leading)
    /// in the directory; returns its path, or None where a file of that name is there already.
    pub fn write_new(&self, name: &str, bytes: &[u8]) -> Result<Option<PathBuf>> {
        use nix::fcntl::{openat, OFlag};
        use std::io::Write as _;
        let plain = !name.is_empty()
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !plain {
            anyhow::bail!("{name:?} is not a plain file name");
        }
        let _as_user = act_as(self.owner);
        let fd = match openat(
            &self.dir,
            name,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        ) {
            Err(nix::errno::Errno::EEXIST) => return Ok(None),
            other => other,
        }
        .map_err(|e| {
            crate::exit::user_error(format!("create {} in {}: {e}", name, self.path.display()))
        })?;
        let mut file = std::fs::File::from(fd);
        let written = file.write_all(bytes).and_then(|()| file.sync_all());
        if let Err(e) = written {
            // No partial file left behind.
            let _ = nix::unistd::unlinkat(&self.dir, name, nix::unistd::UnlinkatFlags::NoRemoveDir);
            return Err(anyhow::Error::new(e).context(format!(
                "write {} in {}",
                name,
                self.path.display()
            )));
        }
        Ok(Some(self.path.join(name)))
    }
}

/// An output file being written (`tracer report -o`, `tracer export -o`): a private temporary
/// file beside it, created as the invoking user (their file-system ids: under sudo, root
/// writes only where they could) and never through a link, renamed over the path when
/// [`Output::commit`] is called, removed otherwise. A failed run leaves the previous file and
/// no partial one.
pub struct Output {
    file: std::fs::File,
    temporary: PathBuf,
    path: PathBuf,
    owner: Option<(u32, u32)>,
    committed: bool,
}

/// Opens an [`Output`] for `path`; a symbolic link there is refused, not replaced.
pub fn create_output(path: &Path, who: &Invoker) -> Result<Output> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let cannot = |e: &dyn std::fmt::Display| {
        let who = who
            .owner
            .map_or_else(String::new, |(uid, _)| format!(" as uid {uid}"));
        crate::exit::user_error(format!(
            "cannot write {}{who}: {e}: pick a writable path with -o",
            path.display()
        ))
    };
    let _as_user = act_as(who.owner);
    if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(cannot(
            &"it is a symbolic link (tracer does not follow or replace links at its output)",
        ));
    }
    let name = path
        .file_name()
        .ok_or_else(|| cannot(&"it names no file"))?;
    let mut temporary_name = std::ffi::OsString::from(".");
    temporary_name.push(name);
    temporary_name.push(format!(".tracer-{}", std::process::id()));
    let temporary = path.with_file_name(temporary_name);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&temporary)
        .map_err(|e| cannot(&e))?;
    Ok(Output {
        file,
        temporary,
        path: path.to_owned(),
        owner: who.owner,
        committed: false,
    })
}

impl Output {
    /// The file is complete: it takes the path's place (a rename, as the user).
    pub fn commit(mut self) -> Result<()> {
        self.file
            .sync_all()
            .with_context(|| format!("writing {}", self.path.display()))?;
        let _as_user = act_as(self.owner);
        std::fs::rename(&self.temporary, &self.path).map_err(|e| {
            crate::exit::user_error(format!(
                "cannot write {}: {e}: pick a writable path with -o",
                self.path.display()
            ))
        })?;
        self.committed = true;
        Ok(())
    }
}

impl std::io::Write for Output {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.file.write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if !self.committed {
            let _as_user = act_as(self.owner);
            let _ = std::fs::remove_file(&self.temporary);
        }
    }
}

/// Refuses a database path that is a symbolic link (tracer never follows one to its database,
/// its -wal or its -shm).
pub fn refuse_links(db: &Path) -> Result<()> {
    for suffix in ["", "-wal", "-shm"] {
        let mut name = db.as_os_str().to_owned();
        name.push(suffix);
        let file = PathBuf::from(name);
        if std::fs::symlink_metadata(&file).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(crate::exit::user_error(format!(
                "{} is a symbolic link: tracer does not follow links to its database; pass the real path with --db",
                file.display()
            )));
        }
    }
    Ok(())
}

/// Creates the database's directory as `owner` (call it inside [`act_as`]: each directory made
/// is then theirs, and only where they could make it).
pub fn create_parent_dirs(db: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    let Some(parent) = db.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    let mut missing = Vec::new();
    let mut dir = parent;
    while !dir.exists() {
        missing.push(dir.to_owned());
        match dir.parent() {
            Some(p) => dir = p,
            None => break,
        }
    }
    for dir in missing.iter().rev() {
        std::fs::create_dir(dir).map_err(|e| {
            let who = owner.map_or_else(String::new, |(uid, _)| format!(" as uid {uid}"));
            crate::exit::user_error(format!(
                "create directory {}{who}: {e}: choose a --db the invoking user can write",
                dir.display()
            ))
        })?;
    }
    Ok(())
}

/// Makes a database file private (0600: a trace shows what the user's programs do) through a
/// descriptor opened without following links; the file must be a regular file owned by the
/// one it is for (`owner`, else this process's user). Call it inside [`act_as`]. A file that
/// does not exist is left alone.
/// Creates `file` empty with mode 0600 unless it exists (as the current file-system ids; a link
/// in its place is refused).
pub fn create_private(file: &Path) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(file)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(crate::exit::user_error(format!(
            "create {}: {e}: pass a --db in a folder the invoking user can write",
            file.display()
        ))),
    }
}

pub fn make_private(file: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _};
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(file);
    let handle = match opened {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => {
            return Err(crate::exit::user_error(format!(
                "open {} (without following links): {e}: pass the real path of a database the invoking user can write with --db",
                file.display()
            )))
        }
    };
    let meta = handle
        .metadata()
        .with_context(|| format!("inspect {}", file.display()))?;
    let expected = owner.map_or_else(|| Uid::effective().as_raw(), |(uid, _)| uid);
    if !meta.file_type().is_file() || meta.uid() != expected {
        return Err(crate::exit::user_error(format!(
            "{} is not a regular file of uid {expected} (it is uid {}'s): remove it, or choose another --db",
            file.display(),
            meta.uid()
        )));
    }
    handle
        .set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 0600 {}", file.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_path_is_in_the_invoking_users_home() {
        let who = Invoker {
            home: Some(PathBuf::from("/home/alice")),
            owner: Some((1000, 1000)),
        };
        assert_eq!(
            db_path(None, &who).unwrap(),
            PathBuf::from("/home/alice/.local/share/tracer/tracer.db")
        );
        assert_eq!(
            db_path(Some(Path::new("/x/t.db")), &who).unwrap(),
            PathBuf::from("/x/t.db")
        );
        let nobody = Invoker {
            home: None,
            owner: None,
        };
        assert!(db_path(None, &nobody)
            .unwrap_err()
            .to_string()
            .contains("--db"));
    }

    #[test]
    fn creates_missing_directories() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("a/b/t.db");
        create_parent_dirs(&db, None).unwrap();
        assert!(dir.path().join("a/b").is_dir());
    }
}
