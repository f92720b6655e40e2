//! W3C Trace Context (`traceparent`, `tracestate`) across hops, without a tracing
//! backend: a delivery's trace is read from its headers, and every message its
//! handler publishes (through the outbox, so the context is stored with the row
//! when it is enqueued, not taken at relay time) and every reply to it carries the
//! same trace id under a span id of its own. With the feature `otel` (the `otel`
//! module below), that span id is the handler's OpenTelemetry span's, and the
//! handler's span is the child of the delivery's sender.
//!
//! `traceparent` is `version-traceid-parentid-flags`: 2, 32, 16 and 2 lowercase hex
//! digits. Version `ff` and all-zero ids are invalid; a later version is read by its
//! first four fields, as the specification asks. An invalid header is ignored (the
//! message is not refused for it).

use lapin::BasicProperties;

use crate::base::amqp_value;

/// The `traceparent` header.
pub(crate) const TRACEPARENT: &str = "traceparent";
/// The `tracestate` header (vendor data, passed on as it came).
pub(crate) const TRACESTATE: &str = "tracestate";

/// A delivery's trace: where it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Trace {
    /// 32 lowercase hex digits.
    trace_id: String,
    /// The sender's span id, 16 hex digits: the parent of the handler's span.
    #[cfg(feature = "otel")]
    parent_id: String,
    /// The sampling flags, 2 hex digits.
    flags: String,
    state: Option<String>,
}

impl Trace {
    /// The trace a delivery's headers carry, if a valid one.
    pub(crate) fn of(properties: &BasicProperties) -> Option<Self> {
        let parent = amqp_value::header(properties, TRACEPARENT).and_then(amqp_value::string)?;
        let mut trace = Self::parse(&parent)?;
        trace.state = amqp_value::header(properties, TRACESTATE)
            .and_then(amqp_value::string)
            .filter(|state| !state.is_empty() && state.len() <= 512);
        Some(trace)
    }

    fn parse(header: &str) -> Option<Self> {
        let mut fields = header.trim().split('-');
        let (version, trace_id, parent_id, flags) =
            (fields.next()?, fields.next()?, fields.next()?, fields.next()?);
        let hex = |field: &str, len: usize| {
            field.len() == len && field.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let zero = |field: &str| field.bytes().all(|b| b == b'0');
        let valid = hex(version, 2)
            && version != "ff"
            && (version != "00" || fields.next().is_none())
            && hex(trace_id, 32)
            && !zero(trace_id)
            && hex(parent_id, 16)
            && !zero(parent_id)
            && hex(flags, 2);
        valid.then(|| Self {
            trace_id: trace_id.to_owned(),
            #[cfg(feature = "otel")]
            parent_id: parent_id.to_owned(),
            flags: flags.to_owned(),
            state: None,
        })
    }

    /// The trace id: 32 hex digits.
    pub(crate) fn trace_id(&self) -> &str {
        &self.trace_id
    }

    /// The headers of a message sent on in this trace: `traceparent` with the same
    /// trace id and flags under a new span id, and `tracestate` as it came. With the
    /// feature `otel`, sent from within an OpenTelemetry span of this trace (the
    /// handler's), that span's id and sampling flag instead: the next hop's span is
    /// its child.
    pub(crate) fn child_headers(&self) -> Vec<(String, String)> {
        #[cfg(feature = "otel")]
        let parent = otel::current_span_parent(self).unwrap_or_else(|| self.random_parent());
        #[cfg(not(feature = "otel"))]
        let parent = self.random_parent();
        let mut headers = vec![(TRACEPARENT.to_owned(), parent)];
        if let Some(state) = &self.state {
            headers.push((TRACESTATE.to_owned(), state.clone()));
        }
        headers
    }

    /// `traceparent` with this trace id and flags under a new random span id.
    fn random_parent(&self) -> String {
        let mut span = [0_u8; 8];
        while span == [0; 8] {
            getrandom::fill(&mut span).expect("the operating system's random number generator");
        }
        format!("00-{}-{}-{}", self.trace_id, crate::base::hex(&span), self.flags)
    }
}

/// With the feature `otel`, the `traceparent` of the current OpenTelemetry span —
/// a handler's whose delivery came without a trace, which starts one — so that what
/// it publishes continues that trace. `None` without the feature, or outside such a
/// span.
pub(crate) fn current_traceparent() -> Option<String> {
    #[cfg(feature = "otel")]
    return otel::current_parent();
    #[cfg(not(feature = "otel"))]
    None
}

/// The bridge to OpenTelemetry (feature `otel`, see `idemq::otel`): a handler's span
/// is made the child of its delivery's sender (or, for a batch, linked to each), and
/// what it publishes names it as the parent.
#[cfg(feature = "otel")]
mod otel {
    use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId};
    use tracing_opentelemetry::OpenTelemetrySpanExt;

