//! The second config source: `RateLimitConfig` resources received over xDS (Envoy Gateway's
//! way of configuring its rate-limit service). Each resource is written out as one config
//! document in the file format and compiled by the same compiler as files, so a rule means the
//! same whichever way it arrived. Only what the proto can carry is written: the reference
//! format's fields, none of slidegate's extensions.

use prost::Message;
use serde_json::{Map, Value, json};

use super::compile::{LoadOptions, compile_sources_with};
use super::errors::{ConfigError, ConfigErrors};
use crate::limiter::rules::Limits;
use crate::proto::ratelimit::config::ratelimit::v3::{
    RateLimitConfig, RateLimitDescriptor, RateLimitPolicy, RateLimitUnit,
};

/// The type URL of the resource, as the reference server subscribes to it.
pub const RATE_LIMIT_CONFIG_TYPE: &str =
    "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// Compiles the resources of one discovery response (all of them: state of the world), all
/// or nothing. Resources are decoded, then named `xds:<name>` in errors.
pub fn compile_resources(
    resources: &[pbjson_types::Any],
    options: LoadOptions,
) -> Result<Limits, ConfigErrors> {
    let update = compile_update(resources, options, &[])?;
    if update.rejected.is_empty() {
        Ok(update.limits)
    } else {
        Err(ConfigErrors(update.rejected))
    }
}

/// What one discovery response makes of the rules.
pub struct Update {
    pub limits: Limits,
    /// Each resource's document as compiled: the new one, or for a rejected resource the one
    /// it had before (see [`compile_update`]).
    pub sources: Vec<(String, String)>,
    /// Why resources were rejected; empty when every one compiled.
    pub rejected: Vec<ConfigError>,
}

/// Compiles one discovery response resource by resource: a resource that does not compile on
/// its own (a unit slidegate cannot serve, a broken descriptor) is rejected alone, and keeps
/// the document it had in `previous` (the [`Update::sources`] last applied), so the other
/// resources still take effect. Errors between resources (one domain in two of them) refuse
/// the whole response.
pub fn compile_update(
    resources: &[pbjson_types::Any],
    options: LoadOptions,
    previous: &[(String, String)],
) -> Result<Update, ConfigErrors> {
    let mut sources = Vec::with_capacity(resources.len());
    let mut rejected = Vec::new();
    for (n, any) in resources.iter().enumerate() {
        let (name, text) = match source(any, n) {
            Ok(source) => source,
            Err((name, e)) => {
                rejected.push(e);
                sources.extend(
                    previous
                        .iter()
                        .find(|(p, _)| Some(p) == name.as_ref())
                        .cloned(),
                );
                continue;
            }
        };
        let alone = [(name.clone(), text)];
        match compile_sources_with(&alone, options) {
            Ok(_) => sources.extend(alone),
            Err(ConfigErrors(errors)) => {
                rejected.extend(errors);
                sources.extend(previous.iter().find(|(p, _)| *p == name).cloned());
            }
        }
    }
    let limits = compile_sources_with(&sources, options)?;
    Ok(Update {
        limits,
        sources,
        rejected,
    })
}

/// A resource's name and config document; or why not, with its name where it has one.
fn source(
    any: &pbjson_types::Any,
    n: usize,
) -> Result<(String, String), (Option<String>, ConfigError)> {
    let error = |file: String, message: String| ConfigError {
        file,
        line: 0,
        path: String::new(),
        message,
    };
    if any.type_url != RATE_LIMIT_CONFIG_TYPE {
        return Err((
            None,
            error(
                format!("xds:resource[{n}]"),
                format!(
                    "resource of type {} where {RATE_LIMIT_CONFIG_TYPE} was expected",
                    any.type_url
                ),
            ),
        ));
    }
    let config = RateLimitConfig::decode(any.value.as_ref()).map_err(|e| {
        let message = format!("cannot decode RateLimitConfig: {e}");
        (None, error(format!("xds:resource[{n}]"), message))
    })?;
    let name = source_name(&config, n);
    match document(&config) {
        Ok(text) => Ok((name, text)),
        Err(message) => Err((Some(name.clone()), error(name, message))),
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
    if d.detailed_metric {
        out.insert("detailed_metric".into(), Value::Bool(true));
    }
    if d.quota_mode {
        out.insert("quota_mode".into(), Value::Bool(true));
    }
    if let Some(metadata) = &d.metadata {
        out.insert("metadata".into(), struct_json(metadata));
    }
    Ok(Value::Object(out))
}

/// A `google.protobuf.Struct` as the JSON object it stands for.
fn struct_json(s: &pbjson_types::Struct) -> Value {
    Value::Object(
        s.fields
            .iter()
            .map(|(k, v)| (k.clone(), value_json(v)))
            .collect(),
    )
}

fn value_json(v: &pbjson_types::Value) -> Value {
    use pbjson_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::StructValue(s)) => struct_json(s),
        Some(Kind::ListValue(l)) => Value::Array(l.values.iter().map(value_json).collect()),
    }
}

fn rate_limit(p: &RateLimitPolicy) -> Result<Value, String> {
    let mut out = Map::new();
    let unit = match RateLimitUnit::try_from(p.unit) {
        Ok(RateLimitUnit::Second) => Some("second"),
        Ok(RateLimitUnit::Minute) => Some("minute"),
        Ok(RateLimitUnit::Hour) => Some("hour"),
        Ok(RateLimitUnit::Day) => Some("day"),
        Ok(RateLimitUnit::Week) => Some("week"),
        Ok(RateLimitUnit::Month) => Some("month"),
        Ok(RateLimitUnit::Year) => Some("year"),
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
