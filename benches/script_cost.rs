//! What one decision costs Redis in instructions, counted by callgrind: exact and repeatable,
//! whatever else the machine is doing (the load benchmark's CPU figures move with it).
//!
//!     cargo bench --bench script_cost
//!     SLIDEGATE_COST_KEEP=/tmp/cost cargo bench --bench script_cost -- 32   # keep the profiles
//!     SLIDEGATE_COST_SCRIPT=/tmp/other.lua cargo bench --bench script_cost   # another version
//!     SLIDEGATE_COST_REDIS_CONFIG="zset-max-listpack-entries 16" cargo bench --bench script_cost
//!     SLIDEGATE_COST_LOG_FORMAT=sorted-set cargo bench --bench script_cost   # the older log
//!
//! For each case it starts `redis-server` under `valgrind --tool=callgrind` with
//! instrumentation off, loads the script (as a function, and as the script slidegate falls back
//! to where functions are refused), feeds a few warm-up calls, then turns instrumentation on for
//! the measured calls only (fed by `redis-cli --pipe`, as slidegate sends them: one `user`
//! descriptor per request, 1,000,000 a minute, or three on logs of their own) and prints Redis's
//! instructions per decision (per request).
//! Needs valgrind (`callgrind_control`, `callgrind_annotate`) and redis-server.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::disallowed_methods,
    clippy::too_many_lines
)]

#[allow(dead_code)] // shared with the tests; the bench uses part of it
#[path = "../tests/common/redis.rs"]
mod redis_proc;

#[path = "common/callgrind.rs"]
mod callgrind;

#[path = "common/redis_settings.rs"]
mod redis_settings;

use std::io::Write;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use slidegate::store::redis::Library;

/// How the script is called.
#[derive(Clone, Copy)]
enum Form {
    /// `FCALL` of the loaded library: what slidegate does.
    Function,
    /// `FCALL` of the library's spread function, one key declared and all passed as arguments:
    /// what slidegate sends a cluster master for requests of several of its slots.
    Spread,
    /// `EVALSHA` of the same code: slidegate's fallback where `FUNCTION LOAD` is refused.
    Script,
}

/// Whose logs a case's calls write.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Users {
    /// Each call takes users of its own: every log is new.
    Fresh,
    /// Every call takes the same users: their logs hold entries.
    Same,
    /// Each measured call takes the users of one fill call: a second call on logs of one entry
    /// (calls == fill).
    Again,
}

/// One measured case: requests per call and descriptors per request, whose logs they write,
/// and how many calls.
struct Case {
    name: &'static str,
    per_call: usize,
    descriptors: usize,
    users: Users,
    calls: usize,
    /// The rule's window: calls come 1 ms apart, so a window shorter than the calls lets one
    /// entry per log leave the window on each call (the trim has work to do).
    window_ms: u64,
    /// Calls on the measured keys before measuring (the logs fill first).
    fill: usize,
    /// More windows of the rule, ":limit:window_ms" each (such a rule goes the script's
    /// general path), or "".
    more_windows: &'static str,
    /// Each request's hits: more than one (tokens) goes the general path.
    hits: u64,
}

/// Calls of 32 requests, each the second on a log of one entry written by the fill.
const fn second_call(name: &'static str, more_windows: &'static str) -> Case {
    Case {
        name,
        per_call: 32,
        descriptors: 1,
        users: Users::Again,
        calls: 100,
        window_ms: 60_000,
        fill: 100,
        more_windows,
        hits: 1,
    }
}

/// Calls before the fill and the measured ones, on keys of their own ("warm"): the library's
/// helpers and caches made, Redis's buffers grown. Call numbers count on from them.
const WARM_UP_CALLS: usize = 5;

/// One hot descriptor (a limit every request shares), one request per call, its log holding
/// `entries` entries and its oldest leaving on every call.
const fn hot_log(name: &'static str, entries: usize) -> Case {
    Case {
        name,
        per_call: 1,
        descriptors: 1,
        users: Users::Same,
        calls: 100,
        window_ms: entries as u64,
        fill: entries,
        more_windows: "",
        hits: 1,
    }
}

