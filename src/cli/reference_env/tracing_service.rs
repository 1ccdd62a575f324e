//! The reference's tracing variables that are more than a flag each (the rest are rows of
//! `table.rs`). `TRACING_ENABLED` also names the service `RateLimit`, the reference's default,
//! where no name is given. `TRACING_SAMPLING_RATE` is a ratio that may carry spaces, refused
//! with what 1 means. The collector comes from `OTEL_EXPORTER_OTLP_ENDPOINT`, which the
//! exporter reads itself.

use super::Env;
use crate::cli::ServeArgs;

pub(super) fn apply(args: &mut ServeArgs, Env { var, given, .. }: Env<'_>) -> Result<(), String> {
    if args.tracing && args.tracing_service_name.is_none() && var("TRACING_ENABLED").is_some() {
        args.tracing_service_name = Some("RateLimit".into());
    }
    if let Some(rate) = var("TRACING_SAMPLING_RATE")
        && !given("tracing_sampling_rate")
    {
        args.tracing_sampling_rate = match rate.trim().parse::<f64>() {
            Ok(r) if (0.0..=1.0).contains(&r) => r,
            _ => {
                return Err(format!(
                    "TRACING_SAMPLING_RATE={rate:?}: use a ratio between 0 and 1 (1 samples every trace)"
                ));
            }
        };
    }
    Ok(())
}
