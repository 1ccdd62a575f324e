//! The second config source: `RateLimitConfig` resources received over xDS (Envoy Gateway's
//! way of configuring its rate-limit service). Each resource is written out as one config
//! document in the file format and compiled by the same compiler as files, so a rule means the
//! same whichever way it arrived. Only what the proto can carry is written: the reference
//! format's fields, none of slidegate's extensions.

use prost::Message;
use serde_json::{Map, Value, json};

use super::load::{ConfigError, ConfigErrors, LoadOptions, compile_sources_with};
use crate::limiter::rules::Limits;
use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

/// The type URL of the resource, as the reference server subscribes to it.
pub const RATE_LIMIT_CONFIG_TYPE: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Compiles the resources of one discovery response (all of them: state of the world).
/// Resources are decoded, then named `xds:<name>` in errors.
pub fn compile_resources(
    resources: &[pbjson_types::Any],
    options: LoadOptions,
) -> Result<Limits, ConfigErrors> {
    let mut sources = Vec::with_capacity(resources.len());
    let mut errors = Vec::new();
    for (n, any) in resources.iter().enumerate() {
        let error = |message: String| ConfigError {
            file: format!("xds:resource[{n}]"),
            line: 0,
            path: String::new(),
            message,
        };
        if any.type_url != RATE_LIMIT_CONFIG_TYPE {
            errors.push(error(format!(
                "resource of type {} where {RATE_LIMIT_CONFIG_TYPE} was expected",
                any.type_url
            )));
            continue;
        }
        match RateLimitConfig::decode(any.value.as_ref()) {
            Ok(config) => match document(&config) {
                Ok(text) => sources.push((source_name(&config, n), text)),
                Err(message) => errors.push(ConfigError {
                    file: source_name(&config, n),
                    ..error(message)
                }),
            },
            Err(e) => errors.push(error(format!("cannot decode RateLimitConfig: {e}"))),
        }
    }
    match compile_sources_with(&sources, options) {
        Ok(limits) if errors.is_empty() => Ok(limits),
        Ok(_) => Err(ConfigErrors(errors)),
        Err(ConfigErrors(more)) => {
            errors.extend(more);
            Err(ConfigErrors(errors))
        }
    }
}

fn source_name(config: &RateLimitConfig, n: usize) -> String {
    if config.name.is_empty() {
        format!("xds:resource[{n}]")
    } else {
        format!("xds:{}", config.name)
    }
}

/// The resource as a config document. JSON is YAML, and pretty-printed it gives the compiler's
/// errors a line each.
pub fn document(config: &RateLimitConfig) -> Result<String, String> {
    let descriptors = descriptors(&config.descriptors)?;
    let doc = json!({ "domain": config.domain, "descriptors": descriptors });
    serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())
}

fn descriptors(list: &[RateLimitDescriptor]) -> Result<Vec<Value>, String> {
    list.iter().map(descriptor).collect()
}

fn descriptor(d: &RateLimitDescriptor) -> Result<Value, String> {
    let mut out = Map::new();
    out.insert("key".into(), Value::String(d.key.clone()));
    // An empty value matches any value, as an absent one does in a file.
    if !d.value.is_empty() {
        out.insert("value".into(), Value::String(d.value.clone()));
    }
    if let Some(policy) = &d.rate_limit {
        out.insert("rate_limit".into(), rate_limit(policy)?);
    }
    if !d.descriptors.is_empty() {
        out.insert(
            "descriptors".into(),
            Value::Array(descriptors(&d.descriptors)?),
        );
    }
    if d.shadow_mode {
        out.insert("shadow_mode".into(), Value::Bool(true));
    }
    Ok(Value::Object(out))
}

