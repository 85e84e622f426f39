//! Text tables, figures set beside published ones, and CSV files.

use std::fmt::Write as _;
use std::path::Path;

/// A plain-text table with columns sized to their widest cell. Numbers read best
/// right-aligned, names left-aligned, so each column says which it holds.
#[derive(Debug, Clone)]
pub struct Table {
    headers: Vec<String>,
    right: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// Columns whose header starts with `>` are right-aligned (the `>` is not printed).
    pub fn new(headers: &[&str]) -> Table {
        Table {
            headers: headers
                .iter()
                .map(|h| h.strip_prefix('>').unwrap_or(h).to_string())
                .collect(),
            right: headers.iter().map(|h| h.starts_with('>')).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row; missing cells print empty, extra cells are an error of the caller.
    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) {
        let mut r: Vec<String> = cells.into_iter().map(Into::into).collect();
        assert!(
            r.len() <= self.headers.len(),
            "row has more cells than the table has columns"
        );
        r.resize(self.headers.len(), String::new());
        self.rows.push(r);
    }

    pub fn render(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|c| {
                self.rows
                    .iter()
                    .map(|r| r[c].chars().count())
                    .chain([self.headers[c].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (c, cell) in cells.iter().enumerate() {
                if c > 0 {
                    s.push_str("  ");
                }
                let pad = widths[c] - cell.chars().count();
                if self.right[c] {
                    s.extend(std::iter::repeat_n(' ', pad));
                    s.push_str(cell);
                } else {
                    s.push_str(cell);
                    s.extend(std::iter::repeat_n(' ', pad));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = line(&self.headers) + "\n";
        let total: usize = widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
        out.push_str(&"-".repeat(total));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}

/// One of our figures set beside a published or targeted one.
#[derive(Debug, Clone)]
pub struct Figure {
    pub what: String,
    pub ours: String,
    pub reference: String,
    pub source: String,
    /// Whether ours meets the reference, when the reference is a bound.
    pub met: Option<bool>,
}

pub fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "MET",
        Some(false) => "MISSED",
        None => "-",
    }
}

/// The figures as a table: figure, ours, reference, verdict, source.
pub fn figures_table(figures: &[Figure]) -> String {
    let mut t = Table::new(&["figure", ">ours", ">reference", "verdict", "source"]);
    for f in figures {
        t.row([
            f.what.clone(),
            f.ours.clone(),
            f.reference.clone(),
            verdict(f.met).to_string(),
            f.source.clone(),
        ]);
    }
    t.render()
}

/// Milliseconds from nanoseconds, to two decimals.
pub fn ms(ns: f64) -> String {
    format!("{:.2}", ns / 1e6)
}

/// Mebibytes from bytes, to two decimals.
pub fn mib(bytes: f64) -> String {
    format!("{:.2}", bytes / (1u64 << 20) as f64)
}

/// A guest's RAM, given in MiB: whole GiB where it is, else MiB.
pub fn ram_size(mib: u64) -> String {
    if mib >= 1024 && mib.is_multiple_of(1024) {
        format!("{} GiB", mib / 1024)
    } else {
        format!("{mib} MiB")
    }
}

/// The RAM sizes an experiment runs, for its plan line.
pub fn ram_sizes(sizes: &[u64]) -> String {
    sizes
        .iter()
        .map(|&m| ram_size(m))
        .collect::<Vec<_>>()
        .join(", ")
}

/// `median / min` of a metric, or `n/a`.
pub fn median_min(s: Option<crate::stats::Summary>, unit: impl Fn(f64) -> String) -> String {
    match s {
        Some(s) => format!("{} / {}", unit(s.median), unit(s.min)),
        None => "n/a".into(),
    }
}

/// A CSV file built in memory (experiments write a few hundred rows at most) and written
/// in one go, so a failed run never leaves half a file behind.
#[derive(Debug, Clone)]
pub struct Csv {
    text: String,
    columns: usize,
}

impl Csv {
    pub fn new(headers: &[&str]) -> Csv {
        let mut c = Csv {
            text: String::new(),
            columns: headers.len(),
        };
        c.push_line(headers.iter().map(|h| h.to_string()));
        c
    }

    pub fn row<S: ToString>(&mut self, cells: impl IntoIterator<Item = S>) {
        let cells: Vec<String> = cells.into_iter().map(|c| c.to_string()).collect();
        assert_eq!(
            cells.len(),
            self.columns,
            "CSV row width differs from the header"
        );
        self.push_line(cells.into_iter());
    }

    fn push_line(&mut self, cells: impl Iterator<Item = String>) {
        for (i, c) in cells.enumerate() {
            if i > 0 {
                self.text.push(',');
            }
            if c.contains([',', '"', '\n', '\r']) {
                let _ = write!(self.text, "\"{}\"", c.replace('"', "\"\""));
            } else {
                self.text.push_str(&c);
            }
        }
        self.text.push('\n');
    }

    pub fn write(&self, path: &Path) -> Result<(), String> {
        std::fs::write(path, &self.text)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

/// An optional number as a CSV cell: empty when unknown, so spreadsheets see a gap rather
/// than a misleading zero.
pub fn cell<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;

    #[test]
    fn ram_is_in_gib_where_it_is_whole() {
        assert_eq!(
            ram_sizes(&[128, 1024, 1536, 4096]),
            "128 MiB, 1 GiB, 1536 MiB, 4 GiB"
        );
    }

    #[test]
    fn table_aligns_columns() {
        let mut t = Table::new(&["name", ">ms"]);
        t.row(["musubi", "1.50"]);
        t.row(["qemu", "120.25"]);
        assert_eq!(
            t.render(),
            "name        ms\n--------------\nmusubi    1.50\nqemu    120.25\n"
        );
    }

    #[test]
    fn short_rows_are_padded() {
        let mut t = Table::new(&["a", "b"]);
        t.row(["x"]);
        assert_eq!(t.render(), "a  b\n----\nx\n");
    }

    #[test]
    fn figures_show_verdicts() {
        let s = figures_table(&[Figure {
            what: "overhead".into(),
            ours: "2.0 MiB".into(),
            reference: "< 3 MiB".into(),
            source: "target".into(),
            met: Some(true),
        }]);
        assert!(s.contains("MET"), "{s}");
        assert!(s.lines().nth(2).unwrap().starts_with("overhead"), "{s}");
        assert_eq!(verdict(Some(false)), "MISSED");
        assert_eq!(verdict(None), "-");
    }

    #[test]
    fn units() {
        assert_eq!(ms(1_500_000.0), "1.50");
        assert_eq!(mib(3.0 * 1048576.0), "3.00");
        let s = Summary::of(&[2e6, 4e6, 3e6]).unwrap();
        assert_eq!(median_min(Some(s), ms), "3.00 / 2.00");
        assert_eq!(median_min(None, ms), "n/a");
    }

    #[test]
    fn csv_quotes_what_needs_quoting() {
        let mut c = Csv::new(&["a", "b"]);
        c.row(["1", "plain"]);
        c.row(["x,y", "say \"hi\""]);
        c.row([cell(Some(5)), cell(None::<u64>)]);
        assert_eq!(c.text, "a,b\n1,plain\n\"x,y\",\"say \"\"hi\"\"\"\n5,\n");
    }

    #[test]
    fn csv_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.csv");
        let mut c = Csv::new(&["a"]);
        c.row([1]);
        c.write(&p).unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "a\n1\n");
    }

    #[test]
    #[should_panic(expected = "CSV row width")]
    fn csv_rejects_ragged_rows() {
        Csv::new(&["a", "b"]).row(["1"]);
    }
}
