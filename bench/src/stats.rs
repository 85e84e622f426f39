//! Summaries of repeated measurements. Medians and minima, not means: on a noisy machine
//! (nested KVM, two cores) a few runs are delayed by the host, and those outliers would
//! drag a mean while leaving the median and the minimum honest.

/// Median of `xs` (the mean of the two middle values for an even count); `None` if empty
/// or if any value is NaN, since a NaN would make the order meaningless.
pub fn median(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() || xs.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

pub fn min(xs: &[f64]) -> Option<f64> {
    xs.iter().copied().reduce(f64::min)
}

pub fn max(xs: &[f64]) -> Option<f64> {
    xs.iter().copied().reduce(f64::max)
}

/// The `pct` percentile of `xs` by nearest rank (the smallest value with at least `pct` %
/// of them at or below it); `None` if empty or if any value is NaN.
pub fn percentile(xs: &[f64], pct: f64) -> Option<f64> {
    if xs.is_empty() || xs.iter().any(|x| x.is_nan()) {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = (pct / 100.0 * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// Median, minimum and maximum of one metric over the repetitions of one configuration.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    pub fn of(xs: &[f64]) -> Option<Summary> {
        Some(Summary {
            n: xs.len(),
            median: median(xs)?,
            min: min(xs)?,
            max: max(xs)?,
        })
    }

    /// The same summary in another unit.
    pub fn scaled(self, k: f64) -> Summary {
        Summary {
            n: self.n,
            median: self.median * k,
            min: self.min * k,
            max: self.max * k,
        }
    }
}

/// The order in which to run `reps` repetitions of `configs` configurations: one of each
/// per round (A B A B ...), so that slow drifts of the host (other load, thermal, page
/// cache) hit every configuration alike instead of biasing whichever ran last.
/// Returns `(repetition, configuration)` pairs.
pub fn interleaved(configs: usize, reps: usize) -> Vec<(usize, usize)> {
    (0..reps)
        .flat_map(|r| (0..configs).map(move |c| (r, c)))
        .collect()
}

/// `a / b`, or `None` when the ratio would be meaningless.
pub fn ratio(a: f64, b: f64) -> Option<f64> {
    (b != 0.0 && a.is_finite() && b.is_finite()).then(|| a / b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(2.5));
        assert_eq!(median(&[7.0]), Some(7.0));
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[1.0, f64::NAN]), None);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), Some(50.0));
        assert_eq!(percentile(&xs, 99.0), Some(99.0));
        assert_eq!(percentile(&xs, 100.0), Some(100.0));
        assert_eq!(percentile(&[7.0, 3.0], 99.0), Some(7.0));
        assert_eq!(percentile(&[7.0], 0.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn min_and_max() {
        assert_eq!(min(&[3.0, -1.0, 2.0]), Some(-1.0));
        assert_eq!(max(&[3.0, -1.0, 2.0]), Some(3.0));
        assert_eq!(min(&[]), None);
    }

    #[test]
    fn summary_collects_all_three() {
        let s = Summary::of(&[5.0, 1.0, 9.0, 2.0, 3.0]).unwrap();
        assert_eq!(
            s,
            Summary {
                n: 5,
                median: 3.0,
                min: 1.0,
                max: 9.0
            }
        );
        assert!(Summary::of(&[]).is_none());
    }

    #[test]
    fn schedule_alternates_configurations() {
        assert_eq!(
            interleaved(2, 3),
            vec![(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
        );
        assert!(interleaved(2, 0).is_empty());
    }

    #[test]
    fn ratio_refuses_division_by_zero() {
        assert_eq!(ratio(3.0, 2.0), Some(1.5));
        assert_eq!(ratio(3.0, 0.0), None);
    }
}
