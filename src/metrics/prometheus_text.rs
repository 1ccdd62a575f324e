//! The reference server's exposition: Prometheus text format 0.0.4, with counters named as its
//! statsd-exporter mapping names them (`ratelimit_service_rate_limit_over_limit`, no `_total`).

use std::collections::HashSet;

/// Rewrites OpenMetrics text (as `prometheus_client` writes it) into the Prometheus text format:
/// a counter family `x` exposes its sample as `x`, not `x_total`; `# UNIT`, `_created` and
/// `# EOF` lines go. Gauges and histograms read the same in both formats.
pub fn from_open_metrics(open_metrics: &str) -> String {
    let mut counters: HashSet<&str> = HashSet::new();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some(name) = rest.strip_suffix(" counter") {
                counters.insert(name);
            }
            out.push_str(line);
        } else if line.starts_with('#') {
            out.push_str(line);
        } else {
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let (name, rest) = line.split_at(name_end);
            if let Some(family) = name.strip_suffix("_created")
                && counters.contains(family)
            {
                continue;
            }
            match name.strip_suffix("_total") {
                Some(family) if counters.contains(family) => out.push_str(family),
                _ => out.push_str(name),
            }
            out.push_str(rest);
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_lose_total_and_eof_goes() {
        let open_metrics = "# HELP a_hits Hits.\n# TYPE a_hits counter\na_hits_total{domain=\"d\"} 3\na_hits_created 1.0\n# TYPE lat histogram\nlat_bucket{le=\"0.1\"} 1\nlat_sum 0.5\nlat_count 1\n# TYPE other_total gauge\nother_total 2\n# EOF\n";
        assert_eq!(
            from_open_metrics(open_metrics),
            "# HELP a_hits Hits.\n# TYPE a_hits counter\na_hits{domain=\"d\"} 3\n# TYPE lat histogram\nlat_bucket{le=\"0.1\"} 1\nlat_sum 0.5\nlat_count 1\n# TYPE other_total gauge\nother_total 2\n"
        );
    }
}
