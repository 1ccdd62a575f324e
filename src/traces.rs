//! OpenTelemetry traces (`--tracing`): spans of `ShouldRateLimit` calls and their store calls,
//! exported over OTLP (gRPC or HTTP/protobuf) by a task of their own, so a decision never waits
//! on the collector. A call joins the caller's trace when it carries W3C `traceparent` or B3
//! (single `b3` or multi `X-B3-*`) headers, as Envoy sends them with its tracing on.
//!
//! Off (the default), nothing here runs but one flag check per call ([`enabled`]).
//!
//! The spans are `tracing`'s own (the limiter's `should_rate_limit`, the store's calls),
//! turned into OpenTelemetry spans by `tracing-opentelemetry`'s layer, which the binary
//! installs with the exporter made here ([`start`]). Whether a call is sampled is decided when
//! it arrives ([`callers_context`]), and its spans are made only while a sampled call runs
//! ([`sampled_here`], the layer's filter): a call not sampled costs no span at all.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry::propagation::{TextMapCompositePropagator, TextMapPropagator as _};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider, SpanData, SpanExporter, SpanProcessor};
use tokio::sync::{mpsc, oneshot};

/// How spans leave the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Grpc,
    Http,
}

#[derive(Clone, Debug)]
pub struct TraceOptions {
    pub protocol: Protocol,
    /// The collector, as `OTEL_EXPORTER_OTLP_ENDPOINT` names it (for HTTP the base: `/v1/traces`
    /// is added to a URL without a path); `None` reads the `OTEL_EXPORTER_OTLP_*` variables.
    pub endpoint: Option<String>,
    /// Of the traces this process starts, the fraction sampled.
    pub sampling_rate: f64,
    /// Follow the caller's decision where it sent one (sampled or not).
    pub parent_based: bool,
    /// `None`: `OTEL_SERVICE_NAME` if set, else `slidegate`.
    pub service_name: Option<String>,
    pub service_namespace: Option<String>,
    /// `None`: a random one per start.
    pub service_instance_id: Option<String>,
    /// Spans waiting for export at most; more are dropped and counted ([`dropped`]).
    pub queue: usize,
}

/// Spans exported in one request at most.
const BATCH: usize = 512;
/// How long spans wait before a partial batch goes.
const EXPORT_EVERY: Duration = Duration::from_secs(1);
/// One export's deadline.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

static ENABLED: AtomicBool = AtomicBool::new(false);
/// The sampling settings, set by [`start`]: the rate as a threshold on 64 random bits (or the
/// trace id's low 64), and whether a caller's sampled flag decides.
static SAMPLING: OnceLock<(u64, bool)> = OnceLock::new();

thread_local! {
    /// Set while a sampled call is polled on this thread ([`within`]).
    static SAMPLED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}
static DROPPED: AtomicU64 = AtomicU64::new(0);
static PROPAGATOR: OnceLock<TextMapCompositePropagator> = OnceLock::new();

/// Whether traces are on: the transports look for a caller's trace context only then.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Spans dropped because the export queue was full (the collector slow or away).
pub fn dropped() -> u64 {
    DROPPED.load(Ordering::Relaxed)
}

/// The caller's trace context in `headers` (W3C `traceparent`, then B3), as the parent of the
/// spans of the work done under it.
pub fn extract(headers: &http::HeaderMap) -> Context {
    let propagator = PROPAGATOR.get_or_init(|| {
        // Later propagators win: a call carrying both is read by its `traceparent`.
        TextMapCompositePropagator::new(vec![
            Box::new(opentelemetry_propagator_b3::Propagator::with_encoding(
                opentelemetry_propagator_b3::B3Encoding::SingleAndMultiHeader,
            )),
            Box::new(opentelemetry_sdk::propagation::TraceContextPropagator::new()),
        ])
    });
    propagator.extract(&opentelemetry_http::HeaderExtractor(headers))
}

/// A call under traces: the caller's context (or none), and whether the call is sampled, as
/// decided when it arrived.
pub struct Traced {
    context: Context,
    sampled: bool,
}

