//! OpenTelemetry export (feature `otel`): the spans idemq's handlers run in, and every
//! other `tracing` span of the application, sent over OTLP to a collector.
//!
//! ```no_run
//! # fn main() -> Result<(), idemq::otel::Error> {
//! // Logs to stderr (`RUST_LOG`, else `info`) and spans to OTEL_EXPORTER_OTLP_ENDPOINT.
//! let otel = idemq::otel::init()?;
//! // ... build and run the runtime, or `idemq::cli::run` (it keeps this subscriber) ...
//! drop(otel); // sends the spans still buffered; at the end of `main`, or sooner
//! # Ok(()) }
//! ```
//!
//! Or add the layer to a subscriber of your own ([`layer`]):
//!
//! ```no_run
//! use tracing_subscriber::layer::SubscriberExt;
//! use tracing_subscriber::util::SubscriberInitExt;
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (otel, _guard) = idemq::otel::layer()?;
//! tracing_subscriber::registry()
//!     .with(otel)
//!     .with(tracing_subscriber::fmt::layer().json())
//!     .with(tracing_subscriber::EnvFilter::new("info"))
//!     .try_init()?;
//! # Ok(()) }
//! ```
//!
//! **What the spans say.** A handler of one message runs in a span named `handler`
//! (fields `handler`, `key`, `trace_id`) whose parent is the delivery's sender, as its
//! W3C `traceparent` header names it; without one it starts a trace. Every message
//! the handler publishes (through the outbox: the header is stored with the row when
//! it is enqueued, not taken when the relay sends it) carries a `traceparent` naming
//! the handler's span, so the next consumer's span is its child: a pipeline is one
//! trace. A batch handler's span, one for many deliveries, starts a trace of its own
//! with a link to each delivery's sender (OpenTelemetry's messaging conventions), and
//! what it publishes for a message continues that message's trace. A reply is made
//! after its handler's span ended: it carries the request's trace id under a span id
//! of its own. Without this feature the headers are propagated all the same, each
//! with a random span id.
//!
//! **Configuration** is OpenTelemetry's own environment, read by [`layer`]:
//! - `OTEL_EXPORTER_OTLP_ENDPOINT` (default `http://localhost:4318`; `/v1/traces` is
//!   appended) or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (taken as it is); `https://`
//!   verifies the collector against the system's trust store;
//! - `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds, 10 000
//!   by default) and their `_TRACES_` forms;
//! - `OTEL_SERVICE_NAME` or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`, else the
//!   binary's file name;
//! - `OTEL_TRACES_SAMPLER` (`_ARG`): by default parent-based, so a delivery sampled
//!   upstream is sampled here and one that was not is not; `OTEL_BSP_*` for the batch
//!   span processor.
//!
//! The transport is OTLP over HTTP with protobuf bodies (the collector's port 4318):
//! `OTEL_EXPORTER_OTLP_PROTOCOL` is not read, and gRPC is not offered (it would bring
//! tonic and hyper into the build). Spans are exported in batches from a thread of the
//! SDK's own, with a blocking HTTP client ([ureq](https://docs.rs/ureq)) over idemq's
//! rustls: the runtime's tasks never wait for the collector, and a collector that is
//! down costs dropped spans, never a delivery. The SDK reports nothing of a failed
//! export while it runs (its internal log is off); the guard's drop logs a failed
//! shutdown.
//!
//! The crates of the span types are re-exported here ([`opentelemetry`],
//! [`opentelemetry_sdk`], [`tracing_opentelemetry`]), so an application can build a
//! provider of its own (another exporter, an in-memory one in a test) without
//! matching their versions: give its tracer to [`tracing_opentelemetry::layer`].

use std::future::{ready, Future};
use std::io::IsTerminal;
use std::pin::Pin;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry::InstrumentationScope;
use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

pub use opentelemetry;
pub use opentelemetry_sdk;
pub use tracing_opentelemetry;

/// The `tracing` layer that turns spans into OpenTelemetry spans, made by [`layer`].
pub type Layer<S> = tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>;

