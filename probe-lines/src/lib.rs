//! The probe guest's result lines (`{"probe": ...}`, one JSON object a line) picked out of
//! the console output around them (boot messages, a kernel's log), for the `musubi` binary,
//! its benchmarks and their tests alike.

use serde_json::Value;

/// A line that starts as a result line and is not JSON.
#[derive(Debug, thiserror::Error)]
#[error("bad result line {line:?}: {source}")]
pub struct BadLine {
    pub line: String,
    pub source: serde_json::Error,
}

/// The lines of `text` that start (after white space) as a result line, trimmed.
pub fn result_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("{\"probe\""))
}

/// The result lines in `console` output, in order; one that is not JSON (cut off when the
/// VM was stopped, mixed with other output) is passed over.
pub fn results(console: &[u8]) -> Vec<Value> {
    result_lines(&String::from_utf8_lossy(console))
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The result lines in `text`, in order, or the first that is not JSON: for tests, where
/// such a line is a fault of the guest.
pub fn strict_results(text: &str) -> Result<Vec<Value>, BadLine> {
    result_lines(text)
        .map(|l| {
            serde_json::from_str(l).map_err(|source| BadLine {
                line: l.to_string(),
                source,
            })
        })
        .collect()
}

/// The first result of task `task`.
pub fn result<'a>(results: &'a [Value], task: &str) -> Option<&'a Value> {
    results.iter().find(|v| v["probe"] == task)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_are_picked_out_of_console_text() {
        let out = b"booting\r\n{\"probe\":\"hello\",\"cpus\":2}\r\nnoise {\"probe\":1}\n{\"probe\":\"blk-crc\",\"disks\":[]}\n";
        let r = results(out);
        assert_eq!(r.len(), 2);
        assert_eq!(result(&r, "hello").unwrap()["cpus"], 2);
        assert!(result(&r, "exit").is_none());
    }

    #[test]
    fn a_cut_off_result_line_is_passed_over_leniently_and_named_strictly() {
        let out = "  {\"probe\":\"hello\"}\n{\"probe\":\"fib\",\"val\n";
        assert_eq!(results(out.as_bytes()).len(), 1);
        let e = strict_results(out).unwrap_err();
        assert_eq!(e.line, "{\"probe\":\"fib\",\"val");
        assert!(e.to_string().starts_with("bad result line"), "{e}");
        assert_eq!(
            strict_results("{\"probe\":\"a\"}\n").unwrap()[0]["probe"],
            "a"
        );
    }
}
