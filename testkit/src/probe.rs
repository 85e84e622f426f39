//! The probe guest's result lines as a test reads them: a malformed one fails the test.

use serde_json::Value;

/// The probe guest's result lines in `text` (console output, a serial file's contents).
pub fn results_in(text: &str) -> Vec<Value> {
    probe_lines::strict_results(text).unwrap_or_else(|e| panic!("{e}"))
}

/// The `task` result line in `text`, failing the test (with `text`) if there is none.
pub fn result_in(text: &str, task: &str) -> Value {
    results_in(text)
        .into_iter()
        .find(|v| v["probe"] == task)
        .unwrap_or_else(|| panic!("no {task} result in the serial output:\n{text}"))
}
