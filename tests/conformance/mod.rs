//! The conformance suite: every scenario runs unchanged against every store (see
//! `conformance_suite!`). Scenarios follow the reference server's behaviours (its integration and
//! config tests), adapted where a rolling window differs from its fixed window, plus slidegate's
//! extensions. Configs say `domain: DOMAIN`; each test gets a unique domain.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use slidegate::limiter::LimiterOptions;
use slidegate::store::Store;

use crate::common::*;

mod quota;
pub use quota::{
    quota_denies_a_used_up_window_and_matches_any_order, quota_fleet_shares_one_limit_exactly,
    quota_shares_move_with_demand,
};

pub type StoreFuture<'a> = Pin<Box<dyn Future<Output = Arc<dyn Store>> + Send + 'a>>;

/// Makes a fresh store (or a fresh client of a shared one) for one test.
pub trait Backend: Sync {
    fn store(&self) -> StoreFuture<'_>;
}

const SECOND: i32 = 1;
const MINUTE: i32 = 2;
const HOUR: i32 = 3;
const DAY: i32 = 4;

async fn start_with(
    backend: &dyn Backend,
    name: &str,
    config: &str,
    options: LimiterOptions,
) -> (TestServer, String) {
    let domain = unique_domain(name);
    let config = config.replace("DOMAIN", &domain);
    let server = TestServer::start(&config, backend.store().await, options).await;
    (server, domain)
}

async fn start(backend: &dyn Backend, name: &str, config: &str) -> (TestServer, String) {
    start_with(backend, name, config, LimiterOptions::default()).await
}

/// The reference's `basic` + `another` configs, in one domain.
const BASIC: &str = r#"
domain: DOMAIN
descriptors:
  - key: key1
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: one_per_minute
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 20}
"#;

pub async fn unknown_domain_is_ok_without_limit(b: &dyn Backend) {
    let (s, _) = start(b, "unknown", BASIC).await;
    let r = s
        .call(request(
            "no-such-domain",
            vec![descriptor(&[("hello", "world")])],
        ))
        .await;
    assert_eq!(r.overall_code, ok());
    assert_eq!(r.statuses.len(), 1);
    assert_eq!(r.statuses[0].code, ok());
    assert_eq!(r.statuses[0].current_limit, None);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    s.stop().await;
}

pub async fn basic_limit_reports_remaining_and_reset(b: &dyn Backend) {
    let (s, d) = start(b, "basic", BASIC).await;
    let r = s
        .call(request(&d, vec![descriptor(&[("key1", "foo")])]))
        .await;
    assert_eq!(r.overall_code, ok());
    assert_eq!(limit_of(&r.statuses[0]), Some((50, SECOND, String::new())));
    assert_eq!(r.statuses[0].limit_remaining, 49);
    // The only entry is brand new: the window frees it a full second from now.
    assert_eq!(reset_ms(&r.statuses[0]), Some(1000));
    s.stop().await;
}

pub async fn over_limit_after_n(b: &dyn Backend) {
    let (s, d) = start(b, "over", BASIC).await;
    for i in 0..25u32 {
        let r = s
            .call(request(&d, vec![descriptor(&[("key2", "r")])]))
            .await;
        if i < 20 {
            assert_eq!(r.overall_code, ok(), "request {i}");
            assert_eq!(r.statuses[0].limit_remaining, 19 - i);
        } else {
            assert_eq!(r.overall_code, over(), "request {i}");
            assert_eq!(r.statuses[0].code, over());
            assert_eq!(r.statuses[0].limit_remaining, 0);
            assert_eq!(limit_of(&r.statuses[0]), Some((20, MINUTE, String::new())));
        }
    }
    s.stop().await;
}

/// Reference #4/#5: two descriptors; once the second is over, the request is rejected as a
/// whole and, unlike the reference's default, nothing is recorded in the first (as the
/// reference does with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT, but atomically).
pub async fn rejected_requests_record_nothing(b: &dyn Backend) {
    let (s, d) = start(b, "allornothing", BASIC).await;
    for i in 0..15u32 {
        let r = s
            .call(request(
                &d,
                vec![descriptor(&[("key2", "r")]), descriptor(&[("key3", "r")])],
            ))
            .await;
        if i < 10 {
            assert_eq!(r.overall_code, ok(), "request {i}");
            assert_eq!(r.statuses[0].limit_remaining, 19 - i);
            assert_eq!(r.statuses[1].limit_remaining, 9 - i);
        } else {
            assert_eq!(r.overall_code, over(), "request {i}");
            assert_eq!(r.statuses[0].code, ok());
            assert_eq!(
                r.statuses[0].limit_remaining, 10,
                "nothing recorded in key2 once rejected"
            );
            assert_eq!(r.statuses[1].code, over());
            assert_eq!(limit_of(&r.statuses[1]), Some((10, HOUR, String::new())));
        }
    }
    s.stop().await;
}

/// Reference #6: the reset shrinks as time passes.
pub async fn reset_counts_down(b: &dyn Backend) {
    let (s, d) = start(b, "reset", BASIC).await;
    let first = s
        .call(request(&d, vec![descriptor(&[("key4", "durTest")])]))
        .await;
    s.clock.advance(2_000);
    let second = s
        .call(request(&d, vec![descriptor(&[("key4", "durTest")])]))
        .await;
    assert_eq!(reset_ms(&first.statuses[0]), Some(86_400_000));
    assert_eq!(reset_ms(&second.statuses[0]), Some(86_398_000));
    s.stop().await;
}

