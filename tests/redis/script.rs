//! The script itself: its argument checks, the caches it keeps from call to call, the entries
//! and TTLs it writes, its common paths against the general one, and what its keys cost.

use super::*;

/// sliding_counter memory stays constant: at most one field per bucket that still counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sliding_counter_memory_is_constant() {
    let redis = shared_standalone();
    let domain = unique_domain("constant");
    let config = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    algorithm: sliding_counter\n    buckets: 10\n    rate_limit: {{unit: minute, requests_per_unit: 1000000}}\n"
    );
    let server = TestServer::start(
        &config,
        connect(redis.url(), TEST_TIMEOUT).await,
        LimiterOptions::default(),
    )
    .await;
    // Two minutes of traffic, a request every 0.5 s, 100 hits each.
    for _ in 0..240 {
        server.clock.advance(500);
        let r = server
            .call(request(
                &domain,
                vec![with_hits(descriptor(&[("k", "v")]), 100)],
            ))
            .await;
        assert_eq!(r.overall_code, ok());
    }
    let counters = key::build(
        &domain,
        &[Segment::Value {
            key: "k",
            value: "v",
        }],
        Variant::Configured,
        None,
    )
    .counters();
    let fields: i64 = redis
        .cmd(&format!("HLEN {counters}"))
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("HLEN");
    assert!(
        (1..=11).contains(&fields),
        "{fields} buckets kept for a 10-bucket window"
    );
    assert_eq!(
        redis
            .cmd(&format!(
                "EXISTS {}",
                key::build(
                    &domain,
                    &[Segment::Value {
                        key: "k",
                        value: "v"
                    }],
                    Variant::Configured,
                    None
                )
                .log()
            ))
            .trim(),
        ":0",
        "no log at all"
    );
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_flush_is_recovered_on_standalone_and_cluster() {
    let own = RedisProcess::start(&[]);
    let cluster = RedisCluster::start();
    for (url, ports) in [
        (own.url(), vec![own.port]),
        (
            cluster.url(),
            cluster.nodes.iter().map(|n| n.port).collect(),
        ),
    ] {
        let config = "domain: flush\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 10}\n";
        let server = TestServer::start(
            config,
            connect(url, TEST_TIMEOUT).await,
            LimiterOptions::default(),
        )
        .await;
        assert_eq!(
            server
                .call(request("flush", vec![descriptor(&[("k", "v")])]))
                .await
                .overall_code,
            ok()
        );
        for port in &ports {
            assert!(
                command(*port, "FUNCTION FLUSH")
                    .expect("FUNCTION FLUSH")
                    .starts_with("+OK")
            );
        }
        let r = server
            .call(request("flush", vec![descriptor(&[("k", "v")])]))
            .await;
        assert_eq!(r.overall_code, ok());
        assert_eq!(
            r.statuses[0].limit_remaining, 8,
            "the first hit is still counted after the reload"
        );
        server.stop().await;
    }
}

