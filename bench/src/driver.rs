//! The loop every experiment shares: its configurations times its repetitions with progress,
//! and what the runs measured written out as CSV rows, a chart and verdict lines. An
//! experiment says what it runs and what a row holds; the driver does the rest the same way
//! for all of them, so their files and reports keep one shape.

use super::qemu::{Outcome, Standing};
use super::report::{figures_table, Csv, Figure};
use super::{plot, Harness};
use std::path::PathBuf;

/// The runs of an experiment: its configurations and, in the order they ran, each
/// repetition's result with its repetition number and configuration index.
pub struct Runs<C, R> {
    pub configs: Vec<C>,
    pub runs: Vec<(usize, usize, R)>,
}

impl<C, R> Runs<C, R> {
    /// Runs `reps` repetitions of every configuration interleaved, with progress, stopping
    /// at the first failed run (see [`Harness::run_schedule`]).
    pub fn measure(
        h: &Harness,
        configs: Vec<C>,
        reps: usize,
        name: impl Fn(&C) -> String,
        mut one: impl FnMut(usize, &C) -> Result<R, String>,
    ) -> Result<Runs<C, R>, String> {
        Runs::measure_indexed(h, configs, reps, name, |rep, _, c| one(rep, c))
    }

    /// As [`Runs::measure`], telling `one` the index of the configuration it runs as well,
    /// for experiments that keep state per configuration beside it.
    pub fn measure_indexed(
        h: &Harness,
        configs: Vec<C>,
        reps: usize,
        name: impl Fn(&C) -> String,
        mut one: impl FnMut(usize, usize, &C) -> Result<R, String>,
    ) -> Result<Runs<C, R>, String> {
        let indices: Vec<usize> = (0..configs.len()).collect();
        let runs = h.run_schedule(
            &indices,
            reps,
            |&i| name(&configs[i]),
            |rep, &i| one(rep, i, &configs[i]),
        )?;
        Ok(Runs { configs, runs })
    }

    /// Every run as (repetition, configuration, result), in the order they ran.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &C, &R)> {
        self.runs
            .iter()
            .map(|(rep, c, r)| (*rep, &self.configs[*c], r))
    }

    /// The results of every configuration equal to `c`.
    pub fn of(&self, c: &C) -> Vec<&R>
    where
        C: PartialEq,
    {
        self.runs
            .iter()
            .filter(|r| self.configs[r.1] == *c)
            .map(|r| &r.2)
            .collect()
    }
}

/// One column of a CSV file: its header and how a row's cell is read.
type Column<'c, T> = (&'static str, Box<dyn Fn(&T) -> String + 'c>);

/// The columns of a CSV file an experiment writes, each read from one measured row, so the
/// header and the cells cannot drift apart.
pub struct Columns<'c, T> {
    cols: Vec<Column<'c, T>>,
}

impl<'c, T> Columns<'c, T> {
    pub fn new() -> Columns<'c, T> {
        Columns { cols: Vec::new() }
    }

    pub fn col(mut self, name: &'static str, cell: impl Fn(&T) -> String + 'c) -> Self {
        self.cols.push((name, Box::new(cell)));
        self
    }

    pub fn headers(&self) -> Vec<&'static str> {
        self.cols.iter().map(|c| c.0).collect()
    }

    /// A row's cells in column order.
    pub fn cells(&self, row: &T) -> Vec<String> {
        self.cols.iter().map(|c| (c.1)(row)).collect()
    }

    /// The CSV with one line per row.
    pub fn csv(&self, rows: impl IntoIterator<Item = T>) -> Csv {
        let mut csv = Csv::new(&self.headers());
        for r in rows {
            csv.row(self.cells(&r));
        }
        csv
    }
}

/// Peers that never ran, each with why: one CSV row and one report line each.
pub type Missing = Vec<(String, String)>;

