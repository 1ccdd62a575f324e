//! The usual `process_*` metrics, read from `/proc/self` at scrape time (Linux; elsewhere, or
//! when a file cannot be read, the metric is left out rather than reported wrong).

use std::fmt::Write;

/// Clock ticks per second of `/proc/<pid>/stat` times: 100 on every Linux this runs on (the
/// kernel's USER_HZ), which is what the Prometheus clients assume as well.
const TICKS_PER_SECOND: f64 = 100.0;

/// The lines, in the text that both formats share; `total_suffix_in_type` says how a counter's
/// `# TYPE` line names it (OpenMetrics: without `_total`; Prometheus text: with it).
pub fn render(total_suffix_in_type: bool) -> String {
    let mut out = String::new();
    let stat = std::fs::read_to_string("/proc/self/stat").ok();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .as_deref()
        .and_then(|s| s.rsplit_once(')'))
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    // After `)`: state is field 0, utime 11, stime 12, starttime 19, vsize 20.
    let number = |i: usize| fields.get(i).and_then(|v| v.parse::<f64>().ok());
    if let (Some(user), Some(system)) = (number(11), number(12)) {
        let seconds = (user + system) / TICKS_PER_SECOND;
        let type_name = if total_suffix_in_type {
            "process_cpu_seconds_total"
        } else {
            "process_cpu_seconds"
        };
        let _ = writeln!(
            out,
            "# HELP {type_name} Total user and system CPU time spent in seconds.\n# TYPE {type_name} counter\nprocess_cpu_seconds_total {seconds}"
        );
    }
    if let (Some(start_ticks), Some(boot)) = (number(19), boot_time_seconds()) {
        gauge(
            &mut out,
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds.",
            boot + start_ticks / TICKS_PER_SECOND,
        );
    }
    if let Some(vsize) = number(20) {
        gauge(
            &mut out,
            "process_virtual_memory_bytes",
            "Virtual memory size in bytes.",
            vsize,
        );
    }
    if let Some(rss) = status_kib("VmRSS:") {
        gauge(
            &mut out,
            "process_resident_memory_bytes",
            "Resident memory size in bytes.",
            rss * 1024.0,
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        #[allow(clippy::cast_precision_loss)] // a count of open files
        let open = fds.count() as f64;
        gauge(
            &mut out,
            "process_open_fds",
            "Number of open file descriptors.",
            open,
        );
    }
    if let Some(max) = max_open_files() {
        gauge(
            &mut out,
            "process_max_fds",
            "Maximum number of open file descriptors.",
            max,
        );
    }
    out
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
    );
}

fn boot_time_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    stat.lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
}

fn status_kib(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

fn max_open_files() -> Option<f64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::disallowed_methods)] // a test's deadline, not a limiter's time
    fn reads_this_process() {
        // CPU time counts in ticks of 10 ms: a test binary run alone may not have used one
        // yet. Work until it has (the reading must move), within a deadline.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut spin = 0u64;
        let text = loop {
            let text = render(false);
            if !text.contains("process_cpu_seconds_total 0\n") {
                break text;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "CPU time never moved:\n{text}"
            );
            for i in 0..1_000_000u64 {
                spin = std::hint::black_box(spin.wrapping_mul(31).wrapping_add(i));
            }
        };
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_start_time_seconds ",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} in:\n{text}"));
            let value: f64 = line[name.len()..].parse().expect("a number");
            assert!(value > 0.0, "{line}");
        }
        assert!(text.contains("# TYPE process_cpu_seconds counter"));
        assert!(render(true).contains("# TYPE process_cpu_seconds_total counter"));
    }
}
