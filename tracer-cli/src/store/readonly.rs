//! The guard behind `tracer query`: user SQL runs on a read-only connection, as one statement,
//! under an authorizer that allows reading and nothing else (no ATTACH, no extensions, no
//! pragma assignments, no writes).

use anyhow::Result;
use rusqlite::{
    hooks::{AuthAction, AuthContext, Authorization},
    types::ValueRef,
    Connection,
};

use crate::exit::user_error;

/// A cell of a result row, owned.
#[derive(Clone, Debug, PartialEq)]
pub enum Cell {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
}

fn authorize(ctx: AuthContext<'_>) -> Authorization {
    match ctx.action {
        AuthAction::Select | AuthAction::Read { .. } | AuthAction::Recursive => {
            Authorization::Allow
        }
        AuthAction::Function { function_name } => {
            if function_name.eq_ignore_ascii_case("load_extension") {
                Authorization::Deny
            } else {
                Authorization::Allow
            }
        }
        AuthAction::Pragma {
            pragma_value: None, ..
        } => Authorization::Allow,
        _ => Authorization::Deny,
    }
}

pub fn install_guard(conn: &Connection) {
    conn.authorizer(Some(authorize));
}

/// Runs `sql`, calling `on_columns` once and `on_row` per row. Refuses anything but a read.
pub fn run(
    conn: &Connection,
    sql: &str,
    mut on_columns: impl FnMut(&[String]) -> Result<()>,
    mut on_row: impl FnMut(&[Cell]) -> Result<()>,
) -> Result<()> {
    install_guard(conn);
    let mut stmt = conn.prepare(sql).map_err(|e| match e {
        rusqlite::Error::MultipleStatement => {
            user_error("tracer query runs one statement at a time: remove the extra statements after ';'")
        }
        rusqlite::Error::SqliteFailure(f, msg) if f.code == rusqlite::ErrorCode::AuthorizationForStatementDenied => {
            user_error(format!(
                "refused: tracer query is read-only (no writes, ATTACH, extensions or pragma assignments){}",
                msg.map(|m| format!(" [{m}]")).unwrap_or_default()
            ))
        }
        other => user_error(format!("invalid SQL: {other}")),
    })?;
    if !stmt.readonly() {
        return Err(user_error(
            "refused: tracer query is read-only and this statement would write",
        ));
    }
    let columns: Vec<String> = stmt.column_names().iter().map(|c| c.to_string()).collect();
    on_columns(&columns)?;
    let mut rows = stmt
        .query([])
        .map_err(|e| user_error(format!("query failed: {e}")))?;
    let mut cells = Vec::with_capacity(columns.len());
    while let Some(row) = rows
        .next()
        .map_err(|e| user_error(format!("query failed: {e}")))?
    {
        cells.clear();
        for i in 0..columns.len() {
            cells.push(match row.get_ref(i)? {
                ValueRef::Null => Cell::Null,
                ValueRef::Integer(v) => Cell::Int(v),
                ValueRef::Real(v) => Cell::Real(v),
                ValueRef::Text(t) => Cell::Text(String::from_utf8_lossy(t).into_owned()),
                ValueRef::Blob(b) => Cell::Blob(b.to_vec()),
            });
        }
        on_row(&cells)?;
    }
    Ok(())
}
