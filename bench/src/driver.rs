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

/// The first cells of a row of an experiment with [`Contender`]s: the run's place in the
/// run, its repetition (both empty for a peer that never ran) and the VMM.
pub type RunHead = (String, String, String);

impl<'c, 'a: 'c, S: 'c> Columns<'c, PeerRow<'a, RunHead, S>> {
    /// The `run`, `rep` and `hypervisor` columns.
    pub fn run_heads(self) -> Self {
        self.head("run", |h: &RunHead| h.0.clone())
            .head("rep", |h| h.1.clone())
            .head("hypervisor", |h| h.2.clone())
    }
}

/// The CSV rows of `runs` in the order they ran, then one for each peer in `missing`.
pub fn contender_rows<'a, C: Contender, S>(
    runs: &'a Runs<C, Outcome<S>>,
    missing: &Missing,
) -> Vec<PeerRow<'a, RunHead, S>> {
    let mut rows = PeerRow::of_runs(runs, |i, rep, c: &C| {
        ((i + 1).to_string(), (rep + 1).to_string(), c.name())
    });
    rows.extend(
        missing
            .iter()
            .map(|(name, why)| PeerRow::missing((String::new(), String::new(), name.clone()), why)),
    );
    rows
}

/// The measured results of each configuration, failed and unmade runs left out.
pub fn measured_per_config<C, S>(runs: &Runs<C, Outcome<S>>) -> Vec<Vec<&S>> {
    super::qemu::measured_per_config(&runs.runs, runs.configs.len())
}

/// A configuration of an experiment that runs Musubi beside peer VMMs: Musubi's failure
/// ends the experiment, a peer's puts that peer out of it.
pub trait Contender {
    fn name(&self) -> String;
    fn is_peer(&self) -> bool;
}

/// One discarded run of each configuration with `one`: Musubi's failure ends the
/// experiment; a peer that fails is out for good, with no runs and one entry in `missing`
/// (its CSV row) that says why.
pub fn warm_up<C: Contender, S>(
    configs: &[C],
    missing: &mut Missing,
    mut one: impl FnMut(&C) -> Result<S, String>,
) -> Result<Vec<Standing>, String> {
    let mut standing: Vec<Standing> = configs.iter().map(|_| Standing::default()).collect();
    for (c, st) in configs.iter().zip(standing.iter_mut()) {
        let what = format!("{} warm-up run", c.name());
        if c.is_peer() {
            if let Outcome::PeerFailed(_) = st.run(&what, || one(c)) {
                missing.push((c.name(), st.unavailable.clone().unwrap_or_default()));
            }
        } else {
            one(c).map_err(|e| format!("{what}: {e}"))?;
        }
    }
    Ok(standing)
}

/// The runs of an experiment with [`Contender`]s; a peer's may have failed or not been made.
pub type ContenderRuns<C, S> = Runs<C, Outcome<S>>;

/// Every configuration's `reps` runs with `one`, interleaved; a peer that has dropped out
/// (at its warm-up or a failed run) makes none.
pub fn measure_contenders<C: Contender, S>(
    h: &Harness,
    configs: Vec<C>,
    mut standing: Vec<Standing>,
    reps: usize,
    mut one: impl FnMut(&C) -> Result<S, String>,
) -> Result<(ContenderRuns<C, S>, Vec<Standing>), String> {
    let runs = Runs::measure_indexed(h, configs, reps, C::name, |rep, i, c| {
        if !c.is_peer() {
            return one(c).map(Outcome::Measured);
        }
        Ok(standing[i].run(&format!("{} run {}", c.name(), rep + 1), || one(c)))
    })?;
    Ok((runs, standing))
}

/// Prints why each peer that dropped out did, and each listed peer that never was a
/// configuration.
pub fn print_dropped<C: Contender>(configs: &[C], standing: &[Standing], missing: &Missing) {
    for (c, st) in configs.iter().zip(standing) {
        st.print_as(&c.name());
    }
    for (name, why) in missing {
        if !configs.iter().any(|c| c.name() == *name) {
            println!("{name}: unavailable, no comparison: {why}");
        }
    }
}

/// A chart's title, `musubi bench EXPERIMENT`, naming the configurations without bars (no
/// measured run, `measured` false) and the peers in `missing`, so the chart is not read as
/// Musubi alone by choice.
pub fn chart_title<'c, C: Contender + 'c>(
    experiment: &str,
    measured: impl IntoIterator<Item = (&'c C, bool)>,
    missing: &Missing,
) -> String {
    let mut absent: Vec<String> = measured
        .into_iter()
        .filter(|(_, m)| !m)
        .map(|(c, _)| c.name())
        .collect();
    for (name, _) in missing {
        if !absent.contains(name) {
            absent.push(name.clone());
        }
    }
    match absent.as_slice() {
        [] => format!("musubi bench {experiment}"),
        names => format!(
            "musubi bench {experiment} ({} unavailable, see {experiment}.csv)",
            names.join(", ")
        ),
    }
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

    /// A figure shown beside the others for comparison, judged against nothing.
    pub fn compared(&mut self, what: impl Into<String>, ours: String) {
        self.push(Figure {
            what: what.into(),
            ours,
            reference: "(comparison)".into(),
            source: "same run".into(),
            met: None,
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

    struct Vm(&'static str, bool);

    impl Contender for Vm {
        fn name(&self) -> String {
            self.0.into()
        }
        fn is_peer(&self) -> bool {
            self.1
        }
    }

    #[test]
    fn a_failing_peer_drops_out_and_a_failing_musubi_ends_the_experiment() {
        let h = Harness {
            out: std::env::temp_dir(),
            quick: true,
        };
        let configs = vec![Vm("musubi", false), Vm("peer", true), Vm("later", true)];
        let mut missing = Missing::new();
        let standing = warm_up(&configs, &mut missing, |c| {
            if c.0 == "peer" {
                Err("no device".to_string())
            } else {
                Ok(())
            }
        })
        .unwrap();
        assert_eq!(
            missing,
            [(
                "peer".to_string(),
                "peer warm-up run failed: no device".to_string()
            )]
        );
        let mut later = 0;
        let (runs, standing) = measure_contenders(&h, configs, standing, 2, |c| {
            if c.0 == "later" {
                later += 1;
                return Err("crashed".to_string());
            }
            Ok(c.0)
        })
        .unwrap();
        assert_eq!(later, 1, "a peer ran again after it failed");
        let made: Vec<&str> = runs
            .runs
            .iter()
            .filter_map(|r| r.2.measured().copied())
            .collect();
        assert_eq!(made, ["musubi", "musubi"]);
        assert_eq!(
            standing[2].unavailable.as_deref(),
            Some("later run 1 failed: crashed")
        );
        assert_eq!(
            chart_title(
                "x",
                runs.configs.iter().map(|c| (c, c.0 == "musubi")),
                &missing
            ),
            "musubi bench x (peer, later unavailable, see x.csv)"
        );
        let ended = warm_up(&runs.configs, &mut missing, |c: &Vm| {
            if c.is_peer() {
                Ok(())
            } else {
                Err("no KVM".to_string())
            }
        });
        assert_eq!(ended.err().as_deref(), Some("musubi warm-up run: no KVM"));
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