/// With traces on, the call with these `headers`: its caller's context, and whether it is
/// sampled (`None`, after one flag check, when traces are off, or when the call neither
/// carries a context nor is sampled). Parent-based: a caller's sampled flag decides; otherwise
/// the rate does, on the caller's trace id where there is one (so every process sampling by
/// rate picks the same traces), or at random.
pub fn callers_context(headers: &http::HeaderMap) -> Option<Traced> {
    if !enabled() {
        return None;
    }
    let (threshold, parent_based) = *SAMPLING.get()?;
    // Most calls carry no trace context when the caller does not trace: the propagators are
    // run only for a call that has one of their headers.
    let carried = ["traceparent", "b3", "x-b3-traceid"]
        .iter()
        .any(|name| headers.contains_key(*name));
    let context = if carried {
        extract(headers)
    } else {
        Context::new()
    };
    let parent = context.span().span_context().clone();
    let sampled = if parent.is_valid() && parent_based {
        parent.is_sampled()
    } else {
        let bits = if parent.is_valid() {
            // The low 64 bits: a trace id's random part.
            let id = parent.trace_id().to_bytes();
            let mut low = [0u8; 8];
            low.copy_from_slice(&id[8..]);
            u64::from_be_bytes(low)
        } else {
            random_u64()
        };
        bits < threshold
    };
    (sampled || parent.is_valid()).then_some(Traced { context, sampled })
}

/// `work` under the caller's context ([`callers_context`]), its spans made when it is
/// sampled; as it is without a context. (Not sampled, the caller's trace id still reaches the
/// decision log.)
pub fn within<F: std::future::Future>(
    traced: Option<Traced>,
    work: F,
) -> impl std::future::Future<Output = F::Output> {
    use futures_util::future::Either;
    use opentelemetry::context::FutureExt as _;
    // Boxed when traced, so that the untraced future is no larger than `work`.
    match traced {
        Some(Traced { context, sampled }) => Either::Left(Sampled {
            work: Box::pin(work.with_context(context)),
            sampled,
        }),
        None => Either::Right(work),
    }
}

/// Whether a sampled call is running on this thread: the layer makes spans only then.
pub fn sampled_here() -> bool {
    SAMPLED.with(std::cell::Cell::get)
}

static LOG_SPANS: AtomicBool = AtomicBool::new(false);

/// Tells whether the log shows debug-level spans (then every call makes its spans).
pub fn set_log_spans(shown: bool) {
    LOG_SPANS.store(shown, Ordering::Relaxed);
}

/// Whether slidegate's code should make its spans now: always while traces are off (the
/// log's level decides, as `tracing` does), and with traces on only while a sampled call runs
/// or the log shows them. (A span no layer wants is still made and kept by `tracing`'s
/// registry once any layer filters per span; not making it saves that.)
pub fn spans_wanted() -> bool {
    !enabled() || LOG_SPANS.load(Ordering::Relaxed) || sampled_here()
}

/// A traced call's future: a sampled one marks the thread as running it while it is polled.
struct Sampled<F> {
    work: std::pin::Pin<Box<F>>,
    sampled: bool,
}

impl<F: std::future::Future> std::future::Future for Sampled<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let sampled = self.sampled;
        let before = SAMPLED.with(|s| s.replace(sampled));
        let polled = self.work.as_mut().poll(cx);
        SAMPLED.with(|s| s.set(before));
        polled
    }
}

/// 64 random bits, from the standard library's per-map random keys.
fn random_u64() -> u64 {
    use std::hash::BuildHasher as _;
    std::collections::hash_map::RandomState::new().hash_one(0u8)
}

/// The rate as a threshold on 64 random bits.
fn threshold(rate: f64) -> u64 {
    if rate >= 1.0 {
        u64::MAX
    } else {
        // In [0, 2^64): the float-to-integer conversion saturates.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let t = (rate.max(0.0) * 18_446_744_073_709_551_616.0) as u64;
        t
    }
}

/// The trace the call being decided belongs to, for the decision log: its span's, or where it
/// has none (not sampled) the caller's; `None` without either.
pub fn current_trace_id() -> Option<String> {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    if !enabled() {
        return None;
    }
    let ours = tracing::Span::current().context();
    let callers = Context::current();
    [ours, callers].iter().find_map(|context| {
        let span = context.span();
        let id = span.span_context();
        id.is_valid().then(|| id.trace_id().to_string())
    })
}

/// What [`start`] hands back: the provider (its tracer goes into the layer) and a way to send
/// what is queued before the process exits.
pub struct Tracing {
    pub provider: SdkTracerProvider,
    flush: mpsc::Sender<Message>,
}

