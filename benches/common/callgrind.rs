//! What the callgrind benchmarks (`script_cost`, `server_cost`) share: running the tools and
//! reading a profile's total.

use std::path::Path;
use std::process::Command;

/// Runs `program` and returns its output; a failure stops the benchmark with its stderr.
pub fn run(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program} (valgrind and redis-tools are needed): {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `callgrind_annotate` of `out_file` (with `extra` options), and the profile's total
/// instructions.
pub fn annotate(out_file: &Path, extra: &[&str]) -> (String, u64) {
    let file = out_file.display().to_string();
    let mut args = extra.to_vec();
    args.push(&file);
    let annotated = run("callgrind_annotate", &args);
    let total = annotated
        .lines()
        .find(|l| l.contains("PROGRAM TOTALS"))
        .and_then(|l| l.split_whitespace().next())
        .map(|n| n.replace(',', ""))
        .and_then(|n| n.parse().ok())
        .expect("callgrind_annotate: PROGRAM TOTALS");
    (annotated, total)
}
