//! Reading tokenonce's `/metrics` by its admin address: a scrape, one sample, the sum of a
//! family, a value waited for; and the names of series the tests read often.

use std::time::{Duration, Instant};

/// Scrapes `{admin}/metrics`.
pub async fn scrape(admin: &str) -> String {
    reqwest::get(format!("{admin}/metrics")).await.unwrap().text().await.unwrap()
}

/// The value of one sample line `name{labels} value` of `text` (labels as written, in
/// order); 0 when there is none.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// The sum of every sample of `family` (its `family{labels} value` lines) in `text`.
pub fn family_sum(text: &str, family: &str) -> f64 {
    let prefix = format!("{family}{{");
    text.lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Scrapes `admin` until `series` reads `value` (every 20 ms, bounded by `within`); what it
/// read last.
pub async fn reaches_within(admin: &str, series: &str, value: f64, within: Duration) -> f64 {
    let deadline = Instant::now() + within;
    loop {
        let got = sample(&scrape(admin).await, series);
        if got == value || Instant::now() >= deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The series of `tokenonce_token_reuse_total` for `route`, `result` and `reason`.
pub fn reuse_series(route: &str, result: &str, reason: &str) -> String {
    format!(r#"tokenonce_token_reuse_total{{reason="{reason}",result="{result}",route="{route}"}}"#)
}
