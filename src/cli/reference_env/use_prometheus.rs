//! `USE_PROMETHEUS=true`: the reference's metric names, also served alone on `PROMETHEUS_ADDR`
//! (`host:port` or `:port`; `:9090` by default) at `PROMETHEUS_PATH`.

use super::Env;
use super::listeners::socket_addr;
use super::table::{self, boolean};
use crate::cli::{MetricNamesArg, ServeArgs};

pub(super) fn apply(
    args: &mut ServeArgs,
    env: Env<'_>,
    notes: &mut Vec<String>,
) -> Result<(), String> {
    let Env { var, given, .. } = env;
    if boolean(var, "USE_PROMETHEUS")? != Some(true) {
        return Ok(());
    }
    if !given("metric_names") {
        args.metric_names = MetricNamesArg::Reference;
    }
    if !given("metrics_addr") {
        let text = var("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
        let wrong = || format!("PROMETHEUS_ADDR={text:?}: write host:port or :port");
        let (host, port) = text.rsplit_once(':').ok_or_else(wrong)?;
        let host = (!host.is_empty()).then_some(host);
        args.metrics_addr = Some(socket_addr(host, Some(port), 9090).map_err(|_| wrong())?);
    }
    table::apply(table::WITH_PROMETHEUS, args, env, notes)
}
