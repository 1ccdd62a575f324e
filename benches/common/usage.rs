//! What the timed benchmarks (`load`, `rlqs`) read of the processes they measure: CPU seconds
//! of a process and of Redis, a field of Redis's `INFO`, and numbers from the environment.

use super::redis_proc;

/// The number in the environment variable `name`, or `default` when it is unset or not a number.
pub fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds of a process, user plus system, from `/proc/<pid>/stat` (fields 14 and 15, in
/// clock ticks of 1/100 s, the value on Linux for x86-64 and arm64).
pub fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it start past its ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// The number after `name` (with its colon) in a reply to `INFO`; 0 when it is missing.
pub fn info_field(info: &str, name: &str) -> f64 {
    info.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// CPU seconds of the Redis at `port`, user plus system.
pub fn redis_cpu(port: u16) -> f64 {
    let info = redis_proc::command(port, "INFO cpu").unwrap_or_default();
    info_field(&info, "used_cpu_sys:") + info_field(&info, "used_cpu_user:")
}
