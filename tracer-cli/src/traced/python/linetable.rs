//! The line that was executing in a code object, from its line table, as CPython computes it
//! (PyCode_Addr2Line): 3.11+ location tables (Objects/locations.md), 3.10 co_linetable.

/// Reads 6-bit varint chunks (bit 6 = more).
fn varint(bytes: &[u8], at: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    let mut shift = 0;
    loop {
        let b = *bytes.get(*at)?;
        *at += 1;
        value |= u64::from(b & 63) << shift;
        shift += 6;
        if b & 64 == 0 || shift > 60 {
            return Some(value);
        }
    }
}

fn svarint(bytes: &[u8], at: &mut usize) -> Option<i64> {
    let v = varint(bytes, at)?;
    Some(if v & 1 != 0 {
        -((v >> 1) as i64)
    } else {
        (v >> 1) as i64
    })
}

/// 3.11+: the line of the instruction at `offset` code units, or None (no location).
pub fn line_from_locations(table: &[u8], first_line: i32, offset: u64) -> Option<i32> {
    let mut line = i64::from(first_line);
    let mut addr = 0u64;
    let mut at = 0;
    while at < table.len() {
        let head = table[at];
        at += 1;
        if head & 0x80 == 0 {
            // Not the start of an entry: the table is malformed.
            return None;
        }
        let code = (head >> 3) & 15;
        let length = u64::from(head & 7) + 1;
        let entry_line = match code {
            15 => None,
            14 => {
                line += svarint(table, &mut at)?;
                varint(table, &mut at)?; // end line delta
                varint(table, &mut at)?; // column
                varint(table, &mut at)?; // end column
                Some(line)
            }
            13 => {
                line += svarint(table, &mut at)?;
                Some(line)
            }
            10..=12 => {
                line += i64::from(code) - 10;
                at += 2;
                Some(line)
            }
            _ => {
                at += 1;
                Some(line)
            }
        };
        if offset < addr + length {
            return entry_line.map(|l| l as i32);
        }
        addr += length;
    }
    None
}

/// 3.10: the line at byte `offset` from co_linetable's (bytecode delta, line delta) pairs.
pub fn line_from_linetable_310(table: &[u8], first_line: i32, offset: u64) -> Option<i32> {
    let mut line = i64::from(first_line);
    let mut end = 0u64;
    for pair in table.chunks_exact(2) {
        let (sdelta, ldelta) = (u64::from(pair[0]), pair[1] as i8);
        let start = end;
        end += sdelta;
        let current = if ldelta == -128 {
            None
        } else {
            line += i64::from(ldelta);
            Some(line)
        };
        if offset >= start && offset < end {
            return current.map(|l| l as i32);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_table_forms() {
        // Entries: short form (1 unit, line 10), one-line form +1 (2 units, line 11),
        // no-column form -1 (1 unit, line 10), long form +5 (3 units, line 15), none (1 unit).
        let table = [
            0x80,
            0x00, // code 0, length 1, one column byte
            0x80 | (11 << 3) | 1,
            4,
            9, // code 11: line +1, length 2
            0x80 | (13 << 3),
            3, // code 13: svarint 3 = -1
            0x80 | (14 << 3) | 2,
            10,
            0,
            4,
            8,                // code 14: svarint 10 = +5, length 3
            0x80 | (15 << 3), // no location
        ];
        let lines: Vec<Option<i32>> = (0..9).map(|o| line_from_locations(&table, 10, o)).collect();
        assert_eq!(
            lines,
            [
                Some(10),
                Some(11),
                Some(11),
                Some(10),
                Some(15),
                Some(15),
                Some(15),
                None,
                None
            ]
        );
    }

    #[test]
    fn varints_continue_on_bit_six() {
        // 0x41 0x02: 1 | (2 << 6) = 129.
        let mut at = 0;
        assert_eq!(varint(&[0x41, 0x02], &mut at), Some(129));
        assert_eq!(at, 2);
    }

    #[test]
    fn linetable_310_pairs() {
        // Bytes 0-6 on the first line, 6-10 two lines down, 10-12 no line, 12-20 one line up.
        let table = [6, 0, 4, 2, 2, 0x80, 8, 0xff];
        assert_eq!(line_from_linetable_310(&table, 5, 0), Some(5));
        assert_eq!(line_from_linetable_310(&table, 5, 8), Some(7));
        assert_eq!(line_from_linetable_310(&table, 5, 10), None);
        assert_eq!(line_from_linetable_310(&table, 5, 12), Some(6));
        assert_eq!(line_from_linetable_310(&table, 5, 40), None);
    }
}
