//! What a message type says of itself on the wire besides its fields: its *name*
//! (the AMQP `type` property, which routes a delivery among the handlers of one
//! queue) and its *version* (the [`VERSION_HEADER`], which picks how old bodies are
//! read and upcast to the type the handler takes).
//!
//! Both are declared on the type with `#[derive(idemq::Message)]`:
//!
//! ```text
//! #[message(type = "payment.requested")]                          // MessageType
//! #[message(version = 2, previous = PaymentRequestedV1)]          // Versioned, From<V1> for V2
//! ```
//!
//! The handler attribute finds out at compile time which of the two its message
//! type implements ([`Wire::of`], through the probes in `__private`), so a handler
//! needs no option for either.

use std::any::TypeId;
use std::marker::PhantomData;

use lapin::BasicProperties;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::base::amqp_value;
use crate::handler::prepare::fingerprint::{self, Fingerprint};

use crate::base::headers::VERSION as VERSION_HEADER;

/// A message type's name on the wire: the AMQP `type` property it is published
/// with, by which a queue consumed by several handlers routes each delivery to
/// the handler of its type. Written by `#[derive(Message)]`
/// (`#[message(type = "payment.requested")]`).
pub trait MessageType {
    /// The name (e.g. `payment.requested`).
    const TYPE: &'static str;
}

/// A message type with versions: the handler takes the newest, and a body of an
/// older version (by its [`VERSION_HEADER`]) is decoded as that version and upcast,
/// step by step, to the newest before the handler sees it. Written by
/// `#[derive(Message)]` (`#[message(version = 2, previous = PaymentV1)]`, with
/// `impl From<PaymentV1> for Payment` as the step).
///
/// The dedup fingerprint is taken of the upcast message: the same payment sent once
/// as version 1 and once as version 2 is a duplicate, not a conflict.
pub trait Versioned: DeserializeOwned + Serialize + Sized + 'static {
    /// This type's version (from 1).
    const VERSION: u32;
    /// The version before this one (`VERSION - 1`), or `Self` for the oldest kept.
    type Previous: Versioned;
    /// One step of the chain: the previous version's message as this one.
    fn upcast(previous: Self::Previous) -> Self;
}

/// How a handler's message type is read from a delivery: its name and its versions,
/// if it has them. Made by the handler attribute; [`Wire::plain`] for a handler
/// written by hand.
#[doc(hidden)]
pub struct Wire<M> {
    pub(crate) type_name: Option<&'static str>,
    pub(crate) versions: Option<Versions<M>>,
    /// The JSON Schema of its payload (feature `schemars`, for a type that derives
    /// `JsonSchema`), for the AsyncAPI document.
    pub(crate) schema: Option<SchemaFn>,
}

/// Makes a message type's JSON Schema.
pub type SchemaFn = fn() -> serde_json::Value;

impl<M> Wire<M> {
    /// Neither named nor versioned.
    pub fn plain() -> Self {
        Self { type_name: None, versions: None, schema: None }
    }

    /// What the probes found.
    pub fn of(
        type_name: Option<&'static str>,
        versions: Option<Versions<M>>,
        schema: Option<SchemaFn>,
    ) -> Self {
        Self { type_name, versions, schema }
    }
}

/// A versioned type's chain, as functions of the newest version.
#[doc(hidden)]
pub struct Versions<M> {
    decode: DecodeFn<M>,
    chain: ChainFn,
}

/// Decodes a body as a version of the chain, upcast and fingerprinted.
type DecodeFn<M> = fn(u32, &[u8]) -> Result<(M, Fingerprint), VersionError>;