const SHARE: &str = r#"
domain: DOMAIN
descriptors:
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: files_no_share
    value: files_no_share/*
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;

pub async fn share_threshold_shares_one_log(b: &dyn Backend) {
    let (s, d) = start(b, "share", SHARE).await;
    for n in 0..10 {
        let r = s
            .call(request(
                &d,
                vec![descriptor(&[("files", &format!("files/{n}.pdf"))])],
            ))
            .await;
        assert_eq!(r.overall_code, ok());
    }
    let r = s
        .call(request(&d, vec![descriptor(&[("files", "files/b.csv")])]))
        .await;
    assert_eq!(r.overall_code, over());
    assert_eq!(limit_of(&r.statuses[0]), Some((10, HOUR, String::new())));
    for n in 0..10 {
        let r = s
            .call(request(
                &d,
                vec![descriptor(&[(
                    "files_no_share",
                    &format!("files_no_share/{n}"),
                )])],
            ))
            .await;
        assert_eq!(
            r.statuses[0].limit_remaining, 9,
            "each value has its own log"
        );
    }
    s.stop().await;
}

pub async fn invalid_requests_are_rejected_and_record_nothing(b: &dyn Backend) {
    let (s, d) = start(b, "invalid", BASIC).await;
    let st = s
        .call_err(request("", vec![descriptor(&[("key1", "a")])]))
        .await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    assert!(
        st.message().contains("domain must not be empty"),
        "{}",
        st.message()
    );
    let st = s.call_err(request(&d, vec![])).await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    assert!(st.message().contains("descriptor list must not be empty"));
    let st = s
        .call_err(request(
            &d,
            vec![descriptor(&[("key1", "a")]), descriptor(&[("", "x")])],
        ))
        .await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    // The reference server crashes on an override with unit UNKNOWN.
    let st = s
        .call_err(request(
            &d,
            vec![
                descriptor(&[("key1", "a")]),
                with_override(descriptor(&[("key2", "b")]), 5, 0),
            ],
        ))
        .await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    assert!(
        st.message().contains("descriptors[1].limit.unit"),
        "{}",
        st.message()
    );
    // More hits than one descriptor may add in one request.
    let st = s
        .call_err(request(
            &d,
            vec![
                descriptor(&[("key1", "a")]),
                with_hits(descriptor(&[("key2", "b")]), 1_000_000_001),
            ],
        ))
        .await;
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    assert!(
        st.message()
            .contains("descriptors[1] asks for 1000000001 hits"),
        "{}",
        st.message()
    );
    // None of the rejected calls recorded anything for key1 = a.
    let r = s
        .call(request(&d, vec![descriptor(&[("key1", "a")])]))
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 49);
    s.stop().await;
}

/// Envoy sends a descriptor with no entries when every action of one of its rate limits was
/// skipped (`request_headers` with `skip_if_absent` and no such header). The reference answers it
/// OK without a limit and decides the others; so does slidegate.
pub async fn entryless_descriptor_is_ok_and_others_still_apply(b: &dyn Backend) {
    let (s, d) = start(b, "entryless", BASIC).await;
    let call = || {
        request(
            &d,
            vec![descriptor(&[]), descriptor(&[("one_per_minute", "x")])],
        )
    };
    let first = s.call(call()).await;
    assert_eq!(first.overall_code, ok());
    assert_eq!(first.statuses.len(), 2);
    assert_eq!(first.statuses[0].code, ok());
    assert_eq!(first.statuses[0].current_limit, None);
    assert_eq!(first.statuses[1].code, ok());
    assert_eq!(
        first.statuses[1]
            .current_limit
            .as_ref()
            .map(|l| l.requests_per_unit),
        Some(1)
    );
    let second = s.call(call()).await;
    assert_eq!(
        second.overall_code,
        over(),
        "the other descriptor is enforced"
    );
    assert_eq!(second.statuses[0].code, ok());
    assert_eq!(second.statuses[1].code, over());
    // Alone, it is still an answer, not an error.
    let alone = s.call(request(&d, vec![descriptor(&[])])).await;
    assert_eq!(alone.overall_code, ok());
    assert_eq!(alone.statuses.len(), 1);
    s.stop().await;
}

const UNLIMITED: &str = r#"
domain: DOMAIN
descriptors:
  - key: limited
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: nolimit
  - key: free
    rate_limit: {unlimited: true}
"#;

pub async fn unlimited_and_whitelisted(b: &dyn Backend) {
    let (s, d) = start(b, "unlimited", UNLIMITED).await;
    let r = s
        .call(request(
            &d,
            vec![
                descriptor(&[("limited", "x")]),
                descriptor(&[("nolimit", "x")]),
                descriptor(&[("free", "x")]),
            ],
        ))
        .await;
    assert_eq!(r.overall_code, ok());
    assert_eq!(limit_of(&r.statuses[0]), Some((10, MINUTE, String::new())));
    assert_eq!(r.statuses[0].limit_remaining, 9);
    assert_eq!(r.statuses[1].current_limit, None);
    assert_eq!(r.statuses[1].limit_remaining, 0);
    assert_eq!(r.statuses[2].current_limit, None);
    assert_eq!(r.statuses[2].limit_remaining, u32::MAX);
    s.stop().await;
}

const SHADOW: &str = r#"
domain: DOMAIN
descriptors:
  - key: foo
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: baz
    value: shady
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: strict
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

pub async fn rule_shadow_mode(b: &dyn Backend) {
    let (s, d) = start(b, "shadow", SHADOW).await;
    for i in 0..5 {
        let r = s
            .call(request(
                &d,
                vec![
                    descriptor(&[("foo", "pelle")]),
                    descriptor(&[("baz", "shady")]),
                ],
            ))
            .await;
        assert_eq!(
            r.overall_code,
            ok(),
            "request {i}: shadow rules never reject"
        );
        assert_eq!(r.statuses[1].code, ok());
        if i >= 3 {
            assert_eq!(r.statuses[1].limit_remaining, 0);
        }
    }
    // Mixed: a shadow rule over and a normal rule over: the normal rule rejects.
    for _ in 0..2 {
        s.call(request(&d, vec![descriptor(&[("strict", "x")])]))
            .await;
    }
    let r = s
        .call(request(
            &d,
            vec![
                descriptor(&[("baz", "shady")]),
                descriptor(&[("strict", "x")]),
            ],
        ))
        .await;
    assert_eq!(r.overall_code, over());
    assert_eq!(r.statuses[0].code, ok());
    assert_eq!(r.statuses[1].code, over());
    s.stop().await;
}

pub async fn global_shadow_mode(b: &dyn Backend) {
    let options = LimiterOptions {
        global_shadow_mode: true,
        ..LimiterOptions::default()
    };
    let (s, d) = start_with(b, "globalshadow", BASIC, options).await;
    s.call(request(&d, vec![descriptor(&[("one_per_minute", "x")])]))
        .await;
    let r = s
        .call(request(&d, vec![descriptor(&[("one_per_minute", "x")])]))
        .await;
    assert_eq!(r.overall_code, ok(), "global shadow answers OK overall");
    assert_eq!(
        r.statuses[0].code,
        over(),
        "statuses still say what would happen"
    );
    s.stop().await;
}

/// The reference's `test/config/basic_config.yaml`.
const BC: &str = r#"
domain: DOMAIN
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {unit: day, requests_per_unit: 1, name: key4_rate_limit}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - key: subkey5
        value: subvalue5
  - key: key6
    rate_limit: {unlimited: true}
"#;

pub async fn matching_follows_the_reference(b: &dyn Backend) {
    let (s, d) = start(b, "matching", BC).await;
    type Case<'a> = (Vec<(&'a str, &'a str)>, Option<(u32, i32, String)>);
    let cases: Vec<Case<'_>> = vec![
        (
            vec![("key1", "value1"), ("subkey1", "x")],
            Some((5, SECOND, String::new())),
        ),
        (
            vec![("key1", "value1"), ("subkey1", "subvalue1")],
            Some((10, SECOND, String::new())),
        ),
        (vec![("key2", "x")], Some((20, MINUTE, String::new()))),
        (vec![("key2", "value2")], Some((30, MINUTE, String::new()))),
        (vec![("key2", "value3")], None),
        (vec![("key1", "value1")], None),
        // Depth must equal the entry count, and there is no backtracking.
        (vec![("key2", "value2"), ("subkey", "subvalue")], None),
        (vec![("key5", "value5"), ("subkey5", "subvalue")], None),
        (
            vec![("key4", "x")],
            Some((1, DAY, "key4_rate_limit".to_string())),
        ),
        (vec![("nokey", "x")], None),
    ];
    for (entries, expected) in cases {
        let r = s.call(request(&d, vec![descriptor(&entries)])).await;
        assert_eq!(limit_of(&r.statuses[0]), expected, "{entries:?}");
    }
    s.stop().await;
}

const WILDCARD: &str = r#"
domain: DOMAIN
descriptors:
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: noWild
    value: foo
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: midWild
    value: bar*b
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: multiWild
    value: foo*bar*baz
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: nestedWild
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: {unit: minute, requests_per_unit: 10}
"#;

pub async fn wildcards_match_anywhere(b: &dyn Backend) {
    let (s, d) = start(b, "wildcard", WILDCARD).await;
    let matching: Vec<Vec<(&str, &str)>> = vec![
        vec![("wild", "foo1")],
        vec![("wild", "foo2")],
        vec![("midWild", "barab")],
        vec![("midWild", "barb")],
        vec![("multiWild", "foobarbaz")],
        vec![("nestedWild", "val1"), ("wild", "goo2")],
    ];
    for entries in matching {
        let r = s.call(request(&d, vec![descriptor(&entries)])).await;
        assert!(
            r.statuses[0].current_limit.is_some(),
            "{entries:?} should match"
        );
    }
    let not_matching: Vec<Vec<(&str, &str)>> = vec![
        vec![("wild", "bar")],
        vec![("noWild", "foo1")],
        vec![("midWild", "bara")],
        vec![("midWild", "xbarb")],
        vec![("multiWild", "foo123baz")],
        vec![("multiWild", "bar456baz")],
    ];
    for entries in not_matching {
        let r = s.call(request(&d, vec![descriptor(&entries)])).await;
        assert_eq!(
            r.statuses[0].current_limit, None,
            "{entries:?} should not match"
        );
    }
    s.stop().await;
}

pub async fn request_override_wins(b: &dyn Backend) {
    let (s, d) = start(b, "override", BC).await;
    let r = s
        .call(request(
            &d,
            vec![with_override(
                descriptor(&[("key1", "value1"), ("subkey1", "something")]),
                10,
                DAY,
            )],
        ))
        .await;
    assert_eq!(limit_of(&r.statuses[0]), Some((10, DAY, String::new())));
    assert_eq!(r.statuses[0].limit_remaining, 9);
    // Even where no rule matches, as long as the domain exists.
    let r = s
        .call(request(
            &d,
            vec![with_override(descriptor(&[("nothing", "here")]), 1, MINUTE)],
        ))
        .await;
    assert_eq!(limit_of(&r.statuses[0]), Some((1, MINUTE, String::new())));
    let r = s
        .call(request(
            &d,
            vec![with_override(descriptor(&[("nothing", "here")]), 1, MINUTE)],
        ))
        .await;
    assert_eq!(r.overall_code, over());
    // Unknown domain: no limit, override or not.
    let r = s
        .call(request(
            "unknown-domain",
            vec![with_override(descriptor(&[("a", "b")]), 1, MINUTE)],
        ))
        .await;
    assert_eq!(r.statuses[0].current_limit, None);
    s.stop().await;
}

/// Reference #24/#25 with hits: the request's hits_addend applies to each descriptor, and
/// a rejected batch of hits leaves the count as it was.
pub async fn hits_addend(b: &dyn Backend) {
    let (s, d) = start(b, "hits", BASIC).await;
    let mut req = request(&d, vec![descriptor(&[("key2", "h")])]);
    req.hits_addend = 5;
    assert_eq!(s.call(req.clone()).await.statuses[0].limit_remaining, 15);
    req.hits_addend = 16;
    let r = s.call(req.clone()).await;
    assert_eq!(r.overall_code, over());
    req.hits_addend = 15;
    let r = s.call(req).await;
    assert_eq!(
        r.overall_code,
        ok(),
        "the rejected 16 hits were not recorded"
    );
    assert_eq!(r.statuses[0].limit_remaining, 0);
    s.stop().await;
}

/// Reference #26: a per-descriptor hits_addend of 0 checks without recording; it wins over the
/// request's hits_addend.
pub async fn per_descriptor_hits_zero_checks_only(b: &dyn Backend) {
    let (s, d) = start(b, "checkonly", BASIC).await;
    let mut req = request(&d, vec![with_hits(descriptor(&[("key2", "c")]), 0)]);
    req.hits_addend = 7;
    for _ in 0..30 {
        let r = s.call(req.clone()).await;
        assert_eq!(r.overall_code, ok());
        assert_eq!(r.statuses[0].limit_remaining, 20);
    }
    let r = s
        .call(request(
            &d,
            vec![with_hits(descriptor(&[("key2", "c")]), 20)],
        ))
        .await;
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let r = s
        .call(request(
            &d,
            vec![with_hits(descriptor(&[("key2", "c")]), 0)],
        ))
        .await;
    assert_eq!(
        r.overall_code,
        ok(),
        "a full window with 0 hits is still OK"
    );
    assert_eq!(r.statuses[0].limit_remaining, 0);
    s.stop().await;
}

pub async fn zero_limit_blocks_everything(b: &dyn Backend) {
    let config = "domain: DOMAIN\ndescriptors:\n  - key: blocked\n    rate_limit: {unit: second, requests_per_unit: 0}\n";
    let (s, d) = start(b, "zero", config).await;
    let r = s
        .call(request(&d, vec![descriptor(&[("blocked", "x")])]))
        .await;
    assert_eq!(r.overall_code, over());
    assert_eq!(r.statuses[0].limit_remaining, 0);
    s.stop().await;
}

/// The reference's example config for `replaces` (its replaces.sh).
const REPLACES: &str = r#"
domain: DOMAIN
descriptors:
  - key: foo
    descriptors:
      - key: bar
        value: banned
        rate_limit: {unit: minute, requests_per_unit: 0, name: banned_limit}
      - key: bar
        value: bkthomps
        rate_limit: {unit: minute, requests_per_unit: 1, name: bkthomps}
  - key: source_cluster
    value: proxy
    descriptors:
      - key: destination_cluster
        value: override
        rate_limit:
          unit: minute
          requests_per_unit: 2
          replaces: [{name: banned_limit}]
      - key: destination_cluster
        value: bkthomps
        rate_limit:
          unit: minute
          requests_per_unit: 2
          replaces: [{name: bkthomps}]
"#;

pub async fn replaces_removes_named_limits(b: &dyn Backend) {
    let (s, d) = start(b, "replaces", REPLACES).await;
    let banned = descriptor(&[("foo", "bkthomps"), ("bar", "banned")]);
    assert_eq!(
        s.call(request(&d, vec![banned.clone()])).await.overall_code,
        over()
    );
    let replacer = descriptor(&[
        ("source_cluster", "proxy"),
        ("destination_cluster", "override"),
    ]);
    let codes: Vec<i32> = {
        let mut v = Vec::new();
        for _ in 0..3 {
            v.push(
                s.call(request(&d, vec![banned.clone(), replacer.clone()]))
                    .await
                    .overall_code,
            );
        }
        v
    };
    assert_eq!(codes, vec![ok(), ok(), over()]);

    let original = descriptor(&[("foo", "my_foo"), ("bar", "bkthomps")]);
    let replacer = descriptor(&[
        ("source_cluster", "proxy"),
        ("destination_cluster", "bkthomps"),
    ]);
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = s
            .call(request(&d, vec![original.clone(), replacer.clone()]))
            .await;
        assert_eq!(
            r.statuses[0].current_limit, None,
            "the replaced limit is not reported"
        );
        codes.push(r.overall_code);
    }
    assert_eq!(codes, vec![ok(), ok(), over()]);
    // The replaced limit's log was never touched: alone it still has its one request.
    let other = descriptor(&[
        ("source_cluster", "proxy"),
        ("destination_cluster", "not_bkthomps"),
    ]);
    let r = s
        .call(request(&d, vec![original.clone(), other.clone()]))
        .await;
    assert_eq!(r.overall_code, ok());
    let r = s.call(request(&d, vec![original, other])).await;
    assert_eq!(r.overall_code, over());
    s.stop().await;
}

const QUOTA: &str = r#"
domain: DOMAIN
descriptors:
  - key: service
    value: service_1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: service
    value: service_2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
"#;

pub async fn quota_mode_rejects_only_when_all_quotas_are_over(b: &dyn Backend) {
    let (s, d) = start(b, "quota", QUOTA).await;
    let mut codes = Vec::new();
    for _ in 0..3 {
        let r = s
            .call(request(
                &d,
                vec![
                    descriptor(&[("service", "service_1")]),
                    descriptor(&[("service", "service_2")]),
                ],
            ))
            .await;
        codes.push(r.overall_code);
    }
    assert_eq!(codes, vec![ok(), ok(), over()]);
    s.stop().await;
}

const EXTENSIONS: &str = r#"
domain: DOMAIN
descriptors:
  - key: phone
    rate_limits:
      - {name: burst, requests_per_unit: 3, unit: minute}
      - {name: hourly, requests_per_unit: 10, unit: hour}
      - {name: daily, requests_per_unit: 50, unit: day}
  - key: client
    rate_limit: {name: ninety, requests_per_unit: 2, window: 90s}
  - key: login
    rate_limit: {unit: minute, requests_per_unit: 2}
    ban: 10m
"#;

pub async fn three_windows_on_one_descriptor(b: &dyn Backend) {
    let (s, d) = start(b, "windows", EXTENSIONS).await;
    let call = || s.call(request(&d, vec![descriptor(&[("phone", "13800000000")])]));
    let mut admitted = 0;
    // 3 per minute: the 4th in the same minute is rejected by the burst window.
    for _ in 0..4 {
        if call().await.overall_code == ok() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 3);
    let r = call().await;
    assert_eq!(
        limit_of(&r.statuses[0]),
        Some((3, MINUTE, "burst".to_string()))
    );
    assert_eq!(reset_ms(&r.statuses[0]), Some(60_000));
    // One request a minute later: the hourly window binds after 10.
    for _ in 0..10 {
        s.clock.advance(61_000);
        if call().await.overall_code == ok() {
            admitted += 1;
        }
    }
    assert_eq!(admitted, 10);
    let r = call().await;
    assert_eq!(r.overall_code, over());
    assert_eq!(
        limit_of(&r.statuses[0]).map(|l| l.2),
        Some("hourly".to_string())
    );
    // The first three aged out of the hour at T0 + 3600 s; now is T0 + 610 s.
    assert_eq!(reset_ms(&r.statuses[0]), Some(3_600_000 - 610_000));
    s.stop().await;
}

pub async fn arbitrary_window(b: &dyn Backend) {
    let (s, d) = start(b, "arbitrary", EXTENSIONS).await;
    let call = || s.call(request(&d, vec![descriptor(&[("client", "c")])]));
    assert_eq!(call().await.overall_code, ok());
    s.clock.advance(30_000);
    let r = call().await;
    assert_eq!(r.overall_code, ok());
    // 90 s reports as the nearest unit, MINUTE, with the configured limit.
    assert_eq!(
        limit_of(&r.statuses[0]),
        Some((2, MINUTE, "ninety".to_string()))
    );
    s.clock.advance(59_999);
    assert_eq!(
        call().await.overall_code,
        over(),
        "the first entry is 89.999 s old"
    );
    s.clock.advance(1);
    assert_eq!(
        call().await.overall_code,
        ok(),
        "exactly 90 s old: out of the window"
    );
    s.stop().await;
}

pub async fn ban_blocks_then_expires(b: &dyn Backend) {
    let (s, d) = start(b, "ban", EXTENSIONS).await;
    let call = || s.call(request(&d, vec![descriptor(&[("login", "u1")])]));
    assert_eq!(call().await.overall_code, ok());
    assert_eq!(call().await.overall_code, ok());
    let r = call().await;
    assert_eq!(r.overall_code, over());
    assert_eq!(
        reset_ms(&r.statuses[0]),
        Some(600_000),
        "going over bans for 10 minutes"
    );
    // A minute later the window has room, but the ban holds.
    s.clock.advance(120_000);
    let r = call().await;
    assert_eq!(r.overall_code, over());
    assert_eq!(reset_ms(&r.statuses[0]), Some(480_000));
    // Other values are not banned.
    assert_eq!(
        s.call(request(&d, vec![descriptor(&[("login", "u2")])]))
            .await
            .overall_code,
        ok()
    );
    s.clock.advance(480_000);
    assert_eq!(call().await.overall_code, ok(), "the ban ended by itself");
    s.stop().await;
}

/// The fixed-window failure: N at the end of one minute and N at the start of the next. A
/// rolling window never admits more than N in any 60 s.
pub async fn rolling_window_has_no_boundary_burst(b: &dyn Backend) {
    let (s, d) = start(b, "rolling", BASIC).await;
    let call = || s.call(request(&d, vec![descriptor(&[("key2", "edge")])]));
    s.clock.set(T0 + 50_000);
    for _ in 0..20 {
        assert_eq!(call().await.overall_code, ok());
    }
    s.clock.set(T0 + 61_000);
    assert_eq!(
        call().await.overall_code,
        over(),
        "the minute boundary does not reset anything"
    );
    s.clock.set(T0 + 110_000);
    assert_eq!(
        call().await.overall_code,
        ok(),
        "60 s after the burst, room again"
    );
    s.stop().await;
}

pub async fn same_millisecond_burst_is_all_counted(b: &dyn Backend) {
    let (s, d) = start(b, "samems", BASIC).await;
    let mut admitted = 0;
    for _ in 0..60 {
        if s.call(request(&d, vec![descriptor(&[("key1", "burst")])]))
            .await
            .overall_code
            == ok()
        {
            admitted += 1;
        }
    }
    assert_eq!(
        admitted, 50,
        "the clock did not move: all 60 calls fell in one millisecond"
    );
    s.stop().await;
}

pub async fn response_headers(b: &dyn Backend) {
    let options = LimiterOptions {
        response_headers: true,
        ..LimiterOptions::default()
    };
    let (s, d) = start_with(b, "headers", EXTENSIONS, options).await;
    let call = || s.call(request(&d, vec![descriptor(&[("client", "h")])]));
    let r = call().await;
    let header = |r: &slidegate::proto::RateLimitResponse, name: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key == name)
            .map(|h| h.value.clone())
    };
    assert_eq!(
        header(&r, "RateLimit-Policy").as_deref(),
        Some("\"ninety\";q=2;w=90")
    );
    assert_eq!(
        header(&r, "RateLimit").as_deref(),
        Some("\"ninety\";r=1;t=90")
    );
    assert_eq!(header(&r, "Retry-After"), None);
    s.clock.advance(10_500);
    call().await;
    let r = call().await;
    assert_eq!(r.overall_code, over());
    assert_eq!(
        header(&r, "Retry-After").as_deref(),
        Some("80"),
        "79.5 s until the first entry ages out"
    );
    assert_eq!(
        header(&r, "RateLimit").as_deref(),
        Some("\"ninety\";r=0;t=80")
    );
    s.stop().await;
}

/// 64 concurrent clients hammer one descriptor limited to 100 per minute: exactly 100 pass.
pub async fn exact_under_concurrency(b: &dyn Backend) {
    let config = "domain: DOMAIN\ndescriptors:\n  - key: hot\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
    let (s, d) = start(b, "exact", config).await;
    assert_eq!(
        hammer(&[s.grpc_addr], &d, "hot").await,
        100,
        "640 calls, 100 per minute"
    );
    s.stop().await;
}

const COUNTER: &str = r#"
domain: DOMAIN
descriptors:
  - key: tokens
    algorithm: sliding_counter
    rate_limit: {requests_per_unit: 3, window: 10s}
  - key: big
    algorithm: sliding_counter
    buckets: 60
    rate_limit: {requests_per_unit: 1000000, unit: minute}
  - key: hot
    algorithm: sliding_counter
    rate_limit: {unit: minute, requests_per_unit: 100}
"#;

/// sliding_counter: 10 buckets of 1 s over a 10 s window. A bucket counts while it overlaps the
/// window, so the counter never admits more than the log would, and waits at most one bucket
/// longer.
pub async fn sliding_counter_is_bounded_by_one_bucket(b: &dyn Backend) {
    let (s, d) = start(b, "counter", COUNTER).await;
    let call = || s.call(request(&d, vec![descriptor(&[("tokens", "t")])]));
    for t in [5_500, 6_200, 6_300] {
        s.clock.set(T0 + t);
        assert_eq!(call().await.overall_code, ok(), "at +{t} ms");
    }
    s.clock.set(T0 + 14_000);
    assert_eq!(call().await.overall_code, over());
    // The exact log would admit here (+5,500 left the window at +15,500); the bucket +5..+6 s
    // still overlaps it, and leaves at +16 s.
    s.clock.set(T0 + 15_600);
    let r = call().await;
    assert_eq!(r.overall_code, over());
    assert_eq!(reset_ms(&r.statuses[0]), Some(400));
    s.clock.set(T0 + 16_000);
    let r = call().await;
    assert_eq!(r.overall_code, ok());
    assert_eq!(
        r.statuses[0].limit_remaining, 0,
        "+6.2 s, +6.3 s and this one"
    );
    assert_eq!(
        reset_ms(&r.statuses[0]),
        Some(1_000),
        "bucket +6..+7 s leaves at +17 s"
    );
    s.stop().await;
}

/// Large limits and hits cost nothing per hit with sliding_counter.
pub async fn sliding_counter_takes_large_hits(b: &dyn Backend) {
    let (s, d) = start(b, "counterbig", COUNTER).await;
    for n in 1..=10u32 {
        let r = s
            .call(request(
                &d,
                vec![with_hits(descriptor(&[("big", "b")]), 100_000)],
            ))
            .await;
        assert_eq!(r.overall_code, ok(), "call {n}");
        assert_eq!(r.statuses[0].limit_remaining, 1_000_000 - n * 100_000);
    }
    let r = s
        .call(request(&d, vec![with_hits(descriptor(&[("big", "b")]), 1)]))
        .await;
    assert_eq!(r.overall_code, over());
    s.stop().await;
}

/// 64 concurrent clients on a sliding_counter limited to 100 per minute: exactly 100 pass.
pub async fn sliding_counter_exact_under_concurrency(b: &dyn Backend) {
    let (s, d) = start(b, "counterexact", COUNTER).await;
    assert_eq!(hammer(&[s.grpc_addr], &d, "hot").await, 100);
    s.stop().await;
}

/// Two windows whose buckets have the same length (4 a minute and 100 in 60 s, 10 buckets each)
/// share their buckets: a hit counts once, so all four requests of the minute pass.
pub async fn sliding_counter_windows_sharing_a_bucket_count_once(b: &dyn Backend) {
    let config = r#"
domain: DOMAIN
descriptors:
  - key: twin
    rate_limits:
      - {unit: minute, requests_per_unit: 4}
      - {window: 60s, requests_per_unit: 100}
    algorithm: sliding_counter
"#;
    let (s, d) = start(b, "twinbuckets", config).await;
    for n in 1..=4 {
        let r = s
            .call(request(&d, vec![descriptor(&[("twin", "t")])]))
            .await;
        assert_eq!(r.overall_code, ok(), "request {n}");
    }
    let r = s
        .call(request(&d, vec![descriptor(&[("twin", "t")])]))
        .await;
    assert_eq!(r.overall_code, over(), "the fifth is over 4 a minute");
    s.stop().await;
}

const TOKENS: &str = r#"
domain: DOMAIN
descriptors:
  - key: tokens
    rate_limit: {unit: hour, requests_per_unit: 10000}
    debit: true
  - key: weighted
    rate_limit: {unit: hour, requests_per_unit: 10000}
"#;

/// A descriptor's hits are tokens: one log entry per call, counted by weight, with an exact
/// remaining and an exact reset (until enough weight leaves for a request of that size).
pub async fn weighted_hits_count_as_tokens(b: &dyn Backend) {
    let (s, d) = start(b, "weighted", TOKENS).await;
    let call = |hits: u64| request(&d, vec![with_hits(descriptor(&[("weighted", "w")]), hits)]);
    let r = s.call(call(9_000)).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (ok(), 1_000)
    );
    s.clock.advance(600_000);
    let r = s.call(call(2_000)).await;
    assert_eq!(r.overall_code, over(), "9,000 + 2,000 > 10,000");
    // 1,000 tokens must leave: the 9,000 entry, at T0 + 1 h, 50 minutes from now.
    assert_eq!(reset_ms(&r.statuses[0]), Some(3_000_000));
    let r = s.call(call(1_000)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (ok(), 0));
    // 10,001 can never fit: the whole window.
    let r = s.call(call(10_001)).await;
    assert_eq!(reset_ms(&r.statuses[0]), Some(3_600_000));
    s.stop().await;
}

/// A debit rule charges usage that already happened: a call that crosses the budget is still
/// recorded, a check (hits 0) fails once the budget is spent, and once spent nothing more is
/// charged until enough weight ages out.
pub async fn debits_charge_usage_that_happened(b: &dyn Backend) {
    let (s, d) = start(b, "debits", TOKENS).await;
    let call = |hits: u64| request(&d, vec![with_hits(descriptor(&[("tokens", "u")]), hits)]);
    let r = s.call(call(6_000)).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (ok(), 4_000)
    );
    let r = s.call(call(0)).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (ok(), 4_000),
        "a check"
    );
    s.clock.advance(600_000);
    let r = s.call(call(5_000)).await;
    assert_eq!(r.overall_code, over(), "the debit crosses the budget");
    let r = s.call(call(0)).await;
    assert_eq!(
        r.overall_code,
        over(),
        "11,000 recorded: the budget is spent"
    );
    // Room for one token again once 1,001 have left: the 6,000 entry, at T0 + 1 h.
    assert_eq!(reset_ms(&r.statuses[0]), Some(3_000_000));
    let r = s.call(call(1)).await;
    assert_eq!(r.overall_code, over(), "nothing more is charged once spent");
    s.clock.advance(3_000_000);
    let r = s.call(call(0)).await;
    assert_eq!(
        (r.overall_code, r.statuses[0].limit_remaining),
        (ok(), 5_000),
        "only the crossing 5,000 remain; the refused debit of 1 was not charged"
    );
    s.stop().await;
}

/// 16 clients at once, each checking (hits 0) and, when admitted, debiting 1..=50,000 tokens on
/// a budget of 10,000 an hour, straight against the store. Every answer must fit one
/// sequential history (the brute-force model): recorded debits form a chain of running totals
/// each starting below the budget; refused debits and checks see a total of that chain; a check
/// fits exactly while the total is below the budget; the total exceeds the budget by less than
/// the debit that crossed it.
pub async fn debits_under_concurrency_match_a_sequential_model(b: &dyn Backend) {
    use slidegate::store::{Algorithm, CheckItem, Role, StoreKey, Window};
    const LIMIT: u64 = 10_000;
    let store = b.store().await;
    let key = StoreKey::new(&unique_domain("budget"), "");
    let item = move |hits: u64| CheckItem {
        key: key.clone(),
        windows: std::borrow::Cow::Owned(vec![Window {
            limit: 10_000,
            length_ms: 3_600_000,
        }]),
        algorithm: Algorithm::SlidingLog,
        ban_ms: None,
        hits,
        role: Role::Enforce,
        debit: true,
        text: None,
    };
    let mut tasks = Vec::new();
    for client in 0..16u64 {
        let (store, item) = (store.clone(), item.clone());
        tasks.push(tokio::spawn(async move {
            let mut seen = Vec::new();
            let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (client + 1);
            for _ in 0..6 {
                let check = [item(0)];
                let outcome = store.check(&check, T0).await.expect("check");
                let fits = outcome.items[0].fits;
                seen.push((0, outcome.items[0].clone()));
                if fits {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    let hits = 1 + state % 50_000;
                    let debit = [item(hits)];
                    let outcome = store.check(&debit, T0).await.expect("debit");
                    seen.push((hits, outcome.items[0].clone()));
                }
            }
            seen
        }));
    }
    let mut calls = Vec::new();
    for task in tasks {
        calls.extend(task.await.expect("client"));
    }
    let count = |o: &slidegate::store::ItemOutcome| o.windows[0].count;
    // The chain of recorded debits, in the order their totals grew.
    let mut recorded: Vec<(u64, u64)> = calls
        .iter()
        .filter(|(_, o)| o.recorded)
        .map(|(hits, o)| (*hits, count(o)))
        .collect();
    recorded.sort_by_key(|(_, total)| *total);
    let mut totals = vec![0u64];
    for (hits, total) in &recorded {
        let before = *totals.last().expect("a total");
        assert!(
            before < LIMIT,
            "a debit was charged with the budget already spent: {recorded:?}"
        );
        assert_eq!(*total, before + hits, "totals form one chain: {recorded:?}");
        totals.push(*total);
    }
    let last = *totals.last().expect("a total");
    for (hits, o) in &calls {
        assert!(
            totals.contains(&count(o)),
            "{hits} saw a total outside the chain: {o:?}"
        );
        if *hits == 0 {
            assert_eq!(
                o.fits,
                count(o) < LIMIT,
                "a check fits exactly while below the budget"
            );
        } else if !o.recorded {
            assert!(
                count(o) >= LIMIT,
                "a refused debit came after the budget was spent"
            );
        } else {
            assert_eq!(
                o.fits,
                count(o) <= LIMIT,
                "a debit is OK iff it stays within"
            );
        }
    }
    if last >= LIMIT {
        let crossing = recorded.last().map_or(0, |(hits, _)| *hits);
        assert!(
            last < LIMIT + crossing,
            "over by less than the crossing debit: {last}"
        );
    }
    let final_check = store.check(&[item(0)], T0).await.expect("check");
    assert_eq!(final_check.items[0].fits, last < LIMIT);
    assert!(!recorded.is_empty(), "some debits were charged");
}

const CACHED: &str = r#"
domain: DOMAIN
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: other
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: banned
    rate_limit: {unit: minute, requests_per_unit: 1}
    ban: 10m
"#;

/// Store calls so far, from the server's own metrics.
async fn store_calls(s: &TestServer) -> f64 {
    let (_, text) = http(s.http_addr, "GET", "/metrics", "").await;
    text.lines()
        .filter(|l| l.starts_with("slidegate_store_duration_seconds_count"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A descriptor the store found over is answered without the store until the moment the store
/// said it would fit again, with the store's answer counted down; then the store decides
/// again. The other descriptors of such a request are still asked about, recording nothing.
pub async fn known_over_descriptors_skip_the_store(b: &dyn Backend) {
    let (s, d) = start(b, "cached", CACHED).await;
    let k = || descriptor(&[("k", "a")]);
    for n in 0..3 {
        assert_eq!(
            s.call(request(&d, vec![k()])).await.overall_code,
            ok(),
            "{n}"
        );
        s.clock.advance(1_000);
    }
    // 3 admitted at T0, T0+1s, T0+2s; the 4th (T0+3s) fits when the first leaves: T0+60s.
    let r = s.call(request(&d, vec![k()])).await;
    assert_eq!(r.overall_code, over());
    assert_eq!(reset_ms(&r.statuses[0]), Some(57_000));
    assert_eq!(s.limiter.over_limit_cached(), 1);

    let before = store_calls(&s).await;
    s.clock.advance(7_000);
    let r = s.call(request(&d, vec![k()])).await;
    assert_eq!(r.overall_code, over());
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert_eq!(
        reset_ms(&r.statuses[0]),
        Some(50_000),
        "the store's reset, counted down"
    );
    assert_eq!(store_calls(&s).await, before, "answered without the store");

    // With another descriptor: rejected, the other asked about, nothing recorded for it.
    let r = s
        .call(request(&d, vec![k(), descriptor(&[("other", "x")])]))
        .await;
    assert_eq!(r.overall_code, over());
    assert_eq!(r.statuses[0].code, over());
    assert_eq!(
        (r.statuses[1].code, r.statuses[1].limit_remaining),
        (ok(), 10),
        "as in any rejected request: the room it has, nothing taken"
    );
    let r = s
        .call(request(&d, vec![descriptor(&[("other", "x")])]))
        .await;
    assert_eq!(
        r.statuses[0].limit_remaining, 9,
        "the rejected request recorded nothing"
    );

    // A request for more hits is the store's to answer (its reset is later).
    let r = s.call(request(&d, vec![with_hits(k(), 2)])).await;
    assert_eq!(r.overall_code, over());
    assert_eq!(
        reset_ms(&r.statuses[0]),
        Some(51_000),
        "until two entries leave"
    );

    // Up to the reset, over; at it, the store admits.
    s.clock.advance(49_999);
    assert_eq!(s.call(request(&d, vec![k()])).await.overall_code, over());
    s.clock.advance(1);
    let r = s.call(request(&d, vec![k()])).await;
    assert_eq!(r.overall_code, ok(), "admitted the moment the store said");

    // A reload forgets what was over.
    s.call(request(&d, vec![k()])).await;
    assert!(s.limiter.over_limit_cached() >= 1);
    s.limiter.replace_limits((*s.limiter.limits()).clone());
    assert_eq!(s.limiter.over_limit_cached(), 0);
    s.stop().await;
}

/// A ban is cached for its whole length; a banned request with another descriptor still sets
/// that descriptor's own ban when it is over too.
pub async fn cached_bans_and_bans_of_the_others(b: &dyn Backend) {
    let (s, d) = start(b, "cached-ban", CACHED).await;
    let banned = || descriptor(&[("banned", "u")]);
    assert_eq!(s.call(request(&d, vec![banned()])).await.overall_code, ok());
    let r = s.call(request(&d, vec![banned()])).await;
    assert_eq!(
        (r.overall_code, reset_ms(&r.statuses[0])),
        (over(), Some(600_000))
    );
    let before = store_calls(&s).await;
    s.clock.advance(100_000);
    let r = s.call(request(&d, vec![banned()])).await;
    assert_eq!(
        (r.overall_code, reset_ms(&r.statuses[0])),
        (over(), Some(500_000))
    );
    assert_eq!(store_calls(&s).await, before);
    // Another user of the banned rule, over its own limit in a request rejected by the cached
    // ban: its ban is set all the same.
    let other = || descriptor(&[("banned", "v")]);
    assert_eq!(s.call(request(&d, vec![other()])).await.overall_code, ok());
    let r = s.call(request(&d, vec![banned(), other()])).await;
    assert_eq!(r.overall_code, over());
    assert_eq!(reset_ms(&r.statuses[1]), Some(600_000), "v's ban was set");
    s.clock.advance(500_000);
    assert_eq!(
        s.call(request(&d, vec![banned()])).await.overall_code,
        ok(),
        "the ban is over"
    );
    s.stop().await;
}

/// Generates one test per scenario for a backend expression.
#[macro_export]
macro_rules! conformance_suite {
    ($backend:expr) => {
        $crate::conformance_suite!(@tests $backend;
            unknown_domain_is_ok_without_limit, basic_limit_reports_remaining_and_reset, over_limit_after_n,
            rejected_requests_record_nothing, reset_counts_down, share_threshold_shares_one_log,
            invalid_requests_are_rejected_and_record_nothing, entryless_descriptor_is_ok_and_others_still_apply, unlimited_and_whitelisted, rule_shadow_mode,
            global_shadow_mode, matching_follows_the_reference, wildcards_match_anywhere, request_override_wins,
            hits_addend, per_descriptor_hits_zero_checks_only, zero_limit_blocks_everything,
            replaces_removes_named_limits, quota_mode_rejects_only_when_all_quotas_are_over,
            three_windows_on_one_descriptor, arbitrary_window, ban_blocks_then_expires,
            rolling_window_has_no_boundary_burst, same_millisecond_burst_is_all_counted, response_headers,
            exact_under_concurrency, sliding_counter_is_bounded_by_one_bucket,
            sliding_counter_takes_large_hits, sliding_counter_exact_under_concurrency,
            sliding_counter_windows_sharing_a_bucket_count_once, weighted_hits_count_as_tokens,
            debits_charge_usage_that_happened, debits_under_concurrency_match_a_sequential_model,
            known_over_descriptors_skip_the_store, cached_bans_and_bans_of_the_others,
            quota_fleet_shares_one_limit_exactly, quota_shares_move_with_demand,
            quota_denies_a_used_up_window_and_matches_any_order);
    };
    (@tests $backend:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let backend = $backend;
                $crate::conformance::$name(&backend).await;
            }
        )*
    };
}