/// One CSV row of an experiment that compares with peers: the run's own cells (`head`), and
/// what it measured, or why a peer gave no figures (the `unavailable` column).
pub struct PeerRow<'a, H, S> {
    pub head: H,
    pub measured: Option<&'a S>,
    pub unavailable: String,
}

impl<'a, H, S> PeerRow<'a, H, S> {
    /// The rows of `runs` in the order they ran, `head` making each one's own cells from its
    /// place in the run, repetition and configuration; runs never made have none.
    pub fn of_runs<C>(
        runs: &'a Runs<C, Outcome<S>>,
        head: impl Fn(usize, usize, &'a C) -> H,
    ) -> Vec<PeerRow<'a, H, S>> {
        runs.runs
            .iter()
            .enumerate()
            .filter_map(|(i, (rep, c, r))| {
                let (measured, unavailable) = match r {
                    Outcome::Measured(s) => (Some(s), String::new()),
                    Outcome::PeerFailed(why) => (None, why.clone()),
                    Outcome::NotMade => return None,
                };
                Some(PeerRow {
                    head: head(i, *rep, &runs.configs[*c]),
                    measured,
                    unavailable,
                })
            })
            .collect()
    }

    /// The row of a peer that never ran: why, and nothing measured.
    pub fn missing(head: H, why: &str) -> PeerRow<'a, H, S> {
        PeerRow {
            head,
            measured: None,
            unavailable: why.to_string(),
        }
    }
}

impl<'c, 'a: 'c, H: 'c, S: 'c> Columns<'c, PeerRow<'a, H, S>> {
    /// A column of the run's own cells.
    pub fn head(self, name: &'static str, cell: impl Fn(&H) -> String + 'c) -> Self {
        self.col(name, move |r: &PeerRow<'a, H, S>| cell(&r.head))
    }

    /// A measured column: empty for a run that measured nothing.
    pub fn measured(self, name: &'static str, cell: impl Fn(&S) -> String + 'c) -> Self {
        self.col(name, move |r: &PeerRow<'a, H, S>| {
            r.measured.map(&cell).unwrap_or_default()
        })
    }

    /// The `unavailable` column: why a peer gave no figures.
    pub fn unavailable(self) -> Self {
        self.col("unavailable", |r: &PeerRow<'a, H, S>| r.unavailable.clone())
    }
}

/// The measured results of each configuration, failed and unmade runs left out.
pub fn measured_per_config<C, S>(runs: &Runs<C, Outcome<S>>) -> Vec<Vec<&S>> {
    super::qemu::measured_per_config(&runs.runs, runs.configs.len())
}

/// Prints each peer that dropped out once, in its own words, and each that never ran.
pub fn print_unavailable<'n, 's>(
    standing: impl IntoIterator<Item = (&'n str, &'s Standing)>,
    missing: &[(String, String)],
) {
    let mut said: Vec<&'s String> = Vec::new();
    for (name, st) in standing {
        if let Some(why) = &st.unavailable {
            if !said.contains(&why) {
                said.push(why);
                println!("{name}: unavailable, no comparison: {why}");
            }
        }
    }
    for (name, why) in missing {
        println!("{name}: unavailable, no comparison: {why}");
    }
}

/// The verdict lines: our figures beside targets, goals and published figures, printed as
/// the figures table (the `MET`/`MISSED` column users and tests read).
#[derive(Default)]
pub struct Verdicts(pub Vec<Figure>);

impl Verdicts {
    pub fn new() -> Verdicts {
        Verdicts::default()
    }

    pub fn push(&mut self, f: Figure) {
        self.0.push(f);
    }

    /// A figure judged against a bound: `met` is unknown when ours is.
    pub fn judged(
        &mut self,
        what: impl Into<String>,
        ours: Option<f64>,
        shown: impl Fn(f64) -> String,
        reference: impl Into<String>,
        source: impl Into<String>,
        met: impl Fn(f64) -> bool,
    ) {
        self.push(Figure {
            what: what.into(),
            ours: ours.map(&shown).unwrap_or_else(|| "n/a".into()),
            reference: reference.into(),
            source: source.into(),
            met: ours.map(met),
        });
    }