#[test]
fn malformed_script_arguments_get_an_error_reply() {
    let redis = shared_standalone();
    let cli = |args: &[&str]| node_cli(redis.port, args).join("\n").trim().to_string();
    let library = slidegate::store::redis::Library::new();
    let loaded = cli(&["FUNCTION", "LOAD", "REPLACE", &library.code]);
    assert_eq!(loaded, &*library.function, "FUNCTION LOAD: {loaded}");
    let function: &str = &library.function;
    // One key per descriptor (its log or counters), two with a ban. Arguments: the number of
    // requests, the call's time, then per request: shape (4 x descriptor count + mode), per
    // descriptor hits and the rule "role:ban_ms:buckets:debit:limit:window_ms[:limit:window_ms...]",
    // and a tentative request's prefix.
    let ok = "0:0:0:0:10:1000";
    let request =
        |now: &'static str, shape: &'static str, hits: &'static str, rule: &'static str| {
            vec!["1", "k", "1", now, shape, hits, rule]
        };
    let cases: Vec<Vec<&str>> = vec![
        vec!["0"],
        vec!["1", "k", "0"],
        vec!["1", "k", "2", "1", "5", "1", ok],
        request("x", "5", "1", ok),
        // The call's time: digits only (its text becomes entries' scores as it came).
        request(" 5", "5", "1", ok),
        request("5 ", "5", "1", ok),
        request("1.5", "5", "1", ok),
        request("-1", "5", "1", ok),
        request("1e3", "5", "1", ok),
        // A tentative request (mode 0) ends with the prefix that names its entries.
        vec!["1", "k", "1", "1", "4", "1", ok],
        vec!["1", "k", "1", "1", "4", "1", ok, ""],
        // Mode 3, no descriptor, a shape that is no number.
        request("1", "7", "1", ok),
        request("1", "1", "1", ok),
        request("1", "x", "1", ok),
        request("1", "5", "abc", ok),
        request("1", "5", "1", "9:0:0:0:10:1000"),
        request("1", "5", "1", "0:0:0:4:10:1000"),
        request("1", "5", "1", "0:0:0:0:10:0"),
        request("1", "5", "1", "0:0:0:0:10"),
        request("1", "5", "1", "0:0:0:0"),
        request("1", "5", "1", "0:0:x:0:10:1000"),
        request("1", "5", "1", "0::0:0:10:1000"),
        request("1", "5", "1", "0:0:0:0:10:1000:"),
        request("1", "5", "1", "0:0:0:0:10:1000:5"),
        // A ban takes a second key.
        request("1", "5", "1", "0:500:0:0:10:1000"),
        vec!["2", "k", "k2", "1", "1", "5", "1", ok],
        vec!["1", "k", "1", "1", "5", "1", ok, "extra"],
    ];
    for args in cases {
        let mut full = vec!["FCALL", function];
        full.extend_from_slice(&args);
        let reply = cli(&full);
        // The whole call refused (a bad request count, keys or arguments left over), or its
        // request answered -1 and why.
        let lines: Vec<&str> = reply.lines().collect();
        let refused = reply.starts_with("SLIDEGATE ");
        let request_failed = lines.len() >= 2
            && lines[lines.len() - 2] == "-1"
            && lines[lines.len() - 1].starts_with("SLIDEGATE request ");
        assert!(refused || request_failed, "FCALL {args:?} -> {reply}");
    }
    // A bad request fails before it writes anything, and so does every request after it (where
    // they start can no longer be told); a request before it stands.
    let mut full = vec![
        "FCALL", function, "3", "b1:log", "b2:log", "b3:log", "3", "1000",
    ];
    full.extend_from_slice(&["5", "1", ok]);
    full.extend_from_slice(&["5", "1", "0:0:0:0:10"]);
    full.extend_from_slice(&["5", "1", ok]);
    let reply = cli(&full);
    let lines: Vec<&str> = reply.lines().collect();
    assert_eq!(lines[..6], ["1000", "4", "5", "1", "1", "1000"], "{reply}");
    assert_eq!((lines[6], lines[8]), ("-1", "-1"), "{reply}");
    assert!(lines[7].starts_with("SLIDEGATE request 2: "), "{reply}");
    assert!(
        lines[9].starts_with("SLIDEGATE request 3: not decided"),
        "{reply}"
    );
    assert_eq!(lines.len(), 10, "{reply}");
    assert_eq!(log_entries(redis.port, "b1:log").len(), 1);
    assert_eq!(cli(&["EXISTS", "b2:log", "b3:log"]), "0");
    // And a well-formed call answers the documented layout: the call's time, then per request
    // its length, flags (1 fits, 4 recorded), the entry it recorded, count, reset.
    let call = |key: &str, rule: &str| {
        let mut full = vec!["FCALL", function, "1", key];
        full.extend_from_slice(&["1", "1000", "5", "1", rule]);
        cli(&full).lines().map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(
        call("t:log", "0:0:0:0:10:1000"),
        vec!["1000", "4", "5", "1", "1", "1000"]
    );
    assert_eq!(log_entries(redis.port, "t:log"), [(1000, 1)]);
    // A sorted-set log (flag 2) names its entry by running total, weight, time.
    assert_eq!(
        call("ts:log", "0:0:0:2:10:1000"),
        vec!["1000", "4", "5", "1", "1", "1000"]
    );
    assert_eq!(
        cli(&["ZRANGE", "ts:log", "0", "-1"]),
        "00000000000000000001:1:1000",
        "one weighted entry: running total, weight, time"
    );
    // sliding_counter with 10 buckets of 100 ms: the hit sits in bucket 10 (1,000..1,100), which
    // stops counting at 1,100 + 1,000.
    assert_eq!(
        call("u:cnt", "0:0:10:0:10:1000"),
        vec!["1000", "4", "5", "0", "1", "1100"]
    );
    assert_eq!(
        cli(&["HGETALL", "u:cnt"]).lines().collect::<Vec<_>>(),
        vec!["100:10", "1"]
    );
    // One call, three requests, each decided as if alone and in order: the first meets a key of
    // another type and fails alone (-1 and what Redis said), the second and third share a log
    // with a limit of 1, so the third finds the second's entry and is rejected.
    assert_eq!(cli(&["HSET", "w:log", "not", "a log"]), "1");
    let request = ["5", "1", "0:0:0:0:1:1000"];
    let mut full = vec![
        "FCALL", function, "3", "w:log", "v:log", "v:log", "3", "2000",
    ];
    for _ in 0..3 {
        full.extend_from_slice(&request);
    }
    let reply = cli(&full);
    let lines: Vec<&str> = reply.lines().collect();
    assert_eq!((lines[0], lines[1]), ("2000", "-1"), "{reply}");
    assert!(lines[2].starts_with("WRONGTYPE"), "{reply}");
    assert_eq!(
        lines[3..],
        [
            "4", "5", "1", "1", "1000", // admitted: fits, recorded entry 1
            "3", "0", "1", "1000", // 1 of 1, nothing recorded: wait 1,000 ms
        ]
    );
    assert_eq!(log_entries(redis.port, "v:log").len(), 1);
}

/// The library keeps the rules it has read from call to call, up to 1,000, then drops them all
/// at once: a call with more distinct rules than that (the drop happens between checking its
/// arguments and deciding them) still decides every request.
#[test]
fn a_call_with_more_rules_than_the_library_keeps_decides_each_request() {
    let (library, cli) = library_on_shared_redis();
    let requests = 1_200;
    let mut args = vec![
        "FCALL".to_string(),
        library.function.to_string(),
        requests.to_string(),
    ];
    args.extend((0..requests).map(|r| format!("rl:{{many-rules}}:{r}:log")));
    args.extend([requests.to_string(), "1000".to_string()]);
    for r in 0..requests {
        // Every request its own rule: limit 10 + r in a 1 s window.
        args.extend(["5".into(), "1".into(), format!("0:0:0:0:{}:1000", 10 + r)]);
    }
    let reply = cli(&args);
    for (r, answer) in one_descriptor_answers(&reply, requests).iter().enumerate() {
        assert_eq!(answer[..2], ["5", "1"], "request {r} was admitted");
    }
}

/// The library keeps the numbers it has read (and their text) from call to call, and drops them
/// all when a call starts with more than it keeps (1,000), never during a call: a call whose own
/// arguments hold more distinct numbers than that decides each request, and the calls after the
/// drop still count every hit (two calls of 1,200 requests on one sorted-set log, whose members
/// carry the padded totals the library keeps, each request with hits of its own, 1 to 1,200).
#[test]
fn calls_across_the_dropped_numbers_count_every_hit() {
    let (library, cli) = library_on_shared_redis();
    let requests = 1_200;
    let mut total = 0u64;
    for call in 0..2u64 {
        let mut args = vec![
            "FCALL".to_string(),
            library.function.to_string(),
            requests.to_string(),
        ];
        args.extend((0..requests).map(|_| "rl:{many-numbers}:log".to_string()));
        let now = 1_000_000 + call * 10_000;
        args.extend([requests.to_string(), now.to_string()]);
        for r in 0..requests as u64 {
            args.extend([
                "5".into(),
                (1 + r).to_string(),
                "0:0:0:2:100000000:100000000".into(),
            ]);
        }
        let reply = cli(&args);
        for (r, answer) in one_descriptor_answers(&reply, requests).iter().enumerate() {
            total += 1 + r as u64;
            let expected = total.to_string();
            assert_eq!(
                answer[..3],
                ["5", expected.as_str(), expected.as_str()],
                "call {call}, request {r}: admitted, recorded at the running total, counted"
            );
        }
    }
    // Members are the running total, 20 digits zero-padded, below the totals the library keeps
    // made (1,000) and above, the weight and the time: the first entry's weight is 1, the
    // last's total 1,441,200.
    let members = cli(&[
        "ZRANGE".into(),
        "rl:{many-numbers}:log".into(),
        "0".into(),
        "-1".into(),
    ]);
    let members: Vec<&str> = members.lines().collect();
    assert_eq!(members.len(), 2 * requests, "one entry per request");
    assert_eq!(members[0], "00000000000000000001:1:1000000");
    let last = members[members.len() - 1];
    assert_eq!(last, format!("{total:020}:1200:1010000"));
}

/// A tentative request's entry (a request over several cluster masters) holds its time too,
/// `<cum>:<weight>:<time>:<prefix>:<i>`, and the reply gives that time after the running total,
/// so that the caller can name the entry to remove it; reading such entries back, as the newest
/// and as the window's first, takes no read of their score.
#[test]
fn a_tentative_entry_holds_its_time_and_is_read_without_its_score() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // One descriptor, tentative (shape 4: mode 0), one hit, 5 a second, then the prefix.
    let call = |now: &str, prefix: &str| {
        cli(&[
            "FCALL",
            &library.function,
            "1",
            "t:log",
            "1",
            now,
            "4",
            "1",
            "0:0:0:2:5:1000",
            prefix,
        ])
    };
    // The call's time, the request's length, then flags (fits, recorded), cum, time, count,
    // reset.
    assert_eq!(
        call("10000", "p-1"),
        ["10000", "5", "5", "1", "10000", "1", "1000"]
    );
    assert_eq!(
        call("10010", "p-2"),
        ["10010", "5", "5", "2", "10010", "2", "990"]
    );
    let scores_read = calls_of(&redis, "zscore");
    // The third finds a log of two: its newest entry and, after the trim, its first are read.
    assert_eq!(
        call("10020", "p-3"),
        ["10020", "5", "5", "3", "10020", "3", "980"]
    );
    assert_eq!(calls_of(&redis, "zscore"), scores_read, "no score read");
    assert_eq!(
        cli(&["ZRANGE", "t:log", "0", "-1"]),
        [
            "00000000000000000001:1:10000:p-1:1",
            "00000000000000000002:1:10010:p-2:1",
            "00000000000000000003:1:10020:p-3:1"
        ]
    );
}

