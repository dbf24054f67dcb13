//! Opening the database: version and sanity checks, migrations, the files' owner and modes,
//! and how much room it takes on disk.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use rusqlite::{params, Connection, OpenFlags};
use tracer_common::Op;

use super::*;
use crate::exit::user_error;

/// How long a statement waits for another connection's lock before it fails.
pub(super) const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Store {
    /// Opens the database at `path`. ReadWrite creates it (and migrates an older one);
    /// ReadOnly requires it to exist. A database from a newer tracer, a corrupt file or another
    /// program's database is refused before anything is written.
    pub fn open(path: &Path, access: Access) -> Result<Store> {
        let exists = path.exists();
        if access == Access::ReadOnly && !exists {
            return Err(user_error(format!(
                "database {} does not exist: record one with `sudo tracer trace`, or pass --db FILE / TRACER_DB",
                path.display()
            )));
        }
        if exists {
            check_readable(path, access)?;
        }
        let flags = match access {
            Access::ReadWrite => OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_CREATE,
            Access::ReadOnly => OpenFlags::SQLITE_OPEN_READ_ONLY,
        } | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| user_error(format!("cannot open database {}: {e}", path.display())))?;
        counted::opened();
        // A WAL database is read through its -shm file, which needs write access.
        if access == Access::ReadOnly {
            if let Err(e) = conn.query_row("SELECT count(*) FROM sqlite_master", [], |r| {
                r.get::<_, i64>(0)
            }) {
                if matches!(
                    e.sqlite_error_code(),
                    Some(rusqlite::ErrorCode::ReadOnly | rusqlite::ErrorCode::CannotOpen)
                ) {
                    return Err(user_error(format!(
                        "cannot read database {}: {e}; reading needs write access to it and its directory                          (WAL mode): run as its owner, or copy it somewhere writable",
                        path.display()
                    )));
                }
            }
        }
        conn.busy_timeout(BUSY_TIMEOUT)
            .with_context(|| format!("set busy timeout on {}", path.display()))?;
        tensor_events::register(&conn)
            .with_context(|| format!("register tensor_events on {}", path.display()))?;
        offcpu_intervals::register(&conn)
            .with_context(|| format!("register offcpu_intervals on {}", path.display()))?;
        let mut store = Store {
            conn,
            path: path.to_owned(),
        };
        let version = store.user_version()?;
        if version > SCHEMA_VERSION {
            return Err(user_error(format!(
                "database {} was written by a newer tracer (schema version {version}; this tracer \
                 reads up to {SCHEMA_VERSION}): upgrade tracer, or use another file with --db",
                path.display()
            )));
        }
        if version == 0 && store.has_foreign_tables()? {
            return Err(user_error(format!(
                "{} is an SQLite database of another program (it has tables but no tracer schema): \
                 pass a new file with --db",
                path.display()
            )));
        }
        match access {
            Access::ReadWrite => store.prepare_for_writing(version)?,
            Access::ReadOnly if version == 0 => {
                return Err(user_error(format!(
                    "database {} is empty (no trace was recorded into it): record one with `sudo tracer trace --db {}`",
                    path.display(),
                    path.display()
                )));
            }
            Access::ReadOnly if version < READABLE_FROM => {
                return Err(user_error(format!(
                    "database {} has schema version {version}; open it once with a writing command \
                     (e.g. `tracer trace --db {}`) to migrate it to {SCHEMA_VERSION}",
                    path.display(),
                    path.display()
                )));
            }
            Access::ReadOnly => {}
        }
        Ok(store)
    }

    pub fn conn(&self) -> &Connection {
        &self.conn
    }

    fn user_version(&self) -> Result<i64> {
        self.conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(|e| corrupt(&self.path, e))
    }

    fn has_foreign_tables(&self) -> Result<bool> {
        let n: i64 = self
            .conn
            .query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get(0))
            .map_err(|e| corrupt(&self.path, e))?;
        Ok(n > 0)
    }

    fn prepare_for_writing(&mut self, version: i64) -> Result<()> {
        let path = self.path.display().to_string();
        if version == 0 {
            // Must precede the first table: lets --max-db give pages back to the file system.
            self.conn
                .execute_batch("PRAGMA auto_vacuum = INCREMENTAL")
                .with_context(|| format!("set auto_vacuum on {path}"))?;
        }
        self.conn
            .execute_batch(
                "PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;
                 PRAGMA journal_size_limit = 16777216;",
            )
            .map_err(|e| corrupt(&self.path, e))?;
        let tx = self
            .conn
            .transaction()
            .with_context(|| format!("begin migration of {path}"))?;
        for (from, sql) in schema::MIGRATIONS.iter().enumerate().skip(version as usize) {
            tx.execute_batch(sql)
                .with_context(|| format!("migrate {path} from schema {from} to {}", from + 1))?;
        }
        tx.pragma_update(None, "user_version", SCHEMA_VERSION)
            .with_context(|| format!("set schema version of {path}"))?;
        {
            let mut insert = tx.prepare(
                "INSERT OR IGNORE INTO ops (id, name, library, class) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for op in Op::ALL {
                let spec = op.spec();
                insert.execute(params![
                    op as u32,
                    op.name(),
                    spec.library.name(),
                    class_name(spec.class)
                ])?;
            }
        }
        tx.commit()
            .with_context(|| format!("commit migration of {path}"))?;
        Ok(())
    }
}

