//! Waiting, bounded, for something a program under test does that has no event to wait on:
//! a line in a file it writes, a socket it opens.

use std::path::Path;
use std::time::{Duration, Instant};

/// How often a condition is asked again.
pub(crate) const POLL: Duration = Duration::from_millis(20);

/// Asks `cond` until it holds (true) or `limit` has passed (false), so the caller fails the
/// test in its own words.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if start.elapsed() > limit {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// The text of `path`, empty if it does not exist (yet).
pub fn read_text(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_condition_that_never_holds_ends_the_wait_after_its_limit() {
        let start = Instant::now();
        assert!(!wait_until(Duration::from_millis(50), || false));
        assert!(start.elapsed() >= Duration::from_millis(50));
        let mut asked = 0;
        assert!(wait_until(Duration::from_secs(5), || {
            asked += 1;
            asked == 3
        }));
    }

    #[test]
    fn a_missing_file_reads_as_empty() {
        let dir = std::env::temp_dir().join(format!("testkit-none-{}", std::process::id()));
        assert_eq!(read_text(&dir.join("absent")), "");
    }
}
