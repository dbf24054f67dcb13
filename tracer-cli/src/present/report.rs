//! The HTML report (`tracer report`): one self-contained page. Its data is embedded as JSON,
//! drawn by the page's script with uPlot (embedded with its licence); a Content-Security-Policy
//! forbids every request, so the page opens offline and never calls out.

use std::io::Write;

use anyhow::{Context as _, Result};

use crate::query::report::ReportData;

const TEMPLATE: &str = include_str!("../../assets/report.html");
const SCRIPT: &str = include_str!("../../assets/report.js");
const UPLOT_JS: &str = include_str!("../../assets/uplot/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../../assets/uplot/uPlot.min.css");
const UPLOT_LICENCE: &str = include_str!("../../assets/uplot/LICENSE");

/// JSON safe inside a script element: no `<` can close it or open a comment (JSON has `<`
/// only inside strings, where `\u003c` means the same).
fn script_json(data: &ReportData) -> Result<String> {
    let json = serde_json::to_string(data).context("encoding the report's data")?;
    Ok(json.replace('<', "\\u003c"))
}

fn html_text(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// Writes the page; returns its size in bytes.
pub fn write(out: &mut impl Write, data: &ReportData) -> Result<u64> {
    let page = TEMPLATE
        .replacen("/*UPLOT_CSS*/", UPLOT_CSS, 1)
        .replacen("/*TRACER_VERSION*/", data.tracer_version, 1)
        .replacen("/*UPLOT_LICENCE*/", &html_text(UPLOT_LICENCE), 1);
    // The data and the scripts go in last, so that nothing in them is taken for a placeholder.
    let (head, tail) = page
        .split_once("/*REPORT_DATA*/")
        .context("the report template has no data placeholder")?;
    let (middle, tail) = tail
        .split_once("/*UPLOT_JS*/")
        .context("the report template has no uPlot placeholder")?;
    let (middle2, tail) = tail
        .split_once("/*REPORT_JS*/")
        .context("the report template has no script placeholder")?;
    let json = script_json(data)?;
    let mut written = 0u64;
    for part in [
        head,
        json.as_str(),
        middle,
        // A script element ends at the first "</script", which neither script contains.
        UPLOT_JS,
        middle2,
        SCRIPT,
        tail,
    ] {
        out.write_all(part.as_bytes())
            .context("writing the report")?;
        written += part.len() as u64;
    }
    out.flush().context("writing the report")?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_scripts_cannot_end_their_element() {
        for script in [UPLOT_JS, SCRIPT] {
            assert!(!script.to_ascii_lowercase().contains("</script"));
        }
        assert!(!UPLOT_JS.contains("fetch(") && !UPLOT_JS.contains("XMLHttpRequest"));
    }
}
