//! One Prometheus scraper for every test: the text format parsed once
//! (`prometheus-parse`), series read by name and labels, and a name the scrape does not
//! declare is a failure — a renamed or unregistered metric must fail the test, not read as 0.

use prometheus_parse::{Sample, Value};

/// A parsed `/metrics` answer.
pub struct Scrape {
    pub parsed: prometheus_parse::Scrape,
}

/// The text of a `/metrics` scrape at `url`. A connection the server closed under a reused
/// keep-alive (a container restarted by a fault, say) is retried twice on a new one; an
/// answer that never comes fails the test.
pub async fn scrape_text(client: &reqwest::Client, url: &str) -> String {
    let mut last = None;
    for _ in 0..3 {
        match client.get(url).send().await {
            Ok(r) => return r.text().await.unwrap(),
            Err(e) => last = Some(e),
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("scraping {url}: {last:?}")
}

impl Scrape {
    /// Parse exposition text; invalid text fails the test.
    pub fn parse(text: &str) -> Scrape {
        let lines = text.lines().map(|l| Ok(l.to_string()));
        Scrape {
            parsed: prometheus_parse::Scrape::parse(lines).expect("valid exposition format"),
        }
    }

    /// Scrape `url` and parse it.
    pub async fn get(client: &reqwest::Client, url: &str) -> Scrape {
        Scrape::parse(&scrape_text(client, url).await)
    }

    /// Whether the scrape declares `name` (its `# HELP`/`# TYPE`, or a sample of it; a
    /// counter may be named with or without `_total`).
    pub fn declares(&self, name: &str) -> bool {
        let bare = name.strip_suffix("_total").unwrap_or(name);
        self.parsed.docs.contains_key(name)
            || self.parsed.docs.contains_key(bare)
            || self
                .parsed
                .samples
                .iter()
                .any(|s| s.metric == name || s.metric == bare)
    }

    /// The samples of `name` whose labels include every `(label, value)` of `labels`.
    /// Panics when the scrape does not declare `name` at all.
    pub fn samples<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        assert!(
            self.declares(name),
            "the scrape has no metric named {name} (renamed, or never registered?)"
        );
        self.parsed
            .samples
            .iter()
            .filter(move |s| s.metric == name)
            .filter(move |s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
    }

    /// The sum of the matching samples' values (0 when the metric is declared but no series
    /// matches yet). Panics when the scrape does not declare `name`.
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples(name, labels).filter_map(value).sum()
    }

    /// The one matching series' value, `None` while it has not been exposed. Panics when the
    /// scrape does not declare `name`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples(name, labels).find_map(value)
    }
}

fn value(s: &Sample) -> Option<f64> {
    match s.value {
        Value::Gauge(v) | Value::Counter(v) | Value::Untyped(v) => Some(v),
        _ => None,
    }
}

/// The sum of `name`'s samples whose labels, written `k="v"`, contain every one of `labels`
/// (substrings, e.g. `"engine-1"` or `outcome="ok"`), from exposition text. Panics when the
/// text does not declare `name`.
pub fn sum_metric(text: &str, name: &str, labels: &[&str]) -> f64 {
    let scrape = Scrape::parse(text);
    scrape
        .samples(name, &[])
        .filter(|s| {
            let mut pairs: Vec<String> = s
                .labels
                .iter()
                .map(|(k, v)| format!("{k}=\"{v}\""))
                .collect();
            pairs.sort();
            let written = pairs.join(",");
            labels.iter().all(|want| written.contains(want))
        })
        .filter_map(value)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP quantmesh_x_total X.\n# TYPE quantmesh_x_total counter\nquantmesh_x_total{engine=\"a\"} 2\nquantmesh_x_total{engine=\"b\"} 3\n# HELP quantmesh_g G.\n# TYPE quantmesh_g gauge\nquantmesh_g 7\n";

    #[test]
    fn series_are_read_by_name_and_labels() {
        let s = Scrape::parse(TEXT);
        assert_eq!(s.sum("quantmesh_x_total", &[]), 5.0);
        assert_eq!(s.sum("quantmesh_x_total", &[("engine", "b")]), 3.0);
        assert_eq!(s.value("quantmesh_x_total", &[("engine", "c")]), None);
        assert_eq!(s.value("quantmesh_g", &[]), Some(7.0));
        assert_eq!(sum_metric(TEXT, "quantmesh_x_total", &["\"a\""]), 2.0);
        assert_eq!(
            sum_metric(TEXT, "quantmesh_x_total", &["engine=\"b\""]),
            3.0
        );
        assert_eq!(sum_metric(TEXT, "quantmesh_x_total", &[]), 5.0);
        assert_eq!(sum_metric(TEXT, "quantmesh_g", &[]), 7.0);
    }

    #[test]
    #[should_panic(expected = "no metric named quantmesh_renamed")]
    fn a_missing_metric_fails() {
        Scrape::parse(TEXT).sum("quantmesh_renamed", &[]);
    }

    #[test]
    #[should_panic(expected = "no metric named quantmesh_renamed")]
    fn a_missing_metric_fails_in_text_too() {
        sum_metric(TEXT, "quantmesh_renamed", &[]);
    }
}
