//! How much of `musubi/hot.ld`, the list of functions a run executes that the link gathers
//! at the front of the code, still names functions of the binary being measured.
//!
//! The list names functions by symbol, and symbols carry hashes of the toolchain and the
//! crates' versions: after an update the list silently matches less, the run's code spreads
//! over the binary again, and `bench boot`'s memory figure grows. Printed beside that figure,
//! the count says which of the two happened.

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;

const HOT_LD: &str = include_str!("../../hot.ld");

/// The functions the list names by symbol (C library objects are named by file instead),
/// without the `.llvm.NUMBER` suffix a local function called from another codegen unit
/// gets: the list matches any number there, as the number changes with the crate's code.
fn listed() -> HashSet<&'static str> {
    HOT_LD
        .lines()
        .filter_map(|l| l.trim().strip_prefix("*(.text."))
        .filter_map(|rest| rest.split_whitespace().next())
        .map(|s| s.strip_suffix(".llvm.*").unwrap_or(s))
        .filter(|s| !s.contains('*'))
        .collect()
}

/// `symbol` as [`listed`] names it.
fn unsuffixed(symbol: &str) -> &str {
    match symbol.rsplit_once(".llvm.") {
        Some((name, n)) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => symbol,
    }
}

/// (listed functions found in `exe`, functions listed), read with binutils' `nm`.
pub fn matched(exe: &Path) -> Result<(usize, usize), String> {
    let out = Command::new("nm")
        .arg("--defined-only")
        .arg(exe)
        .output()
        .map_err(|e| format!("cannot run nm (binutils) on {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!(
            "nm {}: {}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let listed = listed();
    let text = String::from_utf8_lossy(&out.stdout);
    let found: HashSet<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(unsuffixed)
        .filter(|s| listed.contains(s))
        .collect();
    Ok((found.len(), listed.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_names_functions_mostly_rust_and_no_patterns() {
        let l = listed();
        assert!(l.len() > 100, "hot.ld lists only {} functions", l.len());
        let rust = l
            .iter()
            .filter(|s| s.starts_with("_ZN") || s.starts_with("_R"))
            .count();
        assert!(
            rust * 10 >= l.len() * 9,
            "{rust} of {} are Rust symbols",
            l.len()
        );
        assert!(l.iter().all(|s| !s.contains(['*', '?', '(', ')'])));
    }

    #[test]
    fn a_local_functions_number_suffix_is_ignored() {
        assert_eq!(
            unsuffixed("_ZN1a1b17h0123456789abcdefE.llvm.1234"),
            "_ZN1a1b17h0123456789abcdefE"
        );
        assert_eq!(
            unsuffixed("_ZN1a1b17h0123456789abcdefE"),
            "_ZN1a1b17h0123456789abcdefE"
        );
        assert_eq!(unsuffixed("x.llvm."), "x.llvm.");
        assert_eq!(unsuffixed("x.llvm.12a"), "x.llvm.12a");
    }

    #[test]
    fn nm_reads_a_binary_and_counts_only_listed_functions() {
        // The test binary links the same crates but is not `musubi`: the count must come
        // from its symbols, whatever they are, without failing.
        let exe = std::env::current_exe().unwrap();
        let (found, listed) = matched(&exe).unwrap();
        assert!(found <= listed);
        assert!(listed > 100);
    }
}
