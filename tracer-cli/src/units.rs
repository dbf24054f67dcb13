//! Parsing of sizes ("64MiB", "2G") and durations ("300s", "5m", "250ms") given on the command line.

use std::time::Duration;

/// Splits "512MiB" into (512.0, "MiB").
fn number_and_unit<'a>(text: &'a str, example: &str) -> Result<(f64, &'a str), String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value = number.parse().map_err(|_| format!("invalid {example}"))?;
    Ok((value, unit.trim()))
}

pub fn parse_size(text: &str) -> Result<u64, String> {
    let (value, unit) = number_and_unit(
        text,
        &format!("size {text:?}: expected e.g. 512MiB, 2G, 1048576"),
    )?;
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        other => {
            return Err(format!(
                "invalid size unit {other:?} in {text:?}: use B, KiB, MiB, GiB or TiB"
            ))
        }
    };
    let bytes = value * mult as f64;
    if !(bytes.is_finite() && bytes >= 1.0) {
        return Err(format!("invalid size {text:?}: must be at least 1 byte"));
    }
    Ok(bytes as u64)
}

pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let (value, unit) = number_and_unit(
        text,
        &format!("duration {text:?}: expected e.g. 300s, 5m, 1h, 250ms"),
    )?;
    let secs = match unit {
        "ms" => value / 1e3,
        "" | "s" => value,
        "m" | "min" => value * 60.0,
        "h" => value * 3600.0,
        other => {
            return Err(format!(
                "invalid duration unit {other:?} in {text:?}: use ms, s, m or h"
            ))
        }
    };
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("invalid duration {text:?}: must be positive"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// 1536 -> "1.5 KiB".
/// " | 12.0 MiB" for a table column that only calls moving bytes have ("" for 0).
pub fn bytes_column(bytes: u64) -> String {
    if bytes > 0 {
        format!(" | {}", format_bytes(bytes))
    } else {
        String::new()
    }
}

pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// 1_500 -> "1.5us": three decimals at most, trailing zeros dropped.
pub fn format_ns(ns: u64) -> String {
    let (value, unit) = match ns {
        0..1_000 => return format!("{ns}ns"),
        1_000..1_000_000 => (ns as f64 / 1e3, "us"),
        1_000_000..1_000_000_000 => (ns as f64 / 1e6, "ms"),
        _ => (ns as f64 / 1e9, "s"),
    };
    let text = format!("{value:.3}");
    format!("{}{unit}", text.trim_end_matches('0').trim_end_matches('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert!(parse_size("12 parsecs").unwrap_err().contains("unit"));
        assert!(parse_size("0").is_err());
        assert!(parse_size("MiB").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("300s"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("3 weeks").is_err());
    }

    #[test]
    fn formatting() {
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(12), "12 B");
        assert_eq!(format_ns(1500), "1.5us");
        assert_eq!(format_ns(2_100_000), "2.1ms");
        assert_eq!(format_ns(65_000), "65us");
    }
}