    pub fn table(&self) -> String {
        figures_table(&self.0)
    }
}

/// The files an experiment writes into `--out`, in the order it writes them.
pub struct Outputs<'h> {
    h: &'h Harness,
}

impl<'h> Outputs<'h> {
    pub fn new(h: &'h Harness) -> Outputs<'h> {
        Outputs { h }
    }

    pub fn csv(&self, name: &str, csv: &Csv) -> Result<PathBuf, String> {
        self.h.write_csv(name, csv)
    }

    /// A chart of bar panels, lines or both.
    pub fn chart(
        &self,
        name: &str,
        title: &str,
        drawings: &[plot::Drawing],
    ) -> Result<PathBuf, String> {
        let p = self.h.out_file(name);
        plot::chart(&p, title, drawings)?;
        Ok(p)
    }

    pub fn bars(&self, name: &str, title: &str, panels: &[plot::Panel]) -> Result<PathBuf, String> {
        self.h.write_chart(name, title, panels)
    }
}

/// Bars of one metric summarised per configuration: the median, its minimum marked.
pub fn summary_bars<'a, C: 'a>(
    items: impl IntoIterator<Item = (&'a C, Option<super::stats::Summary>)>,
    label: impl Fn(&C) -> String,
) -> Vec<plot::Bar> {
    items
        .into_iter()
        .filter_map(|(c, s)| {
            s.map(|s| plot::Bar {
                label: label(c),
                value: s.median,
                low: Some(s.min),
            })
        })
        .collect()
}

/// Refuses to start an experiment that needs KVM on a machine without it, before any
/// configuration is planned, naming what the experiment would have done with it.
pub fn need_kvm(does: &str) -> Result<(), String> {
    if std::path::Path::new("/dev/kvm").exists() {
        Ok(())
    } else {
        Err(format!(
            "/dev/kvm does not exist: this benchmark {does} and needs KVM"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_write_their_headers_and_cells_in_order() {
        let cols = Columns::new()
            .col("name", |r: &(&str, u32)| r.0.to_string())
            .col("n", |r| r.1.to_string());
        assert_eq!(cols.headers(), ["name", "n"]);
        assert_eq!(cols.cells(&("a", 3)), ["a", "3"]);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.csv");
        cols.csv([("x", 1), ("y,z", 2)]).write(&p).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "name,n\nx,1\n\"y,z\",2\n"
        );
    }

    #[test]
    fn runs_are_found_by_configuration() {
        let h = Harness {
            out: std::env::temp_dir(),
            quick: true,
        };
        let runs = Runs::measure(
            &h,
            vec!["a", "b"],
            2,
            |c| c.to_string(),
            |rep, c| Ok(format!("{c}{rep}")),
        )
        .unwrap();
        assert_eq!(runs.of(&"b"), [&"b0".to_string(), &"b1".to_string()]);
        let order: Vec<String> = runs.iter().map(|(rep, c, _)| format!("{c}{rep}")).collect();
        assert_eq!(order, ["a0", "b0", "a1", "b1"]);
    }

    #[test]
    fn verdicts_judge_known_figures_only() {
        let mut v = Verdicts::new();
        v.judged(
            "x",
            Some(2.0),
            |v| format!("{v:.1}"),
            "<= 3",
            "goal",
            |v| v <= 3.0,
        );
        v.judged(
            "y",
            None,
            |v| format!("{v:.1}"),
            "<= 3",
            "goal",
            |v| v <= 3.0,
        );
        assert_eq!(v.0[0].met, Some(true));
        assert_eq!(v.0[1].ours, "n/a");
        assert_eq!(v.0[1].met, None);
        assert!(v.table().contains("MET"));
    }
}