/// Why the export could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The OTLP exporter refused its configuration: an `OTEL_EXPORTER_OTLP_*`
    /// variable is invalid (an endpoint that is not a URL, a header that does not
    /// parse). The cause names it.
    #[error("the OTLP span exporter cannot be set up from the OTEL_EXPORTER_OTLP_* variables")]
    Exporter(#[source] opentelemetry_otlp::ExporterBuildError),
    /// [`init`] found a `tracing` subscriber already installed: add [`layer`] to that
    /// one instead.
    #[error("a tracing subscriber is already installed: add idemq::otel::layer() to it instead of init()")]
    SubscriberSet(#[source] tracing_subscriber::util::TryInitError),
}

/// Keeps the span export running; dropping it sends the spans still buffered and
/// shuts the exporter down (waiting for the collector, at most the export timeout).
/// Keep it until the end of `main`, after the runtime has stopped.
#[must_use = "dropping the guard shuts the span export down at once: keep it until the program ends"]
#[derive(Debug)]
pub struct Guard {
    provider: SdkTracerProvider,
}

impl Guard {
    /// The tracer provider the layer's spans go to (to make more tracers from, or to
    /// flush at a moment of your choosing with `force_flush`).
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Err(err) = self.provider.shutdown() {
            crate::base::log::warn!(error = %err, "OpenTelemetry: the span export did not shut down cleanly");
        }
    }
}

/// A layer exporting every span it sees over OTLP/HTTP as the `OTEL_*` variables say
/// (see the [module docs](self)), and the guard that flushes it. Add it to a
/// `tracing_subscriber::registry()`; the subscriber's filters decide which spans it
/// sees (idemq's `handler` spans are at `INFO`). Sets no global state.
///
/// # Errors
/// [`Error::Exporter`] when an `OTEL_EXPORTER_OTLP_*` variable is invalid.
pub fn layer<S>() -> Result<(Layer<S>, Guard), Error>
where
    S: tracing::Subscriber + for<'span> LookupSpan<'span>,
{
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpBinary)
        .with_http_client(Ureq::new(export_timeout(|name| std::env::var(name).ok())))
        .build()
        .map_err(Error::Exporter)?;
    let provider =
        SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource()).build();
    let scope = InstrumentationScope::builder("idemq").with_version(env!("CARGO_PKG_VERSION")).build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer_with_scope(scope));
    Ok((layer, Guard { provider }))
}

/// Installs, as the global `tracing` subscriber, [`layer`] beside a log to stderr
/// (human lines, filtered by `RUST_LOG`, else `info`; the same filter decides which
/// spans are exported), and makes the provider OpenTelemetry's global one. Call it
/// first thing in `main`: `idemq::cli` then keeps this subscriber (its
/// `--log-format` is not applied; build your own with [`layer`] for that).
///
/// # Errors
/// [`Error::Exporter`] as [`layer`]; [`Error::SubscriberSet`] when a subscriber is
/// already installed.
pub fn init() -> Result<Guard, Error> {
    let (otel, guard) = layer()?;
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::registry()
        .with(otel)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(crate::app::stderr::StderrLines::get())
                .with_ansi(ansi),
        )
        .with(filter)
        .try_init()
        .map_err(Error::SubscriberSet)?;
    opentelemetry::global::set_tracer_provider(guard.provider.clone());
    Ok(guard)
}

/// The SDK's resource (`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_SERVICE_NAME`), named after
/// the binary when neither names the service (the SDK would say `unknown_service`).
fn resource() -> Resource {
    let detected = Resource::builder().build();
    let named = detected
        .get(&opentelemetry::Key::from_static_str("service.name"))
        .is_some_and(|name| !name.as_str().starts_with("unknown_service"));
    match binary_name() {
        Some(binary) if !named => Resource::builder().with_service_name(binary).build(),
        _ => detected,
    }
}

/// The running binary's file name, without an extension.
fn binary_name() -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    exe.file_stem()?.to_str().map(str::to_owned)
}

/// How long one export may take: `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else
/// `OTEL_EXPORTER_OTLP_TIMEOUT` (milliseconds, as the exporter reads them), else 10 s.
fn export_timeout(var: impl Fn(&str) -> Option<String>) -> Duration {
    ["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"]
        .into_iter()
        .find_map(|name| var(name)?.trim().parse().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis)
}

/// The exporter's HTTP client: ureq, blocking, which is what the SDK's batch span
/// processor wants (it exports from a thread of its own, outside any async runtime);
/// TLS by idemq's rustls (ring) against the system's trust store.
#[derive(Debug)]
struct Ureq(ureq::Agent);

/// The largest collector answer read (an OTLP answer is a few bytes, or a status).
const MAX_RESPONSE: u64 = 4 * 1024 * 1024;