const CASES: [Case; 13] = [
    Case {
        name: "new descriptors, one request per call",
        per_call: 1,
        descriptors: 1,
        users: Users::Fresh,
        calls: 3_200,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 1,
    },
    Case {
        name: "new descriptors, 32 requests per call",
        per_call: 32,
        descriptors: 1,
        users: Users::Fresh,
        calls: 100,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 1,
    },
    second_call(
        "logs of one entry (a second call), 32 requests per call",
        "",
    ),
    second_call(
        "two windows (the general path), logs of one entry, 32 requests per call",
        ":2000000:3600000",
    ),
    Case {
        name: "logs of about 100 entries, 32 requests per call",
        per_call: 32,
        descriptors: 1,
        users: Users::Same,
        calls: 100,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 1,
    },
    Case {
        name: "logs of 50 entries, one leaving per call, 32 requests per call",
        per_call: 32,
        descriptors: 1,
        users: Users::Same,
        calls: 100,
        window_ms: 50,
        fill: 50,
        more_windows: "",
        hits: 1,
    },
    // The load bench's steady state after a minute (`SLIDEGATE_BENCH_WARM_SECS=65`): each
    // user's log holds about ten entries and its oldest leaves the window on every call.
    Case {
        name: "logs of 10 entries, one leaving per call, 32 requests per call",
        per_call: 32,
        descriptors: 1,
        users: Users::Same,
        calls: 100,
        window_ms: 10,
        fill: 10,
        more_windows: "",
        hits: 1,
    },
    // Three descriptors per request, each on a log of its own: a call carries at most 32
    // descriptors, so 10 such requests.
    Case {
        name: "three new descriptors per request, 10 requests per call",
        per_call: 10,
        descriptors: 3,
        users: Users::Fresh,
        calls: 100,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 1,
    },
    Case {
        name: "three descriptors per request on logs of about 100 entries, 10 requests per call",
        per_call: 10,
        descriptors: 3,
        users: Users::Same,
        calls: 100,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 1,
    },
    // A token budget: five hits a request (a weighted log), on logs of about 100 entries.
    Case {
        name: "weighted requests (5 hits) on logs of about 100 entries, 32 requests per call",
        per_call: 32,
        descriptors: 1,
        users: Users::Same,
        calls: 100,
        window_ms: 60_000,
        fill: 0,
        more_windows: "",
        hits: 5,
    },
    hot_log("one hot log of 100 entries, one leaving per call", 100),
    hot_log("one hot log of 1,000 entries, one leaving per call", 1_000),
    hot_log(
        "one hot log of 10,000 entries, one leaving per call",
        10_000,
    ),
];

/// One command in RESP, as `redis-cli --pipe` takes it.
fn resp(args: &[String]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n{a}\r\n", a.len()).as_bytes());
    }
    out
}

/// `calls` calls of `case`, numbered from `first_call` (each call 1 ms after the previous).
fn commands(
    case: &Case,
    head: &[String],
    spread: bool,
    first_call: usize,
    calls: usize,
    tag: &str,
) -> Vec<u8> {
    let mut out = Vec::new();
    for c in first_call..first_call + calls {
        out.extend(resp(&call_args(case, head, spread, c, tag)));
    }
    out
}