    use super::Trace;

    impl Trace {
        /// The sender's span, as a remote span context (`parse` checked every field).
        fn span_context(&self) -> SpanContext {
            SpanContext::new(
                TraceId::from_hex(&self.trace_id).unwrap_or(TraceId::INVALID),
                SpanId::from_hex(&self.parent_id).unwrap_or(SpanId::INVALID),
                TraceFlags::new(u8::from_str_radix(&self.flags, 16).unwrap_or_default()),
                true,
                self.state.as_deref().and_then(|state| state.parse().ok()).unwrap_or_default(),
            )
        }

        /// Makes `span`, not yet entered, a child of the sender's span. Without the
        /// OpenTelemetry layer, or with the span filtered out, there is nothing to
        /// set, and nothing is said: the headers are propagated all the same.
        pub(crate) fn adopt(&self, span: &tracing::Span) {
            let parent = opentelemetry::Context::new().with_remote_span_context(self.span_context());
            let _ = span.set_parent(parent);
        }

        /// Links `span` (a batch handler's: one span, many senders) to the sender's.
        pub(crate) fn link(&self, span: &tracing::Span) {
            span.add_link(self.span_context());
        }
    }

    /// The `traceparent` of a message sent from the current span if that is an
    /// OpenTelemetry span of `trace` (the handler's, or one the handler opened in
    /// it): its span id and sampling flag. `None` elsewhere — a batch handler's span
    /// starts a trace of its own, and a reply is made after the handler's span ended.
    pub(super) fn current_span_parent(trace: &Trace) -> Option<String> {
        let current = tracing::Span::current().context();
        let span = current.span();
        let own = span.span_context();
        (own.is_valid() && own.trace_id().to_string() == trace.trace_id)
            .then(|| format!("00-{}-{}-{:02x}", own.trace_id(), own.span_id(), own.trace_flags().to_u8()))
    }

    /// The `traceparent` naming the current span, if it is an OpenTelemetry span.
    pub(super) fn current_parent() -> Option<String> {
        let current = tracing::Span::current().context();
        let span = current.span();
        let own = span.span_context();
        own.is_valid()
            .then(|| format!("00-{}-{}-{:02x}", own.trace_id(), own.span_id(), own.trace_flags().to_u8()))
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{AMQPValue, FieldTable, LongString};

    use super::*;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn with_headers(headers: &[(&str, &str)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (name, value) in headers {
            table.insert((*name).into(), AMQPValue::LongString(LongString::from(*value)));
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn a_child_keeps_the_trace_id_and_flags_under_a_new_span_id() {
        let trace =
            Trace::of(&with_headers(&[(TRACEPARENT, PARENT), (TRACESTATE, "congo=t61rcWkgMzE")])).unwrap();
        assert_eq!(trace.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        let headers = trace.child_headers();
        let child = &headers[0].1;
        let fields: Vec<&str> = child.split('-').collect();
        assert_eq!(fields[0], "00");
        assert_eq!(fields[1], "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(fields[2].len(), 16);
        assert_ne!(fields[2], "00f067aa0ba902b7", "a span of its own");
        assert_eq!(fields[3], "01");
        assert_eq!(headers[1], (TRACESTATE.to_owned(), "congo=t61rcWkgMzE".to_owned()));
        assert_ne!(trace.child_headers()[0].1, *child, "each child its own span");
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            assert_eq!(Trace::of(&with_headers(&[(TRACEPARENT, bad)])), None, "{bad:?}");
        }
        assert_eq!(Trace::of(&BasicProperties::default()), None);
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        let trace = Trace::of(&with_headers(&[(TRACEPARENT, later)])).unwrap();
        assert!(trace.child_headers()[0].1.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"));
    }
}