/// A ban key holds the ban's end and lives a second past it, the slack the data keys keep for
/// replicas' clocks: a replica whose clock is behind still finds the ban until its own clock
/// reaches the end, and one past the end is not banned though the key is still there.
#[test]
fn a_ban_key_outlasts_its_ban_by_the_clock_slack() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // role:ban_ms:buckets:debit:limit:window_ms: 1 a second, a ban of 800 ms. One request of
    // one descriptor in final mode (shape 5), one hit; keys: the log, the ban.
    let call = |now: &str| {
        cli(&[
            "FCALL",
            &library.function,
            "2",
            "b:log",
            "b:ban",
            "1",
            now,
            "5",
            "1",
            "0:800:0:0:1:1000",
        ])
    };
    // Per request: its length, then flags (1 fits, 2 set the ban, 4 recorded, 8 banned).
    assert_eq!(call("10000")[2], "5", "admitted and recorded");
    assert_eq!(
        call("10010")[2..4],
        ["10", "800"],
        "over: the ban is set, 800 ms left"
    );
    assert_eq!(cli(&["GET", "b:ban"]), ["10810"], "the ban's end");
    let left: u64 = cli(&["PTTL", "b:ban"])[0].parse().expect("PTTL");
    assert!(
        (1_000..=1_800).contains(&left),
        "the ban (800 ms) and the slack (1 s): {left} ms left"
    );
    // Inside the ban by the caller's clock: banned, 310 ms left.
    assert_eq!(call("10500")[2..4], ["8", "310"]);
    // Past the ban's end and the window: admitted, the key notwithstanding.
    assert_eq!(call("11100")[2], "5");
}

/// A log's expiry, on the common paths (one request of one descriptor; one of two on logs of
/// their own), is set when its newest entry is the first of its period (a quarter window), to
/// the window plus a period plus 1 s, and by a call that finds the newest entry in an earlier
/// period than its own: exactly those calls set it (an admitted call in the newest entry's
/// period does not), and the key outlives its newest entry by the window plus 1 s after every
/// call, admitted or rejected. 80 calls 37 ms apart (the script's clock injected) on a 1 s
/// window, with a limit of 10 (most are rejected) and of 1,000 (all admitted, and the expiry
/// set about once a period); Redis's own clock barely moves, so an expiry set at call time t
/// lasts, in the calls' time, until t plus the TTL.
#[test]
fn a_logs_expiry_is_set_once_a_period_and_outlasts_its_newest_entry() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    // role:ban_ms:buckets:debit:limit:window_ms; a period of 250 ms, a TTL of 2,250 ms.
    let (window, ttl) = (1_000u64, 2_250u64);
    for (rule, keys) in [
        ("0:0:0:2:10:1000", vec!["one:log"]),
        ("0:0:0:2:10:1000", vec!["two:log", "three:log"]),
        ("0:0:0:2:1000:1000", vec!["four:log"]),
        ("0:0:0:2:1000:1000", vec!["five:log", "six:log"]),
    ] {
        let n = keys.len().to_string();
        // Final mode (1), n descriptors.
        let shape = (4 * keys.len() + 1).to_string();
        // Per key: when its expiry was last set, and its newest entry (call times).
        let mut set_at: Option<u64> = None;
        let mut newest: Option<u64> = None;
        let (mut sets, mut rejected) = (0, 0);
        let period = |t: u64| t / 250;
        for call in 0..80u64 {
            let now = 10_000 + 37 * call;
            let now_text = now.to_string();
            let mut args = vec!["FCALL", &library.function, &n];
            args.extend(&keys);
            args.extend(["1", &now_text, &shape]);
            for _ in &keys {
                args.extend(["1", rule]);
            }
            let before = calls_of(&redis, "pexpire");
            let reply = cli(&args);
            let expiries = calls_of(&redis, "pexpire") - before;
            // Each key sees the same calls: all set their expiry, or none.
            assert!(
                expiries == 0 || expiries == keys.len() as u64,
                "call {call}: {expiries} expiries set for {keys:?}"
            );
            if expiries > 0 {
                set_at = Some(now);
                sets += 1;
            }
            // The length, now, then the first descriptor's flags: 5 admitted and recorded.
            let recorded = match reply[2].as_str() {
                "5" => true,
                "0" => false,
                flags => panic!("call {call}: flags {flags}: {reply:?}"),
            };
            let expected = match newest {
                None => recorded,
                Some(head) => period(now) != period(head),
            };
            assert_eq!(
                expiries > 0,
                expected,
                "call {call} at {now} (newest entry {newest:?}, recorded {recorded})"
            );
            if recorded {
                newest = Some(now);
            } else {
                rejected += 1;
            }
            if let Some(newest) = newest {
                let set_at = set_at.expect("a log with entries has had its expiry set");
                assert!(
                    set_at + ttl >= newest + window + 1_000,
                    "call {call}: the expiry set at {set_at} ends before the entry at {newest} leaves the window (plus 1 s)"
                );
                for key in &keys {
                    let left: i64 = cli(&["PTTL", key])[0].parse().expect("PTTL");
                    assert!(left > 0, "call {call}: {key} has no expiry: {left}");
                }
            }
        }
        if rule.ends_with(":10:1000") {
            assert!(rejected > 40, "{keys:?}: {rejected} of 80 rejected");
        } else {
            // 80 calls over 2.9 s: twelve periods.
            assert_eq!((rejected, sets), (0, 12), "{keys:?}: rejected, expiry set");
        }
    }
}

