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
    // 2^64 and above would be saturated by the conversion: refuse rather than wrap or clamp.
    if bytes >= 18_446_744_073_709_551_616.0 {
        return Err(format!(
            "invalid size {text:?}: larger than 16 EiB, the most a 64-bit count can say"
        ));
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
    // Longer than the Unix epoch is old cannot mean anything here (and overflows Duration and
    // the nanosecond clock past a point).
    if secs > MAX_DURATION_S {
        return Err(format!(
            "invalid duration {text:?}: longer than the time since 1970 ({MAX_DURATION_S:.0}s at most)"
        ));
    }
    Duration::try_from_secs_f64(secs).map_err(|e| format!("invalid duration {text:?}: {e}"))
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

/// A size as PyTorch's out-of-memory message writes it (c10's format_size): "512 bytes",
/// "1.50 KiB", "381.83 MiB", "139.62 GiB", so that tracer's figures read beside PyTorch's.
pub fn format_bytes_as_pytorch(bytes: u64) -> String {
    const KIB: u64 = 1024;
    let value = bytes as f64;
    match bytes {
        0..=KIB => format!("{bytes} bytes"),
        _ if bytes <= KIB * KIB => format!("{:.2} KiB", value / 1024.0),
        _ if bytes <= KIB * KIB * KIB => format!("{:.2} MiB", value / 1048576.0),
        _ => format!("{:.2} GiB", value / 1073741824.0),
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

/// Seconds (with a fraction) or nanoseconds since the epoch; values above 1e12 are nanoseconds.
pub fn parse_time(text: &str) -> Result<i64, String> {
    let ns = match utc_time(text.trim()) {
        Some(ns) => ns?,
        None => unix_time(text)?,
    };
    // No trace holds calls from before 2001 (tracer and its eBPF did not exist): a time that
    // early is a mistake (a 0, a duration given as a time), not a window.
    if ns < EARLIEST_TIME_NS {
        return Err(format!(
            "invalid time {text:?}: before 2001; give a time within the trace (Unix seconds such as 1795323312.5), or use --since 300s"
        ));
    }
    Ok(ns)
}

/// A date and time, as tracer prints them ("2026-11-22 05:01:02.345 UTC") or as RFC 3339
/// writes them ("2026-11-22T05:01:02Z", with an offset); None when `text` is not a date.
fn utc_time(text: &str) -> Option<Result<i64, String>> {
    if !text.contains('-') || text.starts_with('-') {
        return None;
    }
    let invalid = |e: jiff::Error| {
        format!("invalid time {text:?}: {e}; give it as tracer prints it (2026-11-22 05:01:02.345 UTC), in RFC 3339, or as Unix seconds")
    };
    let stamp = match text.strip_suffix("UTC") {
        Some(civil) => civil
            .trim_end()
            .parse::<jiff::civil::DateTime>()
            .and_then(|t| t.to_zoned(jiff::tz::TimeZone::UTC))
            .map(|z| z.timestamp()),
        None => text.parse::<jiff::Timestamp>(),
    };
    Some(stamp.map_err(invalid).and_then(|t| {
        i64::try_from(t.as_nanosecond())
            .map_err(|_| format!("invalid time {text:?}: past 64 bits of nanoseconds"))
    }))
}

/// Unix seconds (with a fraction) or nanoseconds.
fn unix_time(text: &str) -> Result<i64, String> {
    // Nanoseconds do not fit an f64 exactly: take integers as they are.
    match text.trim().parse::<i64>() {
        Ok(ns) if ns > 1_000_000_000_000 => Ok(ns),
        _ => {
            let v: f64 = text.trim().parse().map_err(|_| {
                format!("invalid time {text:?}: give it as tracer prints it (2026-11-22 05:01:02.345 UTC), in RFC 3339, as Unix seconds (1795323312.5) or nanoseconds")
            })?;
            if !v.is_finite() || !(0.0..9.2e18).contains(&v) {
                return Err(format!(
                    "invalid time {text:?}: must be a Unix time (seconds or nanoseconds) within 64 bits"
                ));
            }
            Ok(if v > 1e12 { v as i64 } else { (v * 1e9) as i64 })
        }
    }
}

/// 2001-09-09 01:46:40 UTC, as nanoseconds since the epoch: earlier times are refused.
pub const EARLIEST_TIME_NS: i64 = 1_000_000_000 * 1_000_000_000;

/// The longest duration accepted: from the epoch to 2100.
pub const MAX_DURATION_S: f64 = 4_102_444_800.0;

/// 2026-11-22 05:01:02.345 UTC.
pub fn format_utc(ns: i64) -> String {
    match jiff::Timestamp::from_nanosecond(i128::from(ns)) {
        Ok(t) => t.strftime("%Y-%m-%d %H:%M:%S%.3f UTC").to_string(),
        // Past jiff's range (years beyond 9999): the number itself, never a made-up date.
        Err(_) => format!("{ns} ns since the epoch"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_pytorch_writes_them() {
        // The H200 run's message: "Tried to allocate 139.62 GiB ... 381.83 MiB is allocated"
        // (PyTorch names the segment it asked for: the request rounded up to 2 MiB).
        assert_eq!(format_bytes_as_pytorch(149_910_716_416), "139.62 GiB");
        assert_eq!(format_bytes_as_pytorch(400_379_904), "381.83 MiB");
        assert_eq!(format_bytes_as_pytorch(1024), "1024 bytes");
        assert_eq!(format_bytes_as_pytorch(1536), "1.50 KiB");
        assert_eq!(format_bytes_as_pytorch(1 << 30), "1024.00 MiB");
    }

    #[test]
    fn sizes() {
        // Past 64 bits: refused, never saturated or wrapped.
        assert!(parse_size("18446744073709551615GiB").is_err());
        assert!(parse_size("16EiB").is_err());
        assert!(parse_size("99999999999999999999999").is_err());
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
        // Longer than the epoch is old, or past what a Duration holds: refused, no panic.
        assert!(parse_duration("99999999999999999999s").is_err());
        assert!(parse_duration("1e300h").is_err());
        assert!(parse_duration("5000000000s").is_err());
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

    #[test]
    fn utc_dates() {
        assert_eq!(super::format_utc(0), "1970-01-01 00:00:00.000 UTC");
        assert_eq!(
            super::format_utc(1_795_323_312_817_067_163),
            "2026-11-22 04:55:12.817 UTC"
        );
        assert_eq!(
            super::format_utc(951_782_400_000_000_000),
            "2000-02-29 00:00:00.000 UTC"
        );
    }

    #[test]
    fn times() {
        // Before 2001, or past 64 bits: refused.
        assert!(super::parse_time("0").is_err());
        assert!(super::parse_time("86400").is_err());
        assert!(super::parse_time("99999999999999999999").is_err());
        assert!(super::parse_time("-5").is_err());
        assert_eq!(
            super::parse_time("1795323312.5"),
            Ok(1_795_323_312_500_000_000)
        );
        assert_eq!(
            super::parse_time("1795323312817067163"),
            Ok(1_795_323_312_817_067_163)
        );
        assert!(super::parse_time("yesterday").is_err());
    }

    #[test]
    fn times_as_tracer_prints_them() {
        // Every printed time reads back to its millisecond.
        for ns in [
            1_795_323_312_817_067_163,
            1_000_000_000_000_000_000,
            4_102_444_799_999_000_000,
        ] {
            let printed = super::format_utc(ns);
            assert_eq!(
                super::parse_time(&printed),
                Ok(ns / 1_000_000 * 1_000_000),
                "{printed}"
            );
        }
        assert_eq!(
            super::parse_time("2026-11-22 04:55:12.817 UTC"),
            Ok(1_795_323_312_817_000_000)
        );
        assert_eq!(
            super::parse_time("2026-11-22T04:55:12Z"),
            Ok(1_795_323_312_000_000_000)
        );
        assert_eq!(
            super::parse_time("2026-11-22T05:55:12+01:00"),
            Ok(1_795_323_312_000_000_000)
        );
        assert_eq!(
            super::parse_time("2026-11-22 04:55:12 UTC"),
            Ok(1_795_323_312_000_000_000)
        );
        // Dates that are not: a clear message naming the forms accepted.
        let e = super::parse_time("2026-13-40 04:55:12 UTC").unwrap_err();
        assert!(e.contains("as tracer prints it"), "{e}");
        assert!(
            super::parse_time("2026-11-22 04:55:12").is_err(),
            "no zone: not UTC by guess"
        );
        assert!(
            super::parse_time("1999-01-01 00:00:00 UTC").is_err(),
            "before 2001"
        );
    }
}