/// The chain, newest first, or the gap in it.
type ChainFn = fn() -> Result<Vec<(u32, &'static str)>, String>;

impl<M: Versioned> Versions<M> {
    fn new() -> Self {
        Self { decode: decode_upcast::<M>, chain: chain::<M> }
    }
}

impl<M> Versions<M> {
    /// Decodes `body` as the version its properties say, upcasts it to `M`, and
    /// fingerprints the upcast message; also says which version it was.
    pub(crate) fn decode(
        &self,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Result<(M, Fingerprint, u32), VersionError> {
        let version = version_of(properties)?;
        let (message, fingerprint) = (self.decode)(version, body)?;
        Ok((message, fingerprint, version))
    }

    /// The chain, newest first: `(version, type)` per step; an error names a gap.
    pub(crate) fn chain(&self) -> Result<Vec<(u32, &'static str)>, String> {
        (self.chain)()
    }
}

/// [`decode_version`], and the fingerprint of the upcast message.
fn decode_upcast<M: Versioned>(version: u32, body: &[u8]) -> Result<(M, Fingerprint), VersionError> {
    let message = decode_version::<M>(version, body).map_err(|err| match err {
        VersionError::Decode { version, type_name, source, .. } => {
            VersionError::Decode { version, newest: version == M::VERSION, type_name, source }
        }
        other => other,
    })?;
    let value = serde_json::to_value(&message).map_err(|err| VersionError::Serialize(err.to_string()))?;
    Ok((message, fingerprint::of_value(&value)))
}

/// Why a versioned body could not be read.
#[derive(Debug)]
pub(crate) enum VersionError {
    /// The version header is not a positive integer.
    Header(String),
    /// No step of the chain is that version.
    Unknown { version: u32, oldest: u32, newest: u32, type_name: &'static str },
    /// The body is not a valid message of the version it says it is.
    Decode { version: u32, newest: bool, type_name: &'static str, source: serde_json::Error },
    /// The upcast message does not serialize (for its fingerprint).
    Serialize(String),
}

impl std::fmt::Display for VersionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Header(value) => write!(
                f,
                "the {VERSION_HEADER} header is {value}, not a version number (an integer from 1)"
            ),
            Self::Unknown { version, oldest, newest, type_name } => write!(
                f,
                "version {version} of {type_name} is not one this handler reads (versions {oldest} to {newest}); \
                 publish a version it reads, or add the version to the chain"
            ),
            Self::Decode { version, type_name, source, .. } => {
                write!(f, "the body is not a valid {type_name} message (version {version}): {source}")
            }
            Self::Serialize(err) => {
                write!(f, "the upcast message does not serialize, so it cannot be fingerprinted: {err}")
            }
        }
    }
}

/// The version a delivery's header says (absent: 1).
fn version_of(properties: &BasicProperties) -> Result<u32, VersionError> {
    let Some(value) = amqp_value::header(properties, VERSION_HEADER) else {
        return Ok(1);
    };
    let text = amqp_value::text(value).ok_or_else(|| VersionError::Header(format!("{value:?}")))?;
    match text.trim().parse::<u32>() {
        Ok(version) if version >= 1 => Ok(version),
        _ => Err(VersionError::Header(format!("'{text}'"))),
    }
}

fn is_oldest<M: Versioned>() -> bool {
    TypeId::of::<M::Previous>() == TypeId::of::<M>()
}

fn oldest<M: Versioned>() -> u32 {
    if is_oldest::<M>() {
        M::VERSION
    } else {
        oldest::<M::Previous>()
    }
}

/// Decodes `body` as `version` of `M`'s chain and upcasts it to `M`.
fn decode_version<M: Versioned>(version: u32, body: &[u8]) -> Result<M, VersionError> {
    if version == M::VERSION {
        return serde_json::from_slice(body).map_err(|source| VersionError::Decode {
            version,
            newest: false,
            type_name: std::any::type_name::<M>(),
            source,
        });
    }
    if version > M::VERSION || is_oldest::<M>() {
        return Err(VersionError::Unknown {
            version,
            oldest: oldest::<M>(),
            newest: M::VERSION,
            type_name: std::any::type_name::<M>(),
        });
    }
    decode_version::<M::Previous>(version, body).map(M::upcast)
}

/// `M`'s chain, newest first, checked: each step one version below the last.
fn chain<M: Versioned>() -> Result<Vec<(u32, &'static str)>, String> {
    let here = (M::VERSION, std::any::type_name::<M>());
    if M::VERSION == 0 {
        return Err(format!("{} is version 0; versions start at 1", here.1));
    }
    if is_oldest::<M>() {
        return Ok(vec![here]);
    }
    let previous = <M::Previous as Versioned>::VERSION;
    if previous.checked_add(1) != Some(M::VERSION) {
        return Err(format!(
            "{} is version {} but its previous, {}, is version {previous}: the chain must go down one \
             version per step (add the versions in between, each with `From` the one before)",
            here.1,
            M::VERSION,
            std::any::type_name::<M::Previous>(),
        ));
    }
    let mut rest = chain::<M::Previous>()?;
    rest.insert(0, here);
    Ok(rest)
}

/// The compile-time probes of the handler attribute (autoref specialization, as
/// `anyhow!` tells errors from displayable values): `(&Probe::<M>::new()).method()`
/// finds the `Probe` impl (its `&self` matches the receiver as it is) when `M`
/// implements the trait, and only otherwise the `&Probe` impl (which needs one
/// more autoref). Only ever called with a concrete `M`.
#[doc(hidden)]
pub struct Probe<M>(PhantomData<fn() -> M>);

impl<M> Probe<M> {
    #[allow(clippy::new_without_default)]
    pub const fn new() -> Self {
        Self(PhantomData)
    }
}

#[doc(hidden)]
pub trait NamedProbe {
    fn __idemq_type_name(&self) -> Option<&'static str>;
}
impl<M: MessageType> NamedProbe for Probe<M> {
    fn __idemq_type_name(&self) -> Option<&'static str> {
        Some(M::TYPE)
    }
}