/// A key as it stands: its type, whether it has an expiry, and its contents in order (a
/// string's bytes, a sorted set's members and scores, a hash's fields and values sorted).
const KEY_CONTENT: &str = r"
local kind = redis.call('TYPE', KEYS[1]).ok
local out = { kind, tostring(redis.call('PTTL', KEYS[1]) > 0) }
if kind == 'string' then
  out[3] = redis.call('GET', KEYS[1])
elseif kind == 'zset' then
  for _, v in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')) do out[#out + 1] = v end
elseif kind == 'hash' then
  local all = redis.call('HGETALL', KEYS[1])
  local pairs_ = {}
  for i = 1, #all, 2 do pairs_[#pairs_ + 1] = all[i] .. '=' .. all[i + 1] end
  table.sort(pairs_)
  for _, v in ipairs(pairs_) do out[#out + 1] = v end
end
return out
";

/// The library decides the request shapes most calls carry by straight-line paths of their own
/// (`lua/paths.lua`: one descriptor or several, each on a one-window log without a ban and on
/// a log of its own, compact or sorted set). Fed the same calls on twin logs, the library and
/// one whose path table is empty (so `decide`, the general path, decides everything) must
/// answer alike, field by field, and leave the same keys with the same contents, byte for
/// byte: every role, mode and debit, checks (hits 0), weighted hits, rejections whose reset is
/// searched in the log, logs emptied by the window, logs whose only entry is their first
/// (which the sorted-set paths read as such), several requests on one log in one call, calls
/// whose time is behind their logs' newest entries (a replica's clock behind another's), and
/// requests that are not of those shapes (two descriptors on one log, a ban, two windows) left
/// to the general path; in both log formats. (Only the keys' expiries differ: the paths set a
/// log's once a period, the general path on every write; both outlast every entry.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_common_request_paths_answer_as_the_general_one() {
    use fred::prelude::{ClientLike as _, LuaInterface as _, Value};
    use slidegate::store::redis::{Library, SCRIPT};

    const PATH_TABLE: &str = "  PATHS = {
    compact = { one_compact_log, several_compact_logs },
    sorted = { one_sorted_log, several_sorted_logs },
  }";
    assert!(
        SCRIPT.contains(PATH_TABLE),
        "lua/paths.lua no longer chooses its paths by the table this test empties"
    );
    let own_paths = Library::new();
    let general = Library::from_source(&SCRIPT.replace(PATH_TABLE, "  PATHS = {}"));
    let config = fred::types::config::Config::from_url(&shared_standalone().url()).unwrap();
    let client = fred::clients::Client::new(config, None, None, None);
    client.init().await.unwrap();
    for library in [&own_paths, &general] {
        library.load(&client, TEST_TIMEOUT).await.unwrap();
    }
    // role:ban_ms:buckets:debit:limit:window_ms (layout in lua/contract.lua); the last two are
    // for the general path only.
    const RULES: [&str; 9] = [
        "0:0:0:0:3:1000",
        "0:0:0:0:1:300",
        "1:0:0:0:2:1000",
        "2:0:0:0:2:1500",
        "0:0:0:1:5:2000",
        "2:0:0:1:4:1000",
        "0:0:0:0:6:2500",
        "0:800:0:0:2:1000",
        "0:0:0:0:2:500:4:2000",
    ];
    // A fixed pseudo-random sequence (64-bit LCG): a failure names its case and step.
    let mut seed: u64 = 0x5eed_f51d;
    let mut next = |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    // Flags of lone descriptors' answers: 5 admitted and recorded, 0 or 1 recorded nothing,
    // 4 a debit recorded past its budget.
    let mut lone = [0u64; 3];
    let mut several = 0u64;
    let mut one_entry = 0u64;
    // Both log formats: a sorted-set rule has flag 2 (its fourth field).
    let sorted_rule = |rule: &str| {
        let mut fields: Vec<String> = rule.split(':').map(str::to_string).collect();
        fields[3] = (fields[3].parse::<u64>().unwrap() + 2).to_string();
        fields.join(":")
    };
    for case in 0..64 {
        let sorted = case % 2 == 1;
        let tag = unique_domain("paths");
        let mut now = 1_000_000u64;
        for step in 0..60 {
            now += next(600);
            // One call in six from a replica whose clock is behind the one that wrote the
            // newest entries (each path stamps an entry no earlier than its log's newest).
            let at = if next(6) == 0 {
                now - 1 - next(800)
            } else {
                now
            };
            let requests = 1 + next(3);
            let mode = next(3);
            let mut descriptors = Vec::new();
            let mut args = vec![
                Value::from(requests.to_string()),
                Value::from(at.to_string()),
            ];
            for r in 0..requests {
                // Mostly one descriptor, from one of the first rules (the common kinds).
                let n = if next(2) == 0 { 1 } else { 1 + next(3) };
                args.push(Value::from((4 * n + mode).to_string()));
                for _ in 0..n {
                    let kinds = if next(4) == 0 { 9 } else { 7 };
                    let rule = RULES[usize::try_from(next(kinds)).unwrap()];
                    let log = next(3);
                    let text = if sorted {
                        sorted_rule(rule)
                    } else {
                        rule.to_string()
                    };
                    args.extend([Value::from(next(4).to_string()), Value::from(text)]);
                    descriptors.push((log, rule.starts_with("0:800:")));
                }
                // A tentative request (mode 0) ends with the prefix that names its entries.
                if mode == 0 {
                    args.push(Value::from(format!("p{step}-{r}")));
                }
                several += u64::from(n > 1);
            }
            // Logs of one entry (the sorted-set paths read such a log as it is: nothing to
            // trim, no first entry to read), counted on the own paths' twin before the call.
            let mut logs: Vec<u64> = descriptors.iter().map(|&(log, _)| log).collect();
            logs.sort_unstable();
            logs.dedup();
            for log in logs {
                let key = format!("rl:{{{tag}}}:own:{log}");
                let entries: Vec<u64> = client
                    .eval(LOG_ENTRIES, key, Vec::<String>::new())
                    .await
                    .unwrap();
                one_entry += u64::from(entries.len() == 2);
            }
            let mut answers = Vec::new();
            for (library, twin) in [(&own_paths, "own"), (&general, "general")] {
                let mut keys = Vec::new();
                for &(log, banned) in &descriptors {
                    keys.push(fred::types::Key::from(format!("rl:{{{tag}}}:{twin}:{log}")));
                    if banned {
                        keys.push(fred::types::Key::from(format!(
                            "rl:{{{tag}}}:{twin}:{log}:ban"
                        )));
                    }
                }
                answers.push(library.call(&client, keys, args.clone()).await.unwrap());
            }
            assert_eq!(answers[0], answers[1], "case {case}, step {step}: {args:?}");
            for &(log, banned) in &descriptors {
                let mut names = vec![format!("{log}")];
                if banned {
                    names.push(format!("{log}:ban"));
                }
                for name in names {
                    let [own, general]: [Vec<Value>; 2] = [
                        client
                            .eval(KEY_CONTENT, format!("rl:{{{tag}}}:own:{name}"), ())
                            .await
                            .unwrap(),
                        client
                            .eval(KEY_CONTENT, format!("rl:{{{tag}}}:general:{name}"), ())
                            .await
                            .unwrap(),
                    ];
                    assert_eq!(
                        own, general,
                        "case {case}, step {step}, key {name}: {args:?}"
                    );
                }
            }
            let flat = &unpacked(&answers[0]);
            // The call's time, then per request its length and its values.
            let mut rest = &flat[1..];
            while let [Value::Integer(length), tail @ ..] = rest {
                let length = usize::try_from(*length).unwrap_or_else(|_| {
                    panic!("a request failed: {rest:?}");
                });
                let (fields, tail) = tail.split_at(length);
                rest = tail;
                // A lone descriptor's answer is flags, [entry,] count, reset.
                match (fields.len(), fields.first()) {
                    (4, Some(Value::Integer(5))) => lone[0] += 1,
                    (3, Some(Value::Integer(0 | 1))) => lone[1] += 1,
                    (4, Some(Value::Integer(4))) => lone[2] += 1,
                    _ => {}
                }
            }
            assert!(rest.is_empty(), "case {case}, step {step}: {flat:?}");
        }
    }
    // The sequence reaches each kind of answer.
    assert!(
        lone.iter().all(|&n| n > 0) && several > 100 && one_entry > 100,
        "lone descriptors' answers by kind: {lone:?}; requests of several: {several}; \
         logs of one entry: {one_entry}"
    );
    client.quit().await.unwrap();
}