/// Call number `c` of `case`: the command and its arguments.
fn call_args(case: &Case, head: &[String], spread: bool, c: usize, tag: &str) -> Vec<String> {
    let mut args = head.to_vec();
    // numkeys, the keys, then ARGV[1], the number of requests.
    args.push((case.per_call * case.descriptors).to_string());
    for r in 0..case.per_call {
        let user = match case.users {
            Users::Same => r,
            Users::Fresh => c * case.per_call + r,
            // The measured calls come after the fill (see `measure`), one for one.
            Users::Again if c >= WARM_UP_CALLS + case.fill => (c - case.fill) * case.per_call + r,
            Users::Again => c * case.per_call + r,
        };
        for d in 0..case.descriptors {
            args.push(format!("rl:{{bench:{tag}:user=u{user}:d{d}}}:log"));
        }
    }
    // The number of requests and the call's time, then per request: shape (4 n + mode, final:
    // 1); hits, rule (role:ban_ms:buckets:flags:limit:window_ms).
    let now = 1_767_225_600_000u64 + c as u64;
    args.extend([case.per_call.to_string(), now.to_string()]);
    for _ in 0..case.per_call {
        args.push((4 * case.descriptors + 1).to_string());
        for _ in 0..case.descriptors {
            args.extend([
                case.hits.to_string(),
                format!(
                    "0:0:0:{}:1000000:{}{}",
                    log_flags(),
                    case.window_ms,
                    case.more_windows
                ),
            ]);
        }
    }
    if spread {
        // One declared key (the first), then what was numkeys becomes ARGV[1].
        let first = args[head.len() + 1].clone();
        args.splice(head.len()..head.len(), ["1".to_string(), first]);
    }
    args
}

/// The rule's flags: 2 (a sorted-set log) with `SLIDEGATE_COST_LOG_FORMAT=sorted-set`, else 0
/// (a compact log).
fn log_flags() -> u8 {
    match std::env::var("SLIDEGATE_COST_LOG_FORMAT").as_deref() {
        Ok("sorted-set") => 2,
        Ok("compact") | Err(_) => 0,
        Ok(other) => panic!("SLIDEGATE_COST_LOG_FORMAT={other}: compact or sorted-set"),
    }
}

/// Feeds `commands` to Redis and checks that none was answered with an error.
fn pipe(port: u16, commands: &[u8]) {
    let mut child = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "--pipe"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("redis-cli");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(commands)
        .expect("commands");
    let out = child.wait_with_output().expect("redis-cli");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("errors: 0,"), "redis-cli --pipe: {text}");
}