impl Tracing {
    /// Sends the spans still queued, waiting at most `within`.
    pub async fn flush(&self, within: Duration) {
        let (done, flushed) = oneshot::channel();
        if self.flush.send(Message::Flush(done)).await.is_ok() {
            let _ = tokio::time::timeout(within, flushed).await;
        }
    }
}

/// Builds the exporter and the provider, and starts the export task on the current runtime.
/// An error names the option that is wrong.
pub fn start(options: &TraceOptions) -> Result<Tracing, String> {
    let mut exporter = exporter(options)?;
    let resource = resource(options);
    exporter.set_resource(&resource);
    let (queue, spans) = mpsc::channel(options.queue.max(1));
    tokio::spawn(export_forever(exporter, spans));
    let _ = SAMPLING.set((threshold(options.sampling_rate), options.parent_based));
    // Sampling is decided when a call arrives (`callers_context`): a span made is sampled.
    let provider = SdkTracerProvider::builder()
        .with_span_processor(Queue {
            queue: queue.clone(),
        })
        .with_sampler(Sampler::AlwaysOn)
        .with_resource(resource)
        .build();
    // Warm the propagator, so the first traced call does not build it.
    let _ = extract(&http::HeaderMap::new());
    ENABLED.store(true, Ordering::Relaxed);
    Ok(Tracing {
        provider,
        flush: queue,
    })
}

impl Tracing {
    /// The tracer for `tracing-opentelemetry`'s layer.
    pub fn tracer(&self) -> opentelemetry_sdk::trace::Tracer {
        self.provider.tracer("slidegate")
    }
}

fn exporter(options: &TraceOptions) -> Result<opentelemetry_otlp::SpanExporter, String> {
    use opentelemetry_otlp::WithExportConfig as _;
    let endpoint = options.endpoint.as_deref();
    if endpoint.is_some_and(|e| e.starts_with("https://")) {
        return Err(format!(
            "--tracing-endpoint {}: TLS to the collector is not supported; send to a collector on the node or in the pod over http://",
            endpoint.unwrap_or_default()
        ));
    }
    let built = match options.protocol {
        Protocol::Grpc => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_timeout(EXPORT_TIMEOUT);
            if let Some(endpoint) = endpoint {
                builder = builder.with_endpoint(endpoint);
            }
            builder.build()
        }
        Protocol::Http => {
            let mut builder = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_timeout(EXPORT_TIMEOUT);
            if let Some(endpoint) = endpoint {
                builder = builder.with_endpoint(http_traces_url(endpoint));
            }
            builder.build()
        }
    };
    built.map_err(|e| {
        format!(
            "--tracing-endpoint {}: {e}; the accepted form is http://HOST:PORT (OTLP gRPC by default on 4317, HTTP on 4318)",
            endpoint.unwrap_or("(from OTEL_EXPORTER_OTLP_ENDPOINT)")
        )
    })
}

/// An HTTP collector's base URL with the traces path, where it has no path of its own.
fn http_traces_url(endpoint: &str) -> String {
    let rest = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest);
    if rest.trim_end_matches('/').contains('/') {
        endpoint.to_string()
    } else {
        format!("{}/v1/traces", endpoint.trim_end_matches('/'))
    }
}

fn resource(options: &TraceOptions) -> Resource {
    // The builder reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; the options win.
    let mut builder = Resource::builder();
    let from_env = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty());
    match (&options.service_name, from_env) {
        (Some(name), _) => builder = builder.with_service_name(name.clone()),
        (None, false) => builder = builder.with_service_name("slidegate"),
        (None, true) => {}
    }
    if let Some(namespace) = &options.service_namespace {
        builder = builder.with_attribute(KeyValue::new("service.namespace", namespace.clone()));
    }
    let instance = options
        .service_instance_id
        .clone()
        .unwrap_or_else(random_instance_id);
    builder
        .with_attribute(KeyValue::new("service.instance.id", instance))
        .with_attribute(KeyValue::new("service.version", crate::VERSION))
        .build()
}

/// A random id in the UUID layout (version 4), as the reference makes one.
fn random_instance_id() -> String {
    use std::hash::BuildHasher as _;
    let random = |n: u64| std::collections::hash_map::RandomState::new().hash_one(n);
    let (high, low) = (random(1), random(2));
    let high = (high & !0xf000) | 0x4000;
    let low = (low & !(0xc << 60)) | (0x8 << 60);
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        high >> 32,
        (high >> 16) & 0xffff,
        high & 0xffff,
        low >> 48,
        low & 0xffff_ffff_ffff
    )
}