/// A log entry slidegate did not write (something else wrote into its key space, or a member
/// of a layout this version does not know) fails the request that reads it, with an error that
/// says so, and nothing else: the other request of the same call is decided, and the foreign
/// log gains no entry. Whether the foreign entry is the newest (read first) or the window's
/// first (read after the newest), the request fails the same way.
#[test]
fn a_log_entry_slidegate_did_not_write_fails_that_request_alone() {
    let (library, cli) = library_on_shared_redis();
    let now = 5_000_000u64;
    for (case, members) in [
        ("newest", vec![(now - 1_000, "1:oldcall:1:1".to_string())]),
        (
            "first",
            vec![
                (now - 2_000, "oldcall:2".to_string()),
                (now - 1_000, format!("{:020}:1:{}", 2, now - 1_000)),
            ],
        ),
    ] {
        let foreign = format!("rl:{{foreign-{case}}}:log");
        let clean = format!("rl:{{clean-{case}}}:log");
        for (at, member) in &members {
            let added = cli(&[
                "ZADD".into(),
                foreign.clone(),
                at.to_string(),
                member.clone(),
            ]);
            assert_eq!(added, "1", "{case}: {added}");
        }
        let rule = "0:0:0:0:10:60000".to_string();
        let reply = cli(&[
            "FCALL".into(),
            library.function.to_string(),
            "2".into(),
            foreign.clone(),
            clean.clone(),
            "2".into(),
            now.to_string(),
            "5".into(),
            "1".into(),
            rule.clone(),
            "5".into(),
            "1".into(),
            rule,
        ]);
        let lines: Vec<&str> = reply.lines().collect();
        assert_eq!(lines[0], now.to_string(), "{case}: {reply}");
        assert_eq!(
            lines[1], "-1",
            "{case}: the foreign log's request failed: {reply}"
        );
        assert_eq!(
            lines[2],
            format!("SLIDEGATE log {foreign} holds an entry slidegate did not write"),
            "{case}"
        );
        assert_eq!(
            lines[3..],
            ["4", "5", "1", "1", "60000"],
            "{case}: the other request admitted, its entry recorded and counted"
        );
        let kept = cli(&["ZCARD".into(), foreign]);
        assert_eq!(kept, members.len().to_string(), "{case}: nothing recorded");
    }
}

/// Memory per call, not per hit: 500 debits of 2 hits are 500 entries of 8 bytes in a compact
/// log (a slot for the time, one for the weight), whatever the hits. A rule whose log could
/// pass 1,000 entries keeps a sorted set instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weighted_log_memory_is_per_call() {
    let redis = shared_standalone();
    let store = connect(redis.url(), TEST_TIMEOUT).await;
    let key = slidegate::store::StoreKey::new(&unique_domain("tokens"), "");
    for n in 0..500u64 {
        let outcome = store
            .check(&[budget_item(&key, 2, 1_000)], T0 + n)
            .await
            .expect("debit");
        assert!(outcome.items[0].recorded);
    }
    let log = key.log();
    let entries = log_entries(redis.port, &log);
    assert_eq!(entries.len(), 500);
    assert!(entries.iter().all(|&(_, weight)| weight == 2));
    assert_eq!(redis.cmd(&format!("TYPE {log}")).trim(), "+string");
    let bytes: u64 = redis
        .cmd(&format!("MEMORY USAGE {log}"))
        .trim_start_matches(':')
        .trim()
        .parse()
        .expect("MEMORY USAGE");
    // 8 bytes an entry, and the key, the log's head and the allocator's rounding: under 9.
    assert!(
        bytes < 500 * 9,
        "{bytes} bytes for 500 weighted entries: 9 bytes or more each"
    );
    let last = store
        .check(&[budget_item(&key, 0, 1_000)], T0 + 500)
        .await
        .expect("check");
    assert_eq!(last.items[0].windows[0].count, 1_000);

    let busy = slidegate::store::StoreKey::new(&unique_domain("tokens"), "");
    store
        .check(&[budget_item(&busy, 2, 1_001)], T0)
        .await
        .expect("debit");
    assert_eq!(redis.cmd(&format!("TYPE {}", busy.log())).trim(), "+zset");
}