/// A process that is stopped when dropped: a failed check leaves no Redis running under valgrind.
struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Redis's instructions per decision for `case` in `form`.
fn measure(case: &Case, form: Form, library: &Library, dir: &Path) -> u64 {
    let port = redis_proc::free_port();
    let out_file = dir.join(format!("callgrind.{port}.out"));
    let mut redis = Stopped(
        Command::new("valgrind")
            .args(["--tool=callgrind", "--instr-atstart=no"])
            .arg(format!("--callgrind-out-file={}", out_file.display()))
            .args(["redis-server", "--port", &port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("valgrind (Debian's valgrind package)"),
    );
    redis_proc::wait_until(
        "redis-server under valgrind",
        Duration::from_secs(60),
        || redis_proc::command(port, "PING").is_ok_and(|r| r.starts_with("+PONG")),
    );
    let cli = |args: &[&str]| {
        let mut all = vec!["-p".to_string(), port.to_string()];
        all.extend(args.iter().map(|a| (*a).to_string()));
        let all: Vec<&str> = all.iter().map(String::as_str).collect();
        callgrind::run("redis-cli", &all).trim().to_string()
    };
    // SLIDEGATE_COST_REDIS_CONFIG: Redis settings as name and value pairs, for what a setting
    // changes in the script's cost.
    for (name, value) in redis_settings::from_env("SLIDEGATE_COST_REDIS_CONFIG") {
        assert_eq!(
            cli(&["CONFIG", "SET", &name, &value]),
            "OK",
            "CONFIG SET {name} {value}"
        );
    }
    let head: Vec<String> = match form {
        Form::Function | Form::Spread => {
            let name = cli(&["FUNCTION", "LOAD", "REPLACE", &library.code]);
            assert_eq!(name, &*library.function, "FUNCTION LOAD");
            match form {
                Form::Spread => vec!["FCALL".into(), library.spread.to_string()],
                _ => vec!["FCALL".into(), name],
            }
        }
        Form::Script => {
            let sha = cli(&["SCRIPT", "LOAD", &library.script_code]);
            assert_eq!(sha.len(), 40, "SCRIPT LOAD: {sha}");
            vec!["EVALSHA".into(), sha]
        }
    };
    let spread = matches!(form, Form::Spread);
    pipe(
        port,
        &commands(case, &head, spread, 0, WARM_UP_CALLS, "warm"),
    );
    if case.fill > 0 {
        pipe(
            port,
            &commands(case, &head, spread, WARM_UP_CALLS, case.fill, "run"),
        );
    }
    let pid = redis.0.id().to_string();
    callgrind::run("callgrind_control", &["-i", "on", &pid]);
    pipe(
        port,
        &commands(
            case,
            &head,
            spread,
            WARM_UP_CALLS + case.fill,
            case.calls,
            "run",
        ),
    );
    callgrind::run("callgrind_control", &["-i", "off", &pid]);
    // One more call, its reply read: every request of these cases is admitted and records
    // (a request that failed inside its call answers -1, which `redis-cli --pipe` does not
    // count as an error).
    let next = call_args(
        case,
        &head,
        spread,
        WARM_UP_CALLS + case.fill + case.calls,
        "run",
    );
    let next: Vec<&str> = next.iter().map(String::as_str).collect();
    let values = redis_proc::fcall_lines(port, &next);
    let reply = values.join(" ");
    // The call's time, then per request: its length, then per descriptor flags 5 (fits,
    // recorded), entry, and a count and a reset per window.
    let windows = 1 + case.more_windows.matches(':').count() / 2;
    let per_descriptor = 2 + 2 * windows;
    let length = per_descriptor * case.descriptors;
    assert_eq!(
        values.len(),
        1 + case.per_call * (1 + length),
        "{}: {reply}",
        case.name
    );
    for request in values[1..].chunks(1 + length) {
        let flags = request
            .iter()
            .skip(1)
            .step_by(per_descriptor)
            .take(case.descriptors);
        assert!(
            request[0] == length.to_string() && flags.clone().all(|f| *f == "5"),
            "{}: {request:?}",
            case.name
        );
    }
    let _ = redis_proc::command(port, "SHUTDOWN NOSAVE");
    let _ = redis.0.wait();
    let (_, total) = callgrind::annotate(&out_file, &[]);
    total / (case.per_call * case.calls) as u64
}

fn main() {
    // `cargo bench` passes --bench; a name filter picks cases.
    let only: String = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .unwrap_or_default();
    // SLIDEGATE_COST_KEEP=<dir>: keep callgrind's files there, for callgrind_annotate.
    let keep = std::env::var_os("SLIDEGATE_COST_KEEP").map(std::path::PathBuf::from);
    let dir = keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("slidegate-script-cost-{}", std::process::id()))
    });
    std::fs::create_dir_all(&dir).expect("scratch dir");
    // SLIDEGATE_COST_SCRIPT=<file>: measure another version of the script (written like
    // the joined parts of `lua/`, taking the same arguments) instead of the built-in one, without a
    // rebuild.
    let library = match std::env::var_os("SLIDEGATE_COST_SCRIPT") {
        Some(path) => {
            let source = std::fs::read_to_string(&path).expect("read SLIDEGATE_COST_SCRIPT");
            println!("script: {}", Path::new(&path).display());
            Library::from_source(&source)
        }
        None => Library::new(),
    };
    println!("redis-server instructions per decision (callgrind, measured calls only)\n");
    println!(
        "| case | FCALL (slidegate) | FCALL of the spread function (a cluster master's slots) | EVALSHA (the fallback) |"
    );
    println!("|---|---|---|---|");
    for case in CASES.iter().filter(|c| c.name.contains(only.as_str())) {
        let function = measure(case, Form::Function, &library, &dir);
        let spread = measure(case, Form::Spread, &library, &dir);
        let script = measure(case, Form::Script, &library, &dir);
        println!("| {} | {function} | {spread} | {script} |", case.name);
    }
    if keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
}
