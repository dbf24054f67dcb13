//! A reader of Python pickles that hold plain data (dicts, lists, tuples, strings, numbers):
//! what `torch.cuda.memory._dump_snapshot` writes. It runs the pickle machine over an arena of
//! values and refuses every opcode that names or builds a Python object (GLOBAL, REDUCE, BUILD,
//! ...): nothing in the file is ever executed or imported.
//!
//! Why not serde-pickle: it clones a memoized value for each reference to it and refuses a
//! value referenced while another reference to it is being read ("recursive structure found"),
//! which every real snapshot here does (PyTorch's frames are shared between trace entries). The
//! arena keeps each value once, however often the file refers to it.

use std::collections::HashMap;

use thiserror::Error;

/// A value's place in the [`Pickle`]'s arena.
pub type ValueId = u32;

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    /// Lists, tuples and sets alike.
    List(Vec<ValueId>),
    Dict(Vec<(ValueId, ValueId)>),
}

#[derive(Debug, Error, PartialEq)]
pub enum PickleError {
    #[error("the data ends inside an opcode at byte {0}: the file is cut short")]
    Truncated(usize),
    #[error(
        "opcode {opcode:#04x} at byte {at} names or builds a Python object: a memory snapshot holds only dicts, lists and numbers, and tracer builds no object from a file"
    )]
    Object { opcode: u8, at: usize },
    #[error("unknown opcode {opcode:#04x} at byte {at}: not a pickle, or a newer protocol")]
    Unknown { opcode: u8, at: usize },
    #[error("malformed pickle at byte {at}: {what}")]
    Malformed { at: usize, what: &'static str },
    #[error("an integer at byte {0} is wider than 64 bits")]
    WideInt(usize),
    #[error("the pickle has no STOP opcode")]
    NoStop,
}

/// A decoded pickle: the arena and its root value.
#[derive(Debug)]
pub struct Pickle {
    values: Vec<Value>,
    root: ValueId,
}

impl Pickle {
    pub fn root(&self) -> ValueId {
        self.root
    }

    pub fn get(&self, id: ValueId) -> &Value {
        &self.values[id as usize]
    }

    /// The value of `key` in the dict `id` (None when `id` is no dict or lacks the key).
    pub fn field(&self, id: ValueId, key: &str) -> Option<ValueId> {
        let Value::Dict(items) = self.get(id) else {
            return None;
        };
        items
            .iter()
            .find(|(k, _)| matches!(self.get(*k), Value::Str(s) if s == key))
            .map(|&(_, v)| v)
    }

    /// The items of the list `id` (empty when it is no list).
    pub fn items(&self, id: ValueId) -> &[ValueId] {
        match self.get(id) {
            Value::List(items) => items,
            _ => &[],
        }
    }

    pub fn int(&self, id: ValueId) -> Option<i64> {
        match *self.get(id) {
            Value::Int(i) => Some(i),
            Value::Bool(b) => Some(b.into()),
            _ => None,
        }
    }

    pub fn float(&self, id: ValueId) -> Option<f64> {
        match *self.get(id) {
            Value::Float(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            _ => None,
        }
    }

    pub fn str(&self, id: ValueId) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn bool(&self, id: ValueId) -> Option<bool> {
        match *self.get(id) {
            Value::Bool(b) => Some(b),
            Value::Int(i) => Some(i != 0),
            _ => None,
        }
    }
}

/// An item of the machine's stack: a value, or a MARK.
#[derive(Clone, Copy)]
enum Slot {
    Mark,
    Value(ValueId),
}

struct Machine<'a> {
    data: &'a [u8],
    pos: usize,
    values: Vec<Value>,
    stack: Vec<Slot>,
    memo: HashMap<u64, ValueId>,
}

/// Decodes `data`, a whole pickle (protocols 0 to 5) of plain data.
pub fn decode(data: &[u8]) -> Result<Pickle, PickleError> {
    let mut m = Machine {
        data,
        pos: 0,
        values: Vec::new(),
        stack: Vec::new(),
        memo: HashMap::new(),
    };
    while m.pos < data.len() {
        let at = m.pos;
        let opcode = data[at];
        m.pos += 1;
        if opcode == b'.' {
            let root = m.pop(at)?;
            return Ok(Pickle {
                values: m.values,
                root,
            });
        }
        m.step(opcode, at)?;
    }
    Err(PickleError::NoStop)
}

