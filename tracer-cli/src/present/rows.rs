//! Rendering result rows as an aligned table, CSV or JSON lines of objects.

use std::io::Write;

use anyhow::Result;
use clap::ValueEnum;

use crate::store::readonly::Cell;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Table,
    Csv,
    Json,
}

fn text(cell: &Cell) -> String {
    match cell {
        Cell::Null => String::new(),
        Cell::Int(v) => v.to_string(),
        Cell::Real(v) => v.to_string(),
        Cell::Text(t) => t.clone(),
        Cell::Blob(b) => b.iter().map(|x| format!("{x:02x}")).collect(),
    }
}

fn json(cell: &Cell) -> serde_json::Value {
    match cell {
        Cell::Null => serde_json::Value::Null,
        Cell::Int(v) => (*v).into(),
        Cell::Real(v) => {
            serde_json::Number::from_f64(*v).map_or(serde_json::Value::Null, Into::into)
        }
        Cell::Text(t) => t.clone().into(),
        Cell::Blob(_) => text(cell).into(),
    }
}

fn csv_field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_owned()
    }
}

/// Collects or streams rows, depending on the format (a table needs every row for its widths).
pub struct RowWriter<W: Write> {
    out: W,
    format: Format,
    columns: Vec<String>,
    buffered: Vec<Vec<String>>,
    rows: u64,
}

impl<W: Write> RowWriter<W> {
    pub fn new(out: W, format: Format) -> Self {
        RowWriter {
            out,
            format,
            columns: Vec::new(),
            buffered: Vec::new(),
            rows: 0,
        }
    }

    pub fn columns(&mut self, columns: &[String]) -> Result<()> {
        self.columns = columns.to_vec();
        if self.format == Format::Csv {
            let line: Vec<String> = columns.iter().map(|c| csv_field(c)).collect();
            writeln!(self.out, "{}", line.join(","))?;
        } else if self.format == Format::Json {
            write!(self.out, "[")?;
        }
        Ok(())
    }

    pub fn row(&mut self, cells: &[Cell]) -> Result<()> {
        match self.format {
            Format::Table => self.buffered.push(cells.iter().map(text).collect()),
            Format::Csv => {
                let line: Vec<String> = cells.iter().map(|c| csv_field(&text(c))).collect();
                writeln!(self.out, "{}", line.join(","))?;
            }
            Format::Json => {
                let object: serde_json::Map<String, serde_json::Value> = self
                    .columns
                    .iter()
                    .cloned()
                    .zip(cells.iter().map(json))
                    .collect();
                let sep = if self.rows == 0 { "\n" } else { ",\n" };
                write!(self.out, "{sep}{}", serde_json::Value::Object(object))?;
            }
        }
        self.rows += 1;
        Ok(())
    }

    pub fn finish(mut self) -> Result<u64> {
        match self.format {
            Format::Table => {
                let mut widths: Vec<usize> =
                    self.columns.iter().map(|c| c.chars().count()).collect();
                for row in &self.buffered {
                    for (w, cell) in widths.iter_mut().zip(row) {
                        *w = (*w).max(cell.chars().count());
                    }
                }
                let render = |cells: &[String]| -> String {
                    let parts: Vec<String> = cells
                        .iter()
                        .zip(&widths)
                        .map(|(c, w)| format!("{c:<w$}", w = *w))
                        .collect();
                    parts.join("  ").trim_end().to_owned()
                };
                writeln!(self.out, "{}", render(&self.columns))?;
                let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
                writeln!(self.out, "{}", rule.join("  "))?;
                for row in &self.buffered {
                    writeln!(self.out, "{}", render(row))?;
                }
            }
            Format::Csv => {}
            Format::Json => writeln!(self.out, "{}]", if self.rows == 0 { "" } else { "\n" })?,
        }
        self.out.flush()?;
        Ok(self.rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(format: Format) -> String {
        let mut buf = Vec::new();
        let mut w = RowWriter::new(&mut buf, format);
        w.columns(&["op".into(), "n".into()]).unwrap();
        w.row(&[Cell::Text("cudaMalloc".into()), Cell::Int(3)])
            .unwrap();
        w.row(&[Cell::Text("a,\"b\"".into()), Cell::Null]).unwrap();
        w.finish().unwrap();
        String::from_utf8(buf).unwrap()
    }

    #[test]
    fn table_csv_json() {
        assert_eq!(
            render(Format::Table),
            "op          n\n----------  -\ncudaMalloc  3\na,\"b\"\n"
        );
        assert_eq!(
            render(Format::Csv),
            "op,n\ncudaMalloc,3\n\"a,\"\"b\"\"\",\n"
        );
        let v: serde_json::Value = serde_json::from_str(&render(Format::Json)).unwrap();
        assert_eq!(v[0]["n"], 3);
        assert_eq!(v[1]["n"], serde_json::Value::Null);
    }
}