#[doc(hidden)]
pub trait UnnamedProbe {
    fn __idemq_type_name(&self) -> Option<&'static str>;
}
impl<M> UnnamedProbe for &Probe<M> {
    fn __idemq_type_name(&self) -> Option<&'static str> {
        None
    }
}

#[doc(hidden)]
pub trait VersionedProbe<M> {
    fn __idemq_versions(&self) -> Option<Versions<M>>;
}
impl<M: Versioned> VersionedProbe<M> for Probe<M> {
    fn __idemq_versions(&self) -> Option<Versions<M>> {
        Some(Versions::new())
    }
}

#[doc(hidden)]
pub trait UnversionedProbe<M> {
    fn __idemq_versions(&self) -> Option<Versions<M>>;
}
impl<M> UnversionedProbe<M> for &Probe<M> {
    fn __idemq_versions(&self) -> Option<Versions<M>> {
        None
    }
}

#[doc(hidden)]
pub trait SchemaProbe {
    fn __idemq_schema(&self) -> Option<SchemaFn>;
}
#[cfg(feature = "schemars")]
impl<M: schemars::JsonSchema> SchemaProbe for Probe<M> {
    fn __idemq_schema(&self) -> Option<SchemaFn> {
        Some(schema_of::<M>)
    }
}

#[doc(hidden)]
pub trait NoSchemaProbe {
    fn __idemq_schema(&self) -> Option<SchemaFn>;
}
impl<M> NoSchemaProbe for &Probe<M> {
    fn __idemq_schema(&self) -> Option<SchemaFn> {
        None
    }
}

