//! A pickle writer for plain data (protocol 2: dicts, lists, tuples, strings, integers, floats,
//! booleans, None), as PyTorch's memory snapshot holds it; any Python unpickles it without
//! importing a class. Repeated strings (file and function names) are memoized.

use std::collections::HashMap;
use std::io::{self, Write};

/// One plain Python value.
#[derive(Clone, Debug, PartialEq)]
pub enum PyValue {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    List(Vec<PyValue>),
    Tuple(Vec<PyValue>),
    /// Keys are strings, in the order written.
    Dict(Vec<(String, PyValue)>),
}

impl PyValue {
    /// A dict from its (key, value) pairs.
    pub fn dict<const N: usize>(pairs: [(&str, PyValue); N]) -> PyValue {
        PyValue::Dict(pairs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
    }

    pub fn int(v: impl Into<i128>) -> PyValue {
        PyValue::Int(v.into())
    }

    pub fn str(s: impl Into<String>) -> PyValue {
        PyValue::Str(s.into())
    }
}

/// Items per MARK ... APPENDS/SETITEMS batch, as Python's own pickler writes them.
const BATCH: usize = 1000;

/// Writes `value` as a protocol-2 pickle.
pub fn write(out: &mut impl Write, value: &PyValue) -> io::Result<()> {
    let mut w = Writer {
        out,
        memo: HashMap::new(),
    };
    w.out.write_all(&[0x80, 2])?;
    w.value(value)?;
    w.out.write_all(b".")
}

struct Writer<'a, W: Write> {
    out: &'a mut W,
    /// Strings written so far, by their memo index.
    memo: HashMap<String, u32>,
}

impl<W: Write> Writer<'_, W> {
    fn value(&mut self, v: &PyValue) -> io::Result<()> {
        match v {
            PyValue::None => self.out.write_all(b"N"),
            PyValue::Bool(true) => self.out.write_all(&[0x88]),
            PyValue::Bool(false) => self.out.write_all(&[0x89]),
            PyValue::Int(i) => self.int(*i),
            PyValue::Float(f) => {
                self.out.write_all(b"G")?;
                self.out.write_all(&f.to_be_bytes())
            }
            PyValue::Str(s) => self.string(s),
            PyValue::List(items) => {
                self.out.write_all(b"]")?;
                for chunk in items.chunks(BATCH) {
                    self.out.write_all(b"(")?;
                    for item in chunk {
                        self.value(item)?;
                    }
                    self.out.write_all(b"e")?;
                }
                Ok(())
            }
            PyValue::Tuple(items) => {
                self.out.write_all(b"(")?;
                for item in items {
                    self.value(item)?;
                }
                self.out.write_all(b"t")
            }
            PyValue::Dict(pairs) => {
                self.out.write_all(b"}")?;
                for chunk in pairs.chunks(BATCH) {
                    self.out.write_all(b"(")?;
                    for (k, v) in chunk {
                        self.string(k)?;
                        self.value(v)?;
                    }
                    self.out.write_all(b"u")?;
                }
                Ok(())
            }
        }
    }

    fn int(&mut self, i: i128) -> io::Result<()> {
        if (0..=0xff).contains(&i) {
            return self.out.write_all(&[b'K', i as u8]);
        }
        if (0..=0xffff).contains(&i) {
            self.out.write_all(b"M")?;
            return self.out.write_all(&(i as u16).to_le_bytes());
        }
        if let Ok(small) = i32::try_from(i) {
            self.out.write_all(b"J")?;
            return self.out.write_all(&small.to_le_bytes());
        }
        // LONG1: the shortest little-endian two's complement.
        let bytes = i.to_le_bytes();
        let mut n = bytes.len();
        while n > 1 {
            let (top, below) = (bytes[n - 1], bytes[n - 2]);
            let redundant = (top == 0 && below & 0x80 == 0) || (top == 0xff && below & 0x80 != 0);
            if !redundant {
                break;
            }
            n -= 1;
        }
        self.out.write_all(&[0x8a, n as u8])?;
        self.out.write_all(&bytes[..n])
    }

    fn string(&mut self, s: &str) -> io::Result<()> {
        if let Some(&at) = self.memo.get(s) {
            self.out.write_all(b"j")?;
            return self.out.write_all(&at.to_le_bytes());
        }
        self.out.write_all(b"X")?;
        self.out.write_all(&(s.len() as u32).to_le_bytes())?;
        self.out.write_all(s.as_bytes())?;
        let at = self.memo.len() as u32;
        self.memo.insert(s.to_owned(), at);
        self.out.write_all(b"r")?;
        self.out.write_all(&at.to_le_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::pickle::{decode, Value};

    /// What is written reads back through tracer's own reader, every kind of value and the
    /// integers at each width's edges.
    #[test]
    fn writes_what_the_reader_reads_back() {
        let ints: Vec<i128> = vec![
            0,
            255,
            256,
            65_535,
            65_536,
            -1,
            i128::from(i32::MIN),
            i128::from(i32::MAX) + 1,
            0x7fff_ffff_ffff,
            i128::from(i64::MAX),
            i128::from(i64::MIN),
        ];
        let value = PyValue::dict([
            (
                "ints",
                PyValue::List(ints.iter().map(|&i| PyValue::Int(i)).collect()),
            ),
            ("name", PyValue::str("frame")),
            ("again", PyValue::str("frame")),
            ("flag", PyValue::Bool(true)),
            ("none", PyValue::None),
            ("ratio", PyValue::Float(0.25)),
            (
                "pool",
                PyValue::Tuple(vec![PyValue::int(0), PyValue::int(0)]),
            ),
            ("many", PyValue::List((0..2500).map(PyValue::int).collect())),
        ]);
        let mut bytes = Vec::new();
        write(&mut bytes, &value).unwrap();
        let p = decode(&bytes).unwrap();
        let root = p.root();
        let read_ints: Vec<i64> = p
            .items(p.field(root, "ints").unwrap())
            .iter()
            .map(|&v| p.int(v).unwrap())
            .collect();
        let want: Vec<i64> = ints.iter().map(|&i| i as i64).collect();
        assert_eq!(read_ints, want);
        assert_eq!(p.str(p.field(root, "again").unwrap()), Some("frame"));
        assert_eq!(p.bool(p.field(root, "flag").unwrap()), Some(true));
        assert!(matches!(p.get(p.field(root, "none").unwrap()), Value::None));
        assert_eq!(p.float(p.field(root, "ratio").unwrap()), Some(0.25));
        assert_eq!(p.items(p.field(root, "pool").unwrap()).len(), 2);
        assert_eq!(p.items(p.field(root, "many").unwrap()).len(), 2500);
    }
}
