//! Where the database lives and who owns it: under sudo, the invoking user (SUDO_USER), so that
//! `tracer explain` and `tracer query` work afterwards without sudo.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};
use nix::unistd::{chown, Gid, Uid, User};

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

/// Creates the database's directory, giving each directory it creates to `owner`.
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
        std::fs::create_dir(dir).with_context(|| format!("create directory {}", dir.display()))?;
        if let Some((uid, gid)) = owner {
            chown(dir, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
                .with_context(|| format!("give directory {} to uid {uid}", dir.display()))?;
        }
    }
    Ok(())
}

/// chmod 0600 (a trace shows what the user's programs do), and chown to `owner` if given.
pub fn make_private(file: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    if let Some((uid, gid)) = owner {
        chown(file, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))
            .with_context(|| format!("give {} to uid {uid}", file.display()))?;
    }
    std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600))
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
