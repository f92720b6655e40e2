//! Partitioned streams: N streams behind one exchange, so N processes share a
//! handler's work, each stream in order.

use std::time::Duration;

use sha2::{Digest, Sha256};

use super::topology::{Exchange, Queue, Topology};

/// A handler's streams, `<name>.0` … `<name>.<count - 1>`, behind the direct exchange
/// `<name>`, each bound with its number as routing key. A publisher routes a message
/// to the partition of a key ([`routing_key`](Self::routing_key)), so every message
/// of one key lands in one stream, in order. Partition by what the handler's writes
/// share (an account, as a lane would), not by message id: two streams whose
/// transactions update one row wait on each other's locks.
///
/// Declared with [`Topology::partitions`](crate::Topology::partitions) and consumed
/// with [`RuntimeBuilder::consume_partitions`](crate::RuntimeBuilder::consume_partitions).
/// Each stream has one active consumer at a time (its owner), and the processes
/// that consume them share them fairly: each owns `ceil(count / processes)` at most,
/// gives one up when another process starts, and takes one over when a process
/// stops. See the crate docs, *Streams*.
///
/// ```
/// # use std::time::Duration;
/// # use idemq::{Partitions, Topology};
/// let payments = Partitions::new("payments.partitioned", 4).max_age(Duration::from_secs(7 * 86_400));
/// let topology = Topology::new().partitions(payments.clone());
/// assert_eq!(payments.stream(2), "payments.partitioned.2");
/// // A publisher sends each payment to its account's partition:
/// // publisher.publish(payments.name(), &payments.routing_key(&payment.account), &payment)
/// let partition = payments.partition_of("pay_1");
/// assert_eq!(payments.routing_key("pay_1"), partition.to_string());
/// # let _ = topology;
/// ```
#[derive(Debug, Clone)]
#[must_use = "partitions do nothing until added to a Topology and consumed"]
pub struct Partitions {
    name: String,
    count: u16,
    /// Each stream's settings, its name aside.
    template: Queue,
}

impl Partitions {
    /// `count` streams (at least 1) named `<name>.<n>`, behind the direct exchange
    /// `<name>`.
    pub fn new(name: impl Into<String>, count: u16) -> Self {
        let name = name.into();
        Self { template: Queue::stream(name.clone()), name, count: count.max(1) }
    }

    /// Each stream's retention by age (see [`Queue::max_age`]).
    pub fn max_age(mut self, age: Duration) -> Self {
        self.template = self.template.max_age(age);
        self
    }

    /// Each stream's retention by size (see [`Queue::max_length_bytes`]).
    pub fn max_length_bytes(mut self, bytes: u64) -> Self {
        self.template = self.template.max_length_bytes(bytes);
        self
    }

    /// The exchange's name (and the streams' prefix).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How many streams.
    pub fn count(&self) -> u16 {
        self.count
    }

    /// The name of stream number `partition`: `<name>.<partition>`.
    pub fn stream(&self, partition: u16) -> String {
        format!("{}.{partition}", self.name)
    }

    /// Every stream's name, in order.
    pub fn streams(&self) -> impl Iterator<Item = String> + '_ {
        (0..self.count).map(|partition| self.stream(partition))
    }

    /// The partition of `key`: the first 8 bytes of the key's SHA-256, big-endian,
    /// modulo the count. Stable across processes, versions and languages, so a
    /// publisher written in anything can compute it.
    pub fn partition_of(&self, key: &str) -> u16 {
        let digest = Sha256::digest(key.as_bytes());
        let mut bytes = [0_u8; 8];
        bytes.copy_from_slice(&digest[..8]);
        let partition = u64::from_be_bytes(bytes) % u64::from(self.count);
        u16::try_from(partition).unwrap_or_default()
    }

    /// The routing key that sends a message of `key` to its partition (its number).
    pub fn routing_key(&self, key: &str) -> String {
        self.partition_of(key).to_string()
    }

    /// The exchange to declare.
    pub(crate) fn exchange(&self) -> Exchange {
        Exchange::direct(self.name.clone())
    }

    /// The streams to declare, each bound to the exchange by its number.
    pub(crate) fn queues(&self) -> impl Iterator<Item = Queue> + '_ {
        (0..self.count).map(|partition| {
            self.template.renamed(self.stream(partition)).bind(self.name.clone(), partition.to_string())
        })
    }
}

impl Topology {
    /// Adds partitioned streams: their direct exchange and each stream (with its
    /// dead-letter queue), bound by its number. See [`Partitions`].
    pub fn partitions(mut self, partitions: Partitions) -> Self {
        if !self.exchanges.iter().any(|exchange| exchange.name() == partitions.name()) {
            self.exchanges.push(partitions.exchange());
        }
        self.queues.extend(partitions.queues());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_always_lands_in_the_same_partition() {
        let four = Partitions::new("p", 4);
        let again = Partitions::new("other", 4);
        for key in ["pay_1", "pay_2", "ü", ""] {
            assert_eq!(four.partition_of(key), again.partition_of(key));
            assert!(four.partition_of(key) < 4);
        }
    }

    #[test]
    fn the_partition_is_what_another_language_computes() {
        // Python: int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % count
        let thousand = Partitions::new("p", 1000);
        assert_eq!(thousand.partition_of("pay_1"), 53);
        assert_eq!(thousand.partition_of("pay_2"), 591);
        assert_eq!(thousand.partition_of("order-42"), 703);
        assert_eq!(Partitions::new("p", 4).routing_key("pay_2"), "3");
    }

    #[test]
    fn keys_spread_over_every_partition() {
        let four = Partitions::new("p", 4);
        let mut seen = [0_u32; 4];
        for n in 0..400 {
            seen[usize::from(four.partition_of(&format!("pay_{n}")))] += 1;
        }
        assert!(seen.iter().all(|&n| n > 50), "{seen:?}");
    }

    #[test]
    fn streams_are_named_by_number_and_bound_by_it() {
        let two = Partitions::new("payments.partitioned", 2);
        assert_eq!(two.streams().collect::<Vec<_>>(), ["payments.partitioned.0", "payments.partitioned.1"]);
        let queues: Vec<_> = two.queues().collect();
        assert_eq!(queues[1].name(), "payments.partitioned.1");
        assert_eq!(queues[1].dead_letter_name(), "payments.partitioned.1.dlq");
        assert!(queues.iter().all(Queue::is_stream));
        assert_eq!(Partitions::new("p", 0).count(), 1, "at least one");
    }
}
