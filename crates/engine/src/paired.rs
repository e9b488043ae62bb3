//! The tuner's statistics over paired rounds: each round gives a candidate one log ratio of
//! its speed over the plain runs around it; these are their means, Student-t intervals and
//! rankings (`tune.rs` decides with them).

/// The mean of `x` and the half-width of its 95% confidence interval (Student's t).
pub(crate) fn mean_interval(x: &[f64]) -> (f64, f64) {
    let n = x.len();
    if n == 0 {
        return (0.0, f64::INFINITY);
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, f64::INFINITY);
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t95(n - 1) * (var / n as f64).sqrt())
}

/// Student's t at 97.5% (two-sided 95%) for `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10,
        2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04,
    ];
    T.get(df.max(1) - 1).copied().unwrap_or(1.96)
}

/// The candidates (indexes past plain decoding's 0) ranked by mean log ratio, best first.
pub(crate) fn ranked(log_ratios: &[Vec<f64>]) -> Vec<usize> {
    let mut order: Vec<usize> = (1..log_ratios.len()).collect();
    order.sort_by(|&a, &b| mean_interval(&log_ratios[b]).0.total_cmp(&mean_interval(&log_ratios[a]).0));
    order
}

/// The paired differences of two candidates' rounds.
pub(crate) fn differences(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

/// A candidate's speed-up with its interval, as a person reads it.
pub(crate) fn show(log_ratios: &[f64]) -> String {
    let (m, h) = mean_interval(log_ratios);
    format!("{:.2}x [{:.2}-{:.2}]", m.exp(), (m - h).exp(), (m + h).exp())
}