/// Where `FUNCTION LOAD` is refused (the command renamed away, or an ACL user without it), the
/// same code goes by `SCRIPT LOAD` and `EVALSHA`, and decides the same: 2 an hour admits two;
/// the admin API's inspection and reset and the quota service's reports go by `EVAL`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_function_load_the_script_goes_by_evalsha() {
    let renamed = RedisProcess::start(&["--rename-command", "FUNCTION", ""]);
    let limited = RedisProcess::start(&[]);
    assert!(
        limited
            .cmd("ACL SETUSER limited on >secret ~* +@all -function")
            .starts_with("+OK")
    );
    let limited_url = format!("redis://limited:secret@127.0.0.1:{}", limited.port);
    for (redis, url) in [(&renamed, renamed.url()), (&limited, limited_url)] {
        let store = connect(url.clone(), TEST_TIMEOUT).await;
        let domain = unique_domain("evalsha");
        let config = format!(
            "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 2}}\n"
        );
        let server = TestServer::start(&config, store, LimiterOptions::default()).await;
        let codes: Vec<_> = futures_util::future::join_all(
            (0..3).map(|_| server.call(request(&domain, vec![descriptor(&[("k", "v")])]))),
        )
        .await
        .into_iter()
        .map(|r| r.overall_code)
        .collect();
        assert_eq!(
            codes.iter().filter(|&&c| c == ok()).count(),
            2,
            "{url}: {codes:?}"
        );
        assert!(calls_of(redis, "evalsha") >= 3, "{url}: decided by EVALSHA");
        assert_eq!(calls_of(redis, "fcall"), 0, "{url}");
        // The library's other functions go as scripts too: an inspection sees the two
        // admitted, a reset clears them, a quota report is recorded and shared.
        let one = slidegate::limiter::Request {
            domain: domain.clone(),
            descriptors: vec![slidegate::limiter::Descriptor {
                entries: vec![("k".to_string(), "v".to_string())],
                limit: None,
                hits_addend: None,
            }],
            hits_addend: 0,
        };
        let standing = server.limiter.inspect(&one).await.expect("inspect");
        assert_eq!(standing[0].windows[0].used, 2, "{url}: {standing:?}");
        let cleared = server.limiter.reset(&one).await.expect("reset");
        assert!(cleared[0].cleared, "{url}: {cleared:?}");
        let usage = slidegate::limiter::BucketUsage {
            id: vec![("k".to_string(), "v".to_string())],
            allowed: 0,
            denied: 1,
            elapsed_ms: 0,
        };
        let holder = server.limiter.quota_holder();
        let assigned = server
            .limiter
            .quota_report(&domain, &holder, &[usage])
            .await;
        assert!(
            matches!(
                assigned[0],
                Some(slidegate::limiter::Assignment::TokenBucket { .. })
            ),
            "{url}: {assigned:?}"
        );
        assert!(calls_of(redis, "eval") >= 3, "{url}: by EVAL");
        assert_eq!(calls_of(redis, "fcall_ro"), 0, "{url}");
        server.stop().await;
    }
}

