//! `--db`, shared by every subcommand that reads or writes the database.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use tracer_cli::paths::{self, Invoker};

#[derive(Debug, Args)]
pub struct DbArgs {
    /// The database (default: the invoking user's ~/.local/share/tracer/tracer.db, or TRACER_DB).
    #[arg(long, env = paths::DB_ENV)]
    pub db: Option<PathBuf>,
}

impl DbArgs {
    /// The database's path: --db, TRACER_DB, or `who`'s default.
    pub fn path_for(&self, who: &Invoker) -> Result<PathBuf> {
        paths::db_path(self.db.as_deref(), who)
    }

    /// The database's path for the user who ran tracer (through sudo: the invoking user).
    pub fn path(&self) -> Result<PathBuf> {
        self.path_for(&paths::invoker())
    }
}