enum Message {
    Span(Box<SpanData>),
    Flush(oneshot::Sender<()>),
}

/// The span processor: a finished, sampled span goes into a bounded queue without waiting; a
/// full queue drops it and counts it.
#[derive(Debug)]
struct Queue {
    queue: mpsc::Sender<Message>,
}

impl SpanProcessor for Queue {
    fn on_start(&self, _: &mut opentelemetry_sdk::trace::Span, _: &Context) {}

    fn on_end(&self, span: SpanData) {
        if self.queue.try_send(Message::Span(Box::new(span))).is_err() {
            DROPPED.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _: Duration) -> OTelSdkResult {
        Ok(())
    }
}

/// Sends the queued spans in batches of up to [`BATCH`], at least every [`EXPORT_EVERY`], one
/// export at a time, each within [`EXPORT_TIMEOUT`]. A failed export is logged (at most once a
/// minute) and its spans are lost: the collector's absence costs traces, never decisions.
async fn export_forever(
    exporter: opentelemetry_otlp::SpanExporter,
    mut queue: mpsc::Receiver<Message>,
) {
    let mut batch: Vec<SpanData> = Vec::with_capacity(BATCH);
    let mut tick = tokio::time::interval(EXPORT_EVERY);
    let mut last_warning: Option<tokio::time::Instant> = None;
    loop {
        let mut flushed = None;
        tokio::select! {
            message = queue.recv() => match message {
                Some(Message::Span(span)) => {
                    batch.push(*span);
                    if batch.len() < BATCH {
                        continue;
                    }
                }
                Some(Message::Flush(done)) => flushed = Some(done),
                None => return,
            },
            _ = tick.tick() => {}
        }
        if !batch.is_empty() {
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(BATCH));
            let count = spans.len();
            let result = tokio::time::timeout(EXPORT_TIMEOUT, exporter.export(spans)).await;
            let error = match result {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {EXPORT_TIMEOUT:?}")),
            };
            if let Some(error) = error {
                let now = tokio::time::Instant::now();
                if last_warning.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(60)) {
                    last_warning = Some(now);
                    tracing::warn!(spans = count, "traces not exported: {error}");
                }
            }
        }
        if let Some(done) = flushed {
            let _ = done.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_http_url_gets_the_traces_path_unless_it_has_one() {
        assert_eq!(http_traces_url("http://c:4318"), "http://c:4318/v1/traces");
        assert_eq!(http_traces_url("http://c:4318/"), "http://c:4318/v1/traces");
        assert_eq!(
            http_traces_url("http://c:4318/custom"),
            "http://c:4318/custom"
        );
    }

    #[test]
    fn instance_ids_are_uuid_v4_shaped_and_differ() {
        let a = random_instance_id();
        let b = random_instance_id();
        assert_ne!(a, b);
        let parts: Vec<&str> = a.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            vec![8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'), "{a}");
    }

    #[test]
    fn the_rate_is_a_threshold_on_64_bits() {
        assert_eq!(threshold(1.0), u64::MAX);
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(0.5), 1 << 63);
        assert!(random_u64() != random_u64());
    }

    #[test]
    fn a_callers_context_is_read_from_w3c_and_b3_headers() {
        let trace_id = |headers: &[(&str, &str)]| {
            let mut map = http::HeaderMap::new();
            for (name, value) in headers {
                map.insert(
                    http::HeaderName::from_bytes(name.as_bytes()).expect("name"),
                    value.parse().expect("value"),
                );
            }
            let cx = extract(&map);
            let span = cx.span();
            let id = span.span_context();
            id.is_valid()
                .then(|| (id.trace_id().to_string(), id.is_sampled()))
        };
        let w3c = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            trace_id(&[("traceparent", w3c)]),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736".into(), true))
        );
        assert_eq!(
            trace_id(&[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-0")]),
            Some(("80f198ee56343ba864fe8b2a57d3eff7".into(), false))
        );
        assert_eq!(
            trace_id(&[
                ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
                ("x-b3-spanid", "a2fb4a1d1a96d312"),
                ("x-b3-sampled", "1"),
            ]),
            Some(("463ac35c9f6413ad48485a3953bb6124".into(), true))
        );
        assert_eq!(trace_id(&[]), None);
        assert_eq!(trace_id(&[("traceparent", "garbage")]), None);
    }
}
