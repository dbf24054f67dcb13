//! `tracer query`: read-only SQL over a trace database.

use std::io::Write as _;

use anyhow::Result;
use clap::Args;

use tracer_cli::{
    present::rows::{Format, RowWriter},
    store::{readonly, Access, Store},
};

#[derive(Debug, Args)]
pub struct QueryArgs {
    #[command(flatten)]
    pub db: super::db::DbArgs,
    #[arg(long, value_enum, default_value = "table")]
    pub format: Format,
    /// One SQL statement; it may only read (see SCHEMA.md for the tables and the `events` view).
    pub sql: String,
}

pub fn run(args: QueryArgs) -> Result<()> {
    let path = args.db.path()?;
    let store = Store::open(&path, Access::ReadOnly)?;
    let stdout = std::io::stdout().lock();
    let writer =
        std::cell::RefCell::new(RowWriter::new(std::io::BufWriter::new(stdout), args.format));
    readonly::run(
        store.conn(),
        &args.sql,
        |columns| writer.borrow_mut().columns(columns),
        |row| writer.borrow_mut().row(row),
    )?;
    let rows = writer.into_inner().finish()?;
    if rows == 0 && args.format == Format::Table {
        std::io::stderr().write_all(b"(no rows)\n")?;
    }
    Ok(())
}