/// `M`'s JSON Schema as the AsyncAPI document holds it: draft 7 (AsyncAPI's schema
/// format is a superset of it), every subschema inlined (a `$ref` would point into
/// the document, not the schema), no `$schema`.
#[cfg(feature = "schemars")]
fn schema_of<M: schemars::JsonSchema>() -> serde_json::Value {
    let settings = schemars::generate::SchemaSettings::draft07().with(|s| s.inline_subschemas = true);
    let mut schema = settings.into_generator().into_root_schema_for::<M>().to_value();
    if let Some(object) = schema.as_object_mut() {
        object.remove("$schema");
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct V1 {
        id: String,
        amount: i64,
    }
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct V2 {
        id: String,
        amount_cents: i64,
        currency: String,
    }
    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    struct V4 {
        id: String,
    }
    impl Versioned for V1 {
        const VERSION: u32 = 1;
        type Previous = Self;
        fn upcast(previous: Self) -> Self {
            previous
        }
    }
    impl Versioned for V2 {
        const VERSION: u32 = 2;
        type Previous = V1;
        fn upcast(v1: V1) -> Self {
            Self { id: v1.id, amount_cents: v1.amount * 100, currency: "EUR".into() }
        }
    }
    impl Versioned for V4 {
        const VERSION: u32 = 4;
        type Previous = V2;
        fn upcast(v2: V2) -> Self {
            Self { id: v2.id }
        }
    }
    impl MessageType for V2 {
        const TYPE: &'static str = "payment.requested";
    }

    fn with_version(value: lapin::types::AMQPValue) -> BasicProperties {
        let mut headers = lapin::types::FieldTable::default();
        headers.insert(VERSION_HEADER.into(), value);
        BasicProperties::default().with_headers(headers)
    }

    #[test]
    fn an_old_version_is_upcast_and_fingerprinted_like_the_new_one() {
        let versions = Versions::<V2>::new();
        let old = with_version(lapin::types::AMQPValue::LongString("1".into()));
        let (from_v1, fp1, v) = versions.decode(&old, br#"{"id":"p","amount":5}"#).unwrap();
        assert_eq!(v, 1);
        let new = with_version(lapin::types::AMQPValue::LongInt(2));
        let (from_v2, fp2, _) =
            versions.decode(&new, br#"{"currency":"EUR","id":"p","amount_cents":500}"#).unwrap();
        assert_eq!(from_v1, from_v2);
        assert_eq!(fp1, fp2, "one payment in two encodings is one fingerprint");
        let other = versions.decode(&old, br#"{"id":"p","amount":6}"#).unwrap().1;
        assert_ne!(fp1, other);
    }

    #[test]
    fn no_header_is_version_1_and_unknown_versions_are_refused() {
        let versions = Versions::<V2>::new();
        let (message, _, version) =
            versions.decode(&BasicProperties::default(), br#"{"id":"p","amount":1}"#).unwrap();
        assert_eq!((message.amount_cents, version), (100, 1));
        let future = with_version(lapin::types::AMQPValue::LongString("3".into()));
        let err = versions.decode(&future, b"{}").unwrap_err().to_string();
        assert!(err.contains("version 3") && err.contains("versions 1 to 2"), "{err}");
        let bad = with_version(lapin::types::AMQPValue::LongString("two".into()));
        assert!(matches!(versions.decode(&bad, b"{}"), Err(VersionError::Header(_))));
        let zero = with_version(lapin::types::AMQPValue::LongString("0".into()));
        assert!(matches!(versions.decode(&zero, b"{}"), Err(VersionError::Header(_))));
    }

    #[test]
    fn an_old_body_that_does_not_decode_names_its_version() {
        let versions = Versions::<V2>::new();
        let old = with_version(lapin::types::AMQPValue::LongString("1".into()));
        let err = versions.decode(&old, br#"{"id":"p"}"#).unwrap_err().to_string();
        assert!(err.contains("V1") && err.contains("version 1") && err.contains("amount"), "{err}");
    }

    #[test]
    fn a_chain_with_a_gap_is_named() {
        assert_eq!(Versions::<V2>::new().chain().unwrap().iter().map(|s| s.0).collect::<Vec<_>>(), [2, 1]);
        let err = Versions::<V4>::new().chain().unwrap_err();
        assert!(err.contains("version 4") && err.contains("version 2"), "{err}");
    }

    #[test]
    #[allow(clippy::needless_borrow)] // the borrow is the probe: it picks the impl
    fn the_probes_find_what_a_type_implements() {
        #[allow(unused_imports)]
        use super::{NamedProbe as _, UnnamedProbe as _, UnversionedProbe as _, VersionedProbe as _};
        assert_eq!((&Probe::<V2>::new()).__idemq_type_name(), Some("payment.requested"));
        assert_eq!((&Probe::<V1>::new()).__idemq_type_name(), None);
        assert!((&Probe::<V2>::new()).__idemq_versions().is_some());
        assert!((&Probe::<String>::new()).__idemq_versions().is_none());
    }
}