fn rate_limit(p: &RateLimitPolicy) -> Result<Value, String> {
    let mut out = Map::new();
    let unit = match RateLimitUnit::try_from(p.unit) {
        Ok(RateLimitUnit::Second) => Some("second"),
        Ok(RateLimitUnit::Minute) => Some("minute"),
        Ok(RateLimitUnit::Hour) => Some("hour"),
        Ok(RateLimitUnit::Day) => Some("day"),
        // Left out, so the compiler reports a missing unit unless the policy is unlimited.
        Ok(RateLimitUnit::Unknown) => None,
        Err(_) => return Err(format!("rate_limit.unit {} is not a known unit", p.unit)),
    };
    if let Some(unit) = unit {
        out.insert("unit".into(), Value::String(unit.into()));
    }
    out.insert("requests_per_unit".into(), json!(p.requests_per_unit));
    if p.unlimited {
        out.insert("unlimited".into(), Value::Bool(true));
    }
    if !p.name.is_empty() {
        out.insert("name".into(), Value::String(p.name.clone()));
    }
    if !p.replaces.is_empty() {
        let replaces = p
            .replaces
            .iter()
            .map(|r| json!({ "name": r.name }))
            .collect();
        out.insert("replaces".into(), Value::Array(replaces));
    }
    Ok(Value::Object(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::compile_sources;
    use crate::proto::ratelimit::config::ratelimit::v3::RateLimitReplace;

    fn any(config: &RateLimitConfig) -> pbjson_types::Any {
        pbjson_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: config.encode_to_vec().into(),
        }
    }

    fn policy(unit: RateLimitUnit, n: u32) -> Option<RateLimitPolicy> {
        Some(RateLimitPolicy {
            unit: unit.into(),
            requests_per_unit: n,
            ..Default::default()
        })
    }

    /// The shape Envoy Gateway sends for an HTTPRoute rule with a distinct header match.
    fn gateway_like() -> RateLimitConfig {
        let route = "httproute/default/backend/rule/0/match/0/www_example_com";
        RateLimitConfig {
            name: "default/eg/http".into(),
            domain: "default/eg/http".into(),
            descriptors: vec![RateLimitDescriptor {
                key: route.into(),
                value: route.into(),
                descriptors: vec![RateLimitDescriptor {
                    key: "rule-0-match-0".into(),
                    rate_limit: policy(RateLimitUnit::Hour, 3),
                    ..Default::default()
                }],
                ..Default::default()
            }],
        }
    }

    #[test]
    fn a_resource_compiles_like_the_same_rules_written_in_a_file() {
        let from_xds = compile_resources(&[any(&gateway_like())], LoadOptions::default())
            .expect("valid resource");
        let yaml = "domain: default/eg/http\ndescriptors:\n  - key: httproute/default/backend/rule/0/match/0/www_example_com\n    value: httproute/default/backend/rule/0/match/0/www_example_com\n    descriptors:\n      - key: rule-0-match-0\n        rate_limit: {unit: hour, requests_per_unit: 3}\n";
        let from_file = compile_sources(&[("f.yaml".into(), yaml.into())]).expect("valid file");
        // Everything but where the rule came from (file and line) is the same.
        let without_source = |limits: &Limits| {
            let text = format!("{:?}", limits.rules());
            text.split(", source:").next().map(str::to_owned)
        };
        assert_eq!(without_source(&from_xds), without_source(&from_file));
        assert!(format!("{:?}", from_xds.rules()).contains("source: \"xds:default/eg/http:"));
        assert_eq!(from_xds.domains.len(), 1);
    }

    #[test]
    fn replaces_unlimited_and_shadow_mode_carry_over() {
        let config = RateLimitConfig {
            name: "n".into(),
            domain: "d".into(),
            descriptors: vec![
                RateLimitDescriptor {
                    key: "a".into(),
                    rate_limit: Some(RateLimitPolicy {
                        unit: RateLimitUnit::Minute.into(),
                        requests_per_unit: 5,
                        name: "first".into(),
                        ..Default::default()
                    }),
                    shadow_mode: true,
                    ..Default::default()
                },
                RateLimitDescriptor {
                    key: "b".into(),
                    rate_limit: Some(RateLimitPolicy {
                        unlimited: true,
                        replaces: vec![RateLimitReplace {
                            name: "first".into(),
                        }],
                        ..Default::default()
                    }),
                    ..Default::default()
                },
            ],
        };
        let text = document(&config).expect("writes");
        let doc: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(doc["descriptors"][0]["rate_limit"]["name"], "first");
        assert_eq!(doc["descriptors"][0]["shadow_mode"], true);
        assert_eq!(doc["descriptors"][1]["rate_limit"]["unlimited"], true);
        assert_eq!(
            doc["descriptors"][1]["rate_limit"]["replaces"][0]["name"],
            "first"
        );
        assert!(doc["descriptors"][1]["rate_limit"].get("unit").is_none());
        compile_resources(&[any(&config)], LoadOptions::default()).expect("compiles");
    }

    #[test]
    fn bad_resources_are_errors_naming_the_resource() {
        let mut no_unit = gateway_like();
        no_unit.descriptors[0].descriptors[0].rate_limit = policy(RateLimitUnit::Unknown, 3);
        let errors = compile_resources(&[any(&no_unit)], LoadOptions::default())
            .expect_err("a limit without a unit is refused");
        assert!(errors.0[0].file == "xds:default/eg/http", "{errors}");

        let mut odd_unit = gateway_like();
        if let Some(p) = odd_unit.descriptors[0].descriptors[0].rate_limit.as_mut() {
            p.unit = 42;
        }
        let errors = compile_resources(&[any(&odd_unit)], LoadOptions::default())
            .expect_err("unknown enum value");
        assert!(errors.to_string().contains("42"), "{errors}");

        let wrong_type = pbjson_types::Any {
            type_url: "type.googleapis.com/envoy.config.cluster.v3.Cluster".into(),
            value: Vec::new().into(),
        };
        let garbage = pbjson_types::Any {
            type_url: RATE_LIMIT_CONFIG_TYPE.into(),
            value: vec![0xff, 0xff, 0xff].into(),
        };
        let errors =
            compile_resources(&[wrong_type, garbage], LoadOptions::default()).expect_err("refused");
        assert_eq!(errors.0.len(), 2, "{errors}");
        assert!(errors.to_string().contains("Cluster"), "{errors}");
        assert!(errors.to_string().contains("cannot decode"), "{errors}");
    }

    #[test]
    fn two_resources_for_one_domain_need_merging() {
        let a = gateway_like();
        let mut b = gateway_like();
        b.name = "other".into();
        b.descriptors[0].key = "another-route".into();
        b.descriptors[0].value = "another-route".into();
        let both = [any(&a), any(&b)];
        let errors =
            compile_resources(&both, LoadOptions::default()).expect_err("duplicate domain");
        assert!(errors.to_string().contains("duplicate domain"), "{errors}");
        let merged = compile_resources(
            &both,
            LoadOptions {
                merge_domains: true,
                ..LoadOptions::default()
            },
        )
        .expect("merged");
        assert_eq!(merged.rules().len(), 2);
    }

    #[test]
    fn no_resources_is_no_domains() {
        let limits = compile_resources(&[], LoadOptions::default()).expect("empty is valid");
        assert!(limits.domains.is_empty());
    }
}