impl Store {
    /// Bytes the database uses, not counting free pages it keeps for reuse.
    pub fn used_bytes(&self) -> Result<u64> {
        let (pages, free, size): (i64, i64, i64) = self.conn.query_row(
            "SELECT (SELECT page_count FROM pragma_page_count), (SELECT freelist_count FROM pragma_freelist_count),
                    (SELECT page_size FROM pragma_page_size)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        Ok(((pages - free).max(0) * size) as u64)
    }

    /// Keeps the write-ahead log to a small share of --max-db: a checkpoint once it holds an
    /// eighth of it (at least 64 pages).
    pub fn limit_log(&self, max_bytes: u64) -> Result<()> {
        let page: i64 = self.conn.query_row("PRAGMA page_size", [], |r| r.get(0))?;
        let pages = (max_bytes as i64 / 8 / page.max(512)).max(64);
        self.conn
            .pragma_update(None, "wal_autocheckpoint", pages)
            .with_context(|| format!("set the log's checkpoint of {}", self.path.display()))?;
        Ok(())
    }

    /// Bytes of the write-ahead log beside the database.
    pub fn wal_bytes(&self) -> u64 {
        let mut name = self.path.clone().into_os_string();
        name.push("-wal");
        std::fs::symlink_metadata(name).map_or(0, |m| m.len())
    }

    /// What --max-db counts: the database file (its pages, free ones included) and its
    /// write-ahead log.
    pub fn footprint(&self) -> Result<u64> {
        let (pages, size): (i64, i64) = self.conn.query_row(
            "SELECT (SELECT page_count FROM pragma_page_count), (SELECT page_size FROM pragma_page_size)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        Ok((pages.max(0) * size) as u64 + self.wal_bytes())
    }

    /// Opens (creating it if needed) the database tracer writes, as `owner` (the user who ran
    /// sudo) would: a path that is a link is refused, the folders and files are created with
    /// their file-system ids (so only where they could create them, and theirs), and the files
    /// are made private through descriptors that follow no link, before SQLite opens them (the
    /// log and the shared memory it creates later take the database's mode and owner).
    pub fn open_writable(path: &Path, owner: Option<(u32, u32)>) -> Result<Store> {
        crate::paths::refuse_links(path)?;
        let _as_user = crate::paths::act_as(owner);
        crate::paths::create_parent_dirs(path, owner)?;
        secure_files(path, owner)?;
        let store = Store::open(path, Access::ReadWrite).map_err(|e| match owner {
            Some((uid, _)) => user_error(format!(
                "{e:#} (opened as uid {uid}, who ran sudo: choose a --db the invoking user can write)"
            )),
            None => e,
        })?;
        Ok(store)
    }
}

/// Creates the database file private (0600), or makes the database's files private, through
/// descriptors opened without following links, as `owner`; a file that is not a regular file
/// of theirs is refused, never chown'ed. Only before SQLite opens them: closing any descriptor
/// of a file drops every POSIX lock the process holds on it, SQLite's included, and a reader
/// then believing itself alone truncates the shared memory the writer has mapped (SIGBUS).
fn secure_files(path: &Path, owner: Option<(u32, u32)>) -> Result<()> {
    crate::paths::create_private(path)?;
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.to_owned().into_os_string();
        name.push(suffix);
        crate::paths::make_private(&PathBuf::from(name), owner)?;
    }
    Ok(())
}

fn check_readable(path: &Path, access: Access) -> Result<()> {
    let meta = std::fs::metadata(path)
        .map_err(|e| user_error(format!("cannot access database {}: {e}", path.display())))?;
    if meta.is_dir() {
        return Err(user_error(format!(
            "database {} is a directory: pass a file with --db",
            path.display()
        )));
    }
    let file = match access {
        Access::ReadOnly => std::fs::File::open(path),
        Access::ReadWrite => std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path),
    };
    if let Err(e) = file {
        use std::os::unix::fs::MetadataExt as _;
        return Err(user_error(format!(
            "cannot {} database {}: {e} (owner uid {}, mode {:o}): run as its owner, or pass another file with --db",
            if access == Access::ReadOnly { "read" } else { "write" },
            path.display(),
            meta.uid(),
            meta.mode() & 0o777
        )));
    }
    Ok(())
}

fn corrupt(path: &Path, e: rusqlite::Error) -> anyhow::Error {
    user_error(format!(
        "{} is not a usable tracer database ({e}): it is corrupt or not SQLite; pass another file with --db",
        path.display()
    ))
}