impl Ureq {
    fn new(timeout: Duration) -> Self {
        let roots: Vec<ureq::tls::Certificate<'static>> = rustls_native_certs::load_native_certs()
            .certs
            .iter()
            .map(|der| ureq::tls::Certificate::from_der(der).to_owned())
            .collect();
        let tls = ureq::tls::TlsConfig::builder()
            .provider(ureq::tls::TlsProvider::Rustls)
            .root_certs(ureq::tls::RootCerts::from(roots))
            .unversioned_rustls_crypto_provider(crate::tls::provider())
            .build();
        let config = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            // The exporter reads the status itself (it retries 429 and 503).
            .http_status_as_error(false)
            .tls_config(tls)
            .build();
        Self(config.new_agent())
    }

    fn send(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let answer = self.0.run(Request::from_parts(parts, &body[..]))?;
        let (parts, mut body) = answer.into_parts();
        let bytes = body.with_config().limit(MAX_RESPONSE).read_to_vec()?;
        Ok(Response::from_parts(parts, Bytes::from(bytes)))
    }
}

// `HttpClient` is an `async_trait`; this is its expansion. The request is sent when
// the exporter calls, on the processor's thread, and the future is ready.
impl HttpClient for Ureq {
    fn send_bytes<'client, 'future>(
        &'client self,
        request: Request<Bytes>,
    ) -> Pin<Box<dyn Future<Output = Result<Response<Bytes>, HttpError>> + Send + 'future>>
    where
        'client: 'future,
        Self: 'future,
    {
        Box::pin(ready(self.send(request)))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    use opentelemetry::trace::Tracer as _;

    use super::*;

    /// What the collector received: the request line, the headers (lowercase), the body.
    type Received = (String, Vec<String>, Vec<u8>);

    /// A collector of one request on loopback, at the endpoint returned: answers 200
    /// and hands back what it received.
    fn collector() -> (String, std::thread::JoinHandle<Received>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port");
        let endpoint = format!("http://{}/v1/traces", listener.local_addr().expect("its address"));
        let served = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("the exporter connects");
            let mut reader = BufReader::new(stream);
            let mut line = String::new();
            reader.read_line(&mut line).expect("a request line");
            let mut headers = Vec::new();
            loop {
                let mut header = String::new();
                reader.read_line(&mut header).expect("a header");
                if header.trim().is_empty() {
                    break;
                }
                headers.push(header.trim().to_ascii_lowercase());
            }
            let length = headers
                .iter()
                .find_map(|header| header.strip_prefix("content-length:"))
                .map_or(0, |n| n.trim().parse().expect("a length"));
            let mut body = vec![0; length];
            reader.read_exact(&mut body).expect("the body");
            let mut stream = reader.into_inner();
            stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").expect("the answer");
            (line.trim().to_owned(), headers, body)
        });
        (endpoint, served)
    }

    #[test]
    fn spans_go_to_the_collector_as_otlp_protobuf_over_http() {
        let (endpoint, served) = collector();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(endpoint)
            .with_http_client(Ureq::new(Duration::from_secs(5)))
            .build()
            .expect("an exporter");
        let provider = SdkTracerProvider::builder().with_simple_exporter(exporter).build();
        provider.tracer("idemq").in_span("handler", |_| {});
        let (line, headers, body) = served.join().expect("the collector");
        provider.shutdown().expect("shut down");
        assert_eq!(line, "POST /v1/traces HTTP/1.1");
        assert!(headers.contains(&"content-type: application/x-protobuf".to_owned()), "{headers:?}");
        assert!(body.windows(b"handler".len()).any(|w| w == b"handler"), "the span's name in the body");
    }

    /// An environment of `pairs` only.
    fn env<'a>(pairs: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| pairs.iter().find(|(key, _)| *key == name).map(|(_, value)| (*value).to_owned())
    }

    #[test]
    fn the_export_timeout_is_the_traces_variable_else_the_general_one_else_ten_seconds() {
        assert_eq!(export_timeout(env(&[])), Duration::from_secs(10));
        assert_eq!(
            export_timeout(env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "2500")])),
            Duration::from_millis(2500)
        );
        let both = [("OTEL_EXPORTER_OTLP_TIMEOUT", "2500"), ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "700")];
        assert_eq!(export_timeout(env(&both)), Duration::from_millis(700));
        assert_eq!(export_timeout(env(&[("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")])), Duration::from_secs(10));
    }
}