/// The compact log as docs/redis.md lays it out: a head (slot width, plus 16 once a weighted
/// entry is in; base; in a weighted log, the total), then a slot per entry, and a weighted entry's weight in
/// the slot after it; written whole with its expiry; 6-byte slots for windows past 2^30 ms; hits
/// past a slot's top bit as several entries of one time; a base moved when the log stays busy
/// longer than a slot reaches; and a text slidegate did not write fails its request alone.
#[test]
fn a_compact_log_is_a_head_and_a_slot_per_entry() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    let decide = |key: &str, now: u64, hits: u64, rule: &str| {
        one_request(
            redis.port,
            &library,
            key,
            &now.to_string(),
            &hits.to_string(),
            rule,
        )
    };
    let bytes = |key: &str| -> Vec<u64> {
        let lines = cli(&[
            "EVAL",
            "return {string.byte(redis.call('GET', KEYS[1]), 1, -1)}",
            "1",
            key,
        ]);
        lines.iter().map(|l| l.parse().expect("a byte")).collect()
    };
    let be = |v: u64, width: usize| -> Vec<u64> {
        (0..width)
            .rev()
            .map(|i| (v >> (8 * i)) & 0xff)
            .collect::<Vec<_>>()
    };

    // Three calls on a 10 a second rule: one hit, one hit, three hits.
    let rule = "0:0:0:0:10:1000";
    assert_eq!(
        decide("c:log", 1_000, 1, rule),
        ["1000", "4", "5", "1", "1", "1000"]
    );
    assert_eq!(
        decide("c:log", 1_001, 1, rule),
        ["1001", "4", "5", "2", "2", "999"]
    );
    assert_eq!(
        decide("c:log", 1_002, 3, rule),
        ["1002", "4", "5", "5", "5", "998"]
    );
    let mut expected = vec![4 + 16];
    expected.extend(be(1_000, 6));
    expected.extend(be(5, 6));
    for slot in [0, 1, 0x8000_0000 + 2, 3] {
        expected.extend(be(slot, 4));
    }
    assert_eq!(bytes("c:log"), expected);
    // Unweighted entries only: a 7-byte head (no total: it is the number of slots).
    decide("p:log", 1_000, 1, rule);
    decide("p:log", 1_250, 1, rule);
    let mut expected = vec![4];
    expected.extend(be(1_000, 6));
    expected.extend(be(0, 4));
    expected.extend(be(250, 4));
    assert_eq!(bytes("p:log"), expected);
    let ttl: i64 = cli(&["PTTL", "c:log"])[0].parse().expect("PTTL");
    assert!(
        (1..=2_250).contains(&ttl),
        "the window, a period (a quarter window) and 1 s: {ttl}"
    );
    // Past the window the trim drops the first two; past all of it the log goes.
    assert_eq!(
        decide("c:log", 2_001, 1, rule),
        ["2001", "4", "5", "4", "4", "1"]
    );
    assert_eq!(log_entries(redis.port, "c:log"), [(1_002, 3), (2_001, 1)]);
    assert_eq!(
        decide("c:log", 9_000, 0, rule),
        ["9000", "3", "1", "0", "0"]
    );
    assert_eq!(cli(&["EXISTS", "c:log"]), ["0"]);

    // The expiry is set when an entry is the first of its period (250 ms here) and kept by
    // the other writes, and always outlasts the newest entry by the window and 1 s: 80 calls
    // 37 ms apart, all admitted (Redis's own clock barely moves meanwhile, so an expiry set at
    // call time t lasts, in the calls' time, until t + 2,250).
    let (mut set_at, mut sets, mut last_ttl) = (0u64, 0, i64::MAX);
    for call in 0..80u64 {
        let now = 10_000 + 37 * call;
        assert_eq!(decide("e:log", now, 1, "0:0:0:0:1000:1000")[2], "5");
        let ttl: i64 = cli(&["PTTL", "e:log"])[0].parse().expect("PTTL");
        if ttl > last_ttl || call == 0 {
            set_at = now;
            sets += 1;
        }
        last_ttl = ttl;
        assert!(
            set_at + 2_250 >= now + 1_000 + 1_000,
            "call {call}: the expiry set at {set_at} ends before the entry at {now} leaves the window (plus 1 s)"
        );
    }
    assert_eq!(sets, 12, "80 calls over 2.9 s: twelve periods");

    // 30 days: 6-byte slots.
    let month = "0:0:0:0:10:2592000000";
    decide("m:log", 5_000, 1, month);
    let mut expected = vec![6];
    expected.extend(be(5_000, 6));
    expected.extend(be(0, 6));
    assert_eq!(bytes("m:log"), expected);

    // Hits past 2^31 - 1 in a 4-byte log: two entries of one time, counted whole.
    let big = "0:0:0:0:4294967295:60000";
    let hits = 3_000_000_000u64;
    assert_eq!(
        decide("b:log", 7_000, hits, big)[3..5],
        ["3000000000", "3000000000"]
    );
    assert_eq!(
        log_entries(redis.port, "b:log"),
        [(7_000, (1 << 31) - 1), (7_000, hits - ((1 << 31) - 1))]
    );

    // A log busy for 26 days on a one-day window, a call every 23 hours: past 2^31 ms from the
    // first entry the base moves to the oldest entry kept, and every count stays 2.
    let day = "0:0:0:0:10:86400000";
    let hour = 3_600_000u64;
    for call in 0..27u64 {
        let now = 1_000_000 + call * 23 * hour;
        let answer = decide("busy:log", now, 1, day);
        let count = if call == 0 { "1" } else { "2" };
        assert_eq!(answer[4], count, "call {call}: {answer:?}");
    }
    let last = 1_000_000 + 26 * 23 * hour;
    assert_eq!(
        log_entries(redis.port, "busy:log"),
        [(last - 23 * hour, 1), (last, 1)]
    );
    let head = bytes("busy:log");
    let base = head[1..7].iter().fold(0, |v, &b| v << 8 | b);
    assert!(base > 1_000_000, "the base moved: {base}");

    // Not a compact log: the request fails, saying so, and the key stays as it was.
    assert_eq!(cli(&["SET", "f:log", "hello world, not a log"]), ["OK"]);
    let answer = decide("f:log", 1_000, 1, rule);
    assert_eq!(answer[1], "-1", "{answer:?}");
    assert_eq!(
        answer[2],
        "SLIDEGATE log f:log holds an entry slidegate did not write"
    );
    assert_eq!(cli(&["GET", "f:log"]), ["hello world, not a log"]);
}

/// A replica asked for the sorted-set format (a rolling upgrade's first step) and one asked for
/// the compact format decide on the same log in turns: each rewrites the log it finds in the
/// other format, keeping every entry's time and weight and the key's expiry, so the counts run
/// on as on one log.
#[test]
fn either_format_reads_a_log_the_other_wrote() {
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    let decide = |now: u64, hits: u64, rule: &str| {
        one_request(
            redis.port,
            &library,
            "x:log",
            &now.to_string(),
            &hits.to_string(),
            rule,
        )
    };
    let (compact, sorted) = ("0:0:0:0:100:10000", "0:0:0:2:100:10000");
    let mut total = 0;
    let mut expected = Vec::new();
    for (step, rule) in [sorted, sorted, compact, compact, sorted, compact, sorted]
        .into_iter()
        .enumerate()
    {
        let now = 50_000 + 1_000 * step as u64;
        let hits = 1 + step as u64 % 3;
        total += hits;
        expected.push((now, hits));
        let answer = decide(now, hits, rule);
        assert_eq!(
            answer[2], "5",
            "step {step}: admitted and recorded: {answer:?}"
        );
        assert_eq!(answer[4], total.to_string(), "step {step}: {answer:?}");
        let kind = if rule == sorted { "zset" } else { "string" };
        assert_eq!(cli(&["TYPE", "x:log"]), [kind], "step {step}");
        assert_eq!(log_entries(redis.port, "x:log"), expected, "step {step}");
        let ttl: i64 = cli(&["PTTL", "x:log"])[0].parse().expect("PTTL");
        assert!(ttl > 0, "step {step}: {ttl}");
    }
}