impl Machine<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], PickleError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(PickleError::Truncated(self.pos))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn uint(&mut self, n: usize) -> Result<u64, PickleError> {
        let mut buf = [0u8; 8];
        buf[..n].copy_from_slice(self.take(n)?);
        Ok(u64::from_le_bytes(buf))
    }

    /// A length in the file, bounded by what is left of it.
    fn len(&mut self, n: usize) -> Result<usize, PickleError> {
        let at = self.pos;
        let len = self.uint(n)?;
        usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.data.len() - self.pos)
            .ok_or(PickleError::Truncated(at))
    }

    fn line(&mut self) -> Result<&str, PickleError> {
        let at = self.pos;
        let rest = &self.data[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(PickleError::Truncated(at))?;
        self.pos += end + 1;
        std::str::from_utf8(&rest[..end]).map_err(|_| PickleError::Malformed {
            at,
            what: "a text argument that is not UTF-8",
        })
    }

    fn push(&mut self, v: Value) {
        let id = self.values.len() as ValueId;
        self.values.push(v);
        self.stack.push(Slot::Value(id));
    }

    fn pop(&mut self, at: usize) -> Result<ValueId, PickleError> {
        match self.stack.pop() {
            Some(Slot::Value(id)) => Ok(id),
            Some(Slot::Mark) => Err(PickleError::Malformed {
                at,
                what: "a MARK where a value was expected",
            }),
            None => Err(PickleError::Malformed {
                at,
                what: "the stack is empty",
            }),
        }
    }

    fn top(&self, at: usize) -> Result<ValueId, PickleError> {
        match self.stack.last() {
            Some(Slot::Value(id)) => Ok(*id),
            _ => Err(PickleError::Malformed {
                at,
                what: "no value on the stack",
            }),
        }
    }

    /// The values above the topmost MARK, which goes.
    fn pop_mark(&mut self, at: usize) -> Result<Vec<ValueId>, PickleError> {
        let mark = self
            .stack
            .iter()
            .rposition(|s| matches!(s, Slot::Mark))
            .ok_or(PickleError::Malformed {
                at,
                what: "no MARK",
            })?;
        let items = self.stack.split_off(mark + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .filter_map(|s| match s {
                Slot::Value(id) => Some(id),
                Slot::Mark => None,
            })
            .collect())
    }

    fn int(&mut self, v: i64) {
        self.push(Value::Int(v));
    }

    /// A little-endian two's-complement integer of `n` bytes (LONG1, LONG4).
    fn long(&mut self, n: usize, at: usize) -> Result<(), PickleError> {
        let bytes = self.take(n)?;
        if bytes.is_empty() {
            self.int(0);
            return Ok(());
        }
        let negative = bytes[bytes.len() - 1] & 0x80 != 0;
        // Bytes beyond 8 must be sign extension only.
        let (low, high) = bytes.split_at(bytes.len().min(8));
        let fill = if negative { 0xff } else { 0 };
        if high.iter().any(|&b| b != fill) {
            return Err(PickleError::WideInt(at));
        }
        let mut buf = [fill; 8];
        buf[..low.len()].copy_from_slice(low);
        let v = i64::from_le_bytes(buf);
        // An unsigned 64-bit value above i64::MAX (PyTorch writes an unknown frame line as
        // size_t's -1, 18446744073709551615) is kept as its two's complement: -1 there.
        let unsigned_64 = !negative && high.len() == 1 && low.len() == 8;
        if (v < 0) != negative && !unsigned_64 {
            return Err(PickleError::WideInt(at));
        }
        self.int(v);
        Ok(())
    }

    fn text(&mut self, bytes: Vec<u8>, at: usize) -> Result<(), PickleError> {
        let s = String::from_utf8(bytes).map_err(|_| PickleError::Malformed {
            at,
            what: "a string that is not UTF-8",
        })?;
        self.push(Value::Str(s));
        Ok(())
    }

    /// The memo key an opcode names: the next free one, in 1 or 4 bytes, or as text.
    fn memo_key(&mut self, opcode: u8, at: usize) -> Result<u64, PickleError> {
        match opcode {
            0x94 => Ok(self.memo.len() as u64),
            b'q' | b'h' => self.uint(1),
            b'r' | b'j' => self.uint(4),
            _ => self.line()?.parse().map_err(|_| PickleError::Malformed {
                at,
                what: "a memo key that does not parse",
            }),
        }
    }

    fn memo_put(&mut self, key: u64, at: usize) -> Result<(), PickleError> {
        let id = self.top(at)?;
        self.memo.insert(key, id);
        Ok(())
    }

    fn memo_get(&mut self, key: u64, at: usize) -> Result<(), PickleError> {
        let id = *self.memo.get(&key).ok_or(PickleError::Malformed {
            at,
            what: "a reference to a value not yet stored",
        })?;
        self.stack.push(Slot::Value(id));
        Ok(())
    }

    fn list_mut(&mut self, id: ValueId, at: usize) -> Result<&mut Vec<ValueId>, PickleError> {
        match &mut self.values[id as usize] {
            Value::List(items) => Ok(items),
            _ => Err(PickleError::Malformed {
                at,
                what: "an append to what is not a list",
            }),
        }
    }

    fn set_items(&mut self, dict: ValueId, kv: &[ValueId], at: usize) -> Result<(), PickleError> {
        if !kv.len().is_multiple_of(2) {
            return Err(PickleError::Malformed {
                at,
                what: "a key without its value",
            });
        }
        let Value::Dict(items) = &mut self.values[dict as usize] else {
            return Err(PickleError::Malformed {
                at,
                what: "an item set in what is not a dict",
            });
        };
        items.extend(kv.chunks_exact(2).map(|p| (p[0], p[1])));
        Ok(())
    }

    fn step(&mut self, opcode: u8, at: usize) -> Result<(), PickleError> {
        match opcode {
            // PROTO, FRAME: framing only.
            0x80 => drop(self.take(1)?),
            0x95 => drop(self.take(8)?),
            b'(' => self.stack.push(Slot::Mark),
            b'0' => drop(self.stack.pop()),
            b'1' => drop(self.pop_mark(at)?),
            b'2' => {
                let id = self.top(at)?;
                self.stack.push(Slot::Value(id));
            }
            b'N' => self.push(Value::None),
            0x88 => self.push(Value::Bool(true)),
            0x89 => self.push(Value::Bool(false)),
            b'J' => {
                let v = self.uint(4)? as u32 as i32;
                self.int(v.into());
            }
            b'K' => {
                let v = self.uint(1)?;
                self.int(v as i64);
            }
            b'M' => {
                let v = self.uint(2)?;
                self.int(v as i64);
            }
            0x8a => {
                let n = self.len(1)?;
                self.long(n, at)?;
            }
            0x8b => {
                let n = self.len(4)?;
                self.long(n, at)?;
            }
            b'I' | b'L' => {
                let line = self.line()?.trim_end_matches('L').to_owned();
                let v = match line.as_str() {
                    "01" => 1,
                    "00" => 0,
                    l => l.parse::<i64>().map_err(|_| PickleError::WideInt(at))?,
                };
                self.int(v);
            }
            b'F' => {
                let v = self
                    .line()?
                    .parse::<f64>()
                    .map_err(|_| PickleError::Malformed {
                        at,
                        what: "a float that does not parse",
                    })?;
                self.push(Value::Float(v));
            }
            b'G' => {
                let bytes: [u8; 8] = self
                    .take(8)?
                    .try_into()
                    .map_err(|_| PickleError::Truncated(at))?;
                self.push(Value::Float(f64::from_be_bytes(bytes)));
            }
            0x8c => {
                let n = self.len(1)?;
                let b = self.take(n)?.to_vec();
                self.text(b, at)?;
            }
            b'X' => {
                let n = self.len(4)?;
                let b = self.take(n)?.to_vec();
                self.text(b, at)?;
            }
            0x8d => {
                let n = self.len(8)?;
                let b = self.take(n)?.to_vec();
                self.text(b, at)?;
            }
            b'V' => {
                let s = self.line()?.to_owned();
                self.push(Value::Str(s));
            }
            // Python 2 strings and bytes: kept as bytes.
            b'U' | b'C' => {
                let n = self.len(1)?;
                let b = self.take(n)?.to_vec();
                self.push(Value::Bytes(b));
            }
            b'T' | b'B' => {
                let n = self.len(4)?;
                let b = self.take(n)?.to_vec();
                self.push(Value::Bytes(b));
            }
            0x8e | 0x96 => {
                let n = self.len(8)?;
                let b = self.take(n)?.to_vec();
                self.push(Value::Bytes(b));
            }
            b']' | b')' | 0x8f => self.push(Value::List(Vec::new())),
            b'}' => self.push(Value::Dict(Vec::new())),
            b'l' | b't' | 0x91 => {
                let items = self.pop_mark(at)?;
                self.push(Value::List(items));
            }
            b'd' => {
                let kv = self.pop_mark(at)?;
                self.push(Value::Dict(Vec::new()));
                let dict = self.top(at)?;
                self.set_items(dict, &kv, at)?;
            }
            0x85..=0x87 => {
                let n = (opcode - 0x84) as usize;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.pop(at)?);
                }
                items.reverse();
                self.push(Value::List(items));
            }
            b'a' => {
                let v = self.pop(at)?;
                let list = self.top(at)?;
                self.list_mut(list, at)?.push(v);
            }
            b'e' | 0x90 => {
                let items = self.pop_mark(at)?;
                let list = self.top(at)?;
                self.list_mut(list, at)?.extend(items);
            }
            b's' => {
                let v = self.pop(at)?;
                let k = self.pop(at)?;
                let dict = self.top(at)?;
                self.set_items(dict, &[k, v], at)?;
            }
            b'u' => {
                let kv = self.pop_mark(at)?;
                let dict = self.top(at)?;
                self.set_items(dict, &kv, at)?;
            }
            // MEMOIZE, BINPUT, LONG_BINPUT, PUT.
            0x94 | b'q' | b'r' | b'p' => {
                let key = self.memo_key(opcode, at)?;
                self.memo_put(key, at)?;
            }
            // BINGET, LONG_BINGET, GET.
            b'h' | b'j' | b'g' => {
                let key = self.memo_key(opcode, at)?;
                self.memo_get(key, at)?;
            }
            // GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ, NEWOBJ, NEWOBJ_EX, EXT1-4,
            // PERSID, BINPERSID, NEXT_BUFFER, READONLY_BUFFER.
            b'c'
            | 0x93
            | b'R'
            | b'b'
            | b'i'
            | b'o'
            | 0x81
            | 0x92
            | 0x82..=0x84
            | b'P'
            | b'Q'
            | 0x97
            | 0x98 => return Err(PickleError::Object { opcode, at }),
            _ => return Err(PickleError::Unknown { opcode, at }),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes Python 3.11 wrote: `pickle.dumps({'a': [1, -2, 2**40, 'x'], 'b': (None, True,
    /// 1.5)}, protocol=4)` with the list shared: `d['c'] = d['a']`.
    const SHARED: &[u8] = b"\x80\x04\x957\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xff\x8a\x06\x00\x00\x00\x00\x00\x01\x8c\x01x\x94e\x8c\x01b\x94N\x88G?\xf8\x00\x00\x00\x00\x00\x00\x87\x94\x8c\x01c\x94h\x02u.";

    #[test]
    fn reads_plain_data_and_shares_what_the_memo_shares() {
        let p = decode(SHARED).unwrap();
        let a = p.field(p.root(), "a").unwrap();
        let ints: Vec<Option<i64>> = p.items(a)[..3].iter().map(|&i| p.int(i)).collect();
        assert_eq!(ints, [Some(1), Some(-2), Some(1 << 40)]);
        assert_eq!(p.str(p.items(a)[3]), Some("x"));
        assert_eq!(p.field(p.root(), "c"), Some(a));
        let b = p.items(p.field(p.root(), "b").unwrap());
        assert_eq!(p.get(b[0]), &Value::None);
        assert_eq!(p.bool(b[1]), Some(true));
        assert_eq!(p.float(b[2]), Some(1.5));
    }

    #[test]
    fn refuses_objects_and_cut_files() {
        // pickle.dumps(collections.OrderedDict(), protocol=4) starts with STACK_GLOBAL.
        let object = b"\x80\x04\x95\"\x00\x00\x00\x00\x00\x00\x00\x8c\x0bcollections\x94\x8c\x0bOrderedDict\x94\x93\x94)R\x94.";
        assert!(matches!(
            decode(object),
            Err(PickleError::Object { opcode: 0x93, .. })
        ));
        for cut in 0..SHARED.len() - 1 {
            assert!(decode(&SHARED[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(
            decode(b"\x80\x04\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.").err(),
            Some(PickleError::WideInt(2))
        );
    }

    /// torch.compile's frames write an unknown line as size_t's -1 (2^64 - 1): an unsigned
    /// 64-bit integer, read as its two's complement, not refused.
    #[test]
    fn an_unsigned_64_bit_integer_is_read() {
        let p = decode(b"\x80\x04\x8a\x09\xff\xff\xff\xff\xff\xff\xff\xff\x00.").unwrap();
        assert_eq!(p.get(p.root()), &Value::Int(-1));
    }
}
