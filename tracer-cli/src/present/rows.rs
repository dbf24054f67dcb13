//! Rendering result rows as an aligned table, CSV or JSON lines of objects.

use std::io::Write;

use anyhow::Result;
use clap::ValueEnum;
use unicode_width::UnicodeWidthStr as _;

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

/// Where the rows go: a table needs every row for its widths; CSV (the csv crate: quoting,
/// escapes) and JSON stream.
enum Out<W: Write> {
    Table(W),
    Csv(Box<csv::Writer<W>>),
    Json(W),
}

/// Collects or streams rows, depending on the format.
pub struct RowWriter<W: Write> {
    out: Out<W>,
    columns: Vec<String>,
    buffered: Vec<Vec<String>>,
    rows: u64,
}

impl<W: Write> RowWriter<W> {
    pub fn new(out: W, format: Format) -> Self {
        let out = match format {
            Format::Table => Out::Table(out),
            Format::Csv => Out::Csv(Box::new(
                csv::WriterBuilder::new()
                    .terminator(csv::Terminator::Any(b'\n'))
                    .from_writer(out),
            )),
            Format::Json => Out::Json(out),
        };
        RowWriter {
            out,
            columns: Vec::new(),
            buffered: Vec::new(),
            rows: 0,
        }
    }

    pub fn columns(&mut self, columns: &[String]) -> Result<()> {
        self.columns = columns.to_vec();
        match &mut self.out {
            Out::Table(_) => {}
            Out::Csv(w) => w.write_record(columns)?,
            Out::Json(w) => write!(w, "[")?,
        }
        Ok(())
    }

    pub fn row(&mut self, cells: &[Cell]) -> Result<()> {
        match &mut self.out {
            Out::Table(_) => self.buffered.push(cells.iter().map(text).collect()),
            Out::Csv(w) => w.write_record(cells.iter().map(text))?,
            Out::Json(w) => {
                let object: serde_json::Map<String, serde_json::Value> = self
                    .columns
                    .iter()
                    .cloned()
                    .zip(cells.iter().map(json))
                    .collect();
                let sep = if self.rows == 0 { "\n" } else { ",\n" };
                write!(w, "{sep}{}", serde_json::Value::Object(object))?;
            }
        }
        self.rows += 1;
        Ok(())
    }

    pub fn finish(self) -> Result<u64> {
        match self.out {
            Out::Table(mut w) => {
                table(&mut w, &self.columns, &self.buffered)?;
                w.flush()?;
            }
            Out::Csv(mut w) => w.flush()?,
            Out::Json(mut w) => {
                writeln!(w, "{}]", if self.rows == 0 { "" } else { "\n" })?;
                w.flush()?;
            }
        }
        Ok(self.rows)
    }
}

/// Columns padded to their widest cell as a terminal shows it (wide and combining characters
/// measured by unicode-width), two spaces apart, under a rule.
fn table(out: &mut impl Write, columns: &[String], rows: &[Vec<String>]) -> Result<()> {
    let mut widths: Vec<usize> = columns.iter().map(|c| c.width()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.width());
        }
    }
    let render = |cells: &[String]| -> String {
        let parts: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w.saturating_sub(c.width()))))
            .collect();
        parts.join("  ").trim_end().to_owned()
    };
    writeln!(out, "{}", render(columns))?;
    let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
    writeln!(out, "{}", rule.join("  "))?;
    for row in rows {
        writeln!(out, "{}", render(row))?;
    }
    Ok(())
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

    #[test]
    fn wide_characters_are_measured_as_a_terminal_shows_them() {
        let mut buf = Vec::new();
        let mut w = RowWriter::new(&mut buf, Format::Table);
        w.columns(&["comm".into(), "n".into()]).unwrap();
        w.row(&[Cell::Text("训练".into()), Cell::Int(1)]).unwrap();
        w.row(&[Cell::Text("abcde".into()), Cell::Int(2)]).unwrap();
        w.finish().unwrap();
        // 训练 is four columns wide: one space pads it to abcde's five.
        assert_eq!(
            String::from_utf8(buf).unwrap(),
            "comm   n\n-----  -\n训练   1\nabcde  2\n"
        );
        let mut buf = Vec::new();
        let mut w = RowWriter::new(&mut buf, Format::Csv);
        w.columns(&["text".into()]).unwrap();
        w.row(&[Cell::Text("two\nlines".into())]).unwrap();
        w.finish().unwrap();
        assert_eq!(String::from_utf8(buf).unwrap(), "text\n\"two\nlines\"\n");
    }
}