/// The library's undo takes back one entry of the time and weight it is given from a compact
/// log (the head's total with it), or the member it is given from a sorted set; an entry no
/// longer there is left alone.
#[test]
fn undo_takes_back_one_entry_in_either_format() {
    use slidegate::store::redis::Function;
    let (redis, library) = redis_with_library();
    let cli = |args: &[&str]| node_cli(redis.port, args);
    let decide = |key: &str, now: &str, hits: &str, rule: &str| {
        one_request(redis.port, &library, key, now, hits, rule)
    };
    let undo_function = library.name(Function::Undo);
    let undo = |key: &str, member: &str, time: &str, weight: &str| -> String {
        cli(&["FCALL", undo_function, "1", key, member, time, weight])[0].clone()
    };
    let rule = "0:0:0:0:100:10000";
    for (now, hits) in [("5000", "1"), ("5000", "2"), ("5001", "1"), ("5000", "2")] {
        decide("u:log", now, hits, rule);
    }
    // Entries: (5000, 1), (5000, 2), (5001, 1), (5001, 2): the last stamped at the newest
    // entry's time, as a clock behind records.
    assert_eq!(undo("u:log", "", "5000", "2"), "2");
    assert_eq!(
        log_entries(redis.port, "u:log"),
        [(5_000, 1), (5_001, 1), (5_001, 2)]
    );
    assert_eq!(undo("u:log", "", "5000", "2"), "0", "no such entry left");
    // The head's total went down with it: 4 counted.
    assert_eq!(decide("u:log", "5002", "0", rule)[3], "4");
    let ttl: i64 = cli(&["PTTL", "u:log"])[0].parse().expect("PTTL");
    assert!(ttl > 0, "the expiry is kept: {ttl}");
    for (time, weight) in [("5000", "1"), ("5001", "1"), ("5001", "2")] {
        assert_eq!(undo("u:log", "", time, weight), weight);
    }
    assert_eq!(cli(&["EXISTS", "u:log"]), ["0"], "emptied, the log goes");
    // A sorted-set log: its member.
    decide("s:log", "5000", "1", "0:0:0:2:100:10000");
    assert_eq!(
        undo("s:log", "00000000000000000001:1:5000", "5000", "1"),
        "1"
    );
    assert_eq!(cli(&["EXISTS", "s:log"]), ["0"]);
}

/// One reader of the compact log in Rust (`store::redis::compact`, what the admin API reads
/// with) and one writer (the library): logs of random contents written by the library's
/// decisions and undos, in both slot widths, weighted and not, trimmed, emptied and started
/// again, from clocks behind the log's newest entry, read back by the Rust reader as exactly
/// the entries a model of the rules expects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compact_logs_read_in_rust_as_the_library_writes_them() {
    use fred::interfaces::FunctionInterface as _;
    use fred::prelude::{ClientLike as _, Value};
    use fred::types::{ClusterHash, CustomCommand};
    use slidegate::store::redis::{Function, Library, compact};

    let redis = RedisProcess::start(&[]);
    let library = Library::new();
    let config = fred::types::config::Config::from_url(&redis.url()).unwrap();
    let client = fred::clients::Client::new(config, None, None, None);
    client.init().await.unwrap();
    library.load(&client, TEST_TIMEOUT).await.unwrap();
    // (rule, window in ms, slot width): a small limit (rejections), a large one, a debit, and
    // a window past 2^30 ms (6-byte slots).
    let rules: [(&str, u64, u64); 4] = [
        ("0:0:0:0:12:800", 800, 4),
        ("0:0:0:0:4000000000:3000", 3_000, 4),
        ("0:0:0:1:20:2000", 2_000, 4),
        ("0:0:0:0:4000000000:1100000000", 1_100_000_000, 6),
    ];
    let mut seed: u64 = 0x00c0_ffee;
    let mut next = |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below
    };
    let (mut recorded, mut undone, mut emptied, mut wide) = (0, 0, 0, 0);
    for case in 0..6 {
        let key = format!("rl:{{reader}}:log{case}");
        // The entries the log must hold: (time, weight), oldest first, and its slot width.
        let mut model: Vec<(u64, u64)> = Vec::new();
        let mut width = 4u64;
        let mut now = 1_000_000u64;
        for step in 0..160 {
            // Every 20 steps a pause longer than the short windows, and a check (hits 0) on
            // one of them: the log empties, and starts again.
            let pause = step % 20 == 19;
            now += if pause { 10_000 } else { next(300) };
            let at = if next(8) == 0 && !pause {
                now - next(600)
            } else {
                now
            };
            let (rule, window, rule_width) = match next(8) {
                _ if pause => rules[0],
                0 => rules[3],
                pick => rules[usize::try_from(pick % 3).unwrap()],
            };
            let hits = match next(12) {
                _ if pause => 0,
                0 => 0,
                1..=6 => 1,
                7 if rule_width == 4 && rule.contains("4000000000") => 3_000_000_000,
                _ => 2 + next(4),
            };
            let args: Vec<Value> = ["1", &at.to_string(), "5", &hits.to_string(), rule]
                .iter()
                .map(|a| Value::from(a.to_string()))
                .collect();
            let reply = unpacked(
                &library
                    .call(&client, vec![fred::types::Key::from(key.as_str())], args)
                    .await
                    .unwrap(),
            );
            let flags = reply[2].as_i64().unwrap_or_else(|| panic!("{reply:?}"));
            let newest = model.last().map_or(0, |&(t, _)| t);
            model.retain(|&(t, _)| t + window > at);
            if flags & 4 != 0 {
                width = if model.is_empty() {
                    rule_width
                } else {
                    width.max(rule_width)
                };
                let stamp = at.max(newest);
                let most = (1u64 << (8 * width - 1)) - 1;
                let mut left = hits;
                while left > 0 {
                    model.push((stamp, left.min(most)));
                    left -= left.min(most);
                }
                recorded += 1;
            }
            // Now and then, the undo of a random entry (as a rejected spread request's).
            if next(6) == 0
                && let Some(&(time, weight)) =
                    model.get(usize::try_from(next(model.len().max(1) as u64)).unwrap())
            {
                let taken: i64 = client
                    .fcall(
                        library.name(Function::Undo),
                        vec![fred::types::Key::from(key.as_str())],
                        vec![String::new(), time.to_string(), weight.to_string()],
                    )
                    .await
                    .unwrap();
                assert_eq!(
                    taken,
                    i64::try_from(weight).unwrap(),
                    "case {case}, step {step}"
                );
                let last = model.iter().rposition(|&e| e == (time, weight)).unwrap();
                model.remove(last);
                undone += 1;
            }
            let get = CustomCommand::new_static("GET", ClusterHash::FirstKey, false);
            let stored: Value = client.custom(get, vec![key.as_str()]).await.unwrap();
            match stored.as_bytes() {
                None => {
                    assert!(
                        model.is_empty(),
                        "case {case}, step {step}: gone, {model:?}"
                    );
                    emptied += 1;
                }
                Some(text) => {
                    let read: Vec<(u64, u64)> = compact::entries(text)
                        .unwrap_or_else(|| panic!("case {case}, step {step}: {text:?}"))
                        .iter()
                        .map(|e| (e.at_ms, e.weight))
                        .collect();
                    assert_eq!(read, model, "case {case}, step {step}");
                    wide += u64::from(text[0] % 16 == 6);
                }
            }
        }
    }
    assert!(
        recorded > 300 && undone > 50 && emptied > 5 && wide > 20,
        "recorded {recorded}, undone {undone}, emptied {emptied}, 6-byte {wide}"
    );
    client.quit().await.unwrap();
}
