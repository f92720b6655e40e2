//! RabbitMQ through lapin: the broker addresses, the topology, acks, dead letters
//! and copies, the `consumer_timeout` check, whether lapin's parser is patched, and
//! the [`Publisher`](crate::Publisher).

pub(crate) mod acks;
pub(crate) mod asyncapi;
pub(crate) mod brokers;
pub(crate) mod consumer_timeout;
pub(crate) mod dead_letter;
pub(crate) mod exchanges;
pub(crate) mod parser;
pub(crate) mod partitions;
pub(crate) mod publisher;
pub(crate) mod stream_end;
pub(crate) mod topology;
