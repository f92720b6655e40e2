//! Deliveries this process held but never started when their channel closed: the
//! broker redelivers them flagged `redelivered`, and a redelivered message runs
//! alone (`alone`: it may be what crashed the last consumer) — one transaction at a
//! time with nothing else of the process running. After a lost connection under a
//! backlog that was up to a whole prefetch (4,096 by default) run one by one, though
//! none of them had reached a handler. A process that is still alive knows which
//! ones it never started: it remembers them here ([`Unstarted::remember`]), and when
//! one comes back ([`Unstarted::take`]) it is taken as a first delivery — nothing
//! of it ran, so it cannot be what crashed anything.
//!
//! What is remembered is a digest of the delivery's queue, exchange, routing key,
//! `message_id` and body (a redelivery carries the same), counted (two copies of
//! one message are two), at most [`MOST`] of them, the oldest forgotten first (a
//! redelivery that went to another consumer never comes back here). A message this
//! process started, and any it never held, still runs alone; a digest collision
//! would only let one redelivered message run in a batch.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use lapin::message::Delivery;

/// The most deliveries remembered (the largest prefetch).
const MOST: usize = 65_536;

/// The deliveries this process held and never started when their channel closed.
#[derive(Debug, Default)]
pub(crate) struct Unstarted {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// How many deliveries with each digest are remembered.
    counts: HashMap<u64, u32>,
    /// The digests in the order remembered, to forget the oldest first.
    order: VecDeque<u64>,
}

impl Unstarted {
    /// Remembers `delivery` of `queue`: held, never started, its channel closed.
    pub(crate) fn remember(&self, queue: &str, delivery: &Delivery) {
        let digest = digest(queue, delivery);
        let mut inner = self.lock();
        *inner.counts.entry(digest).or_default() += 1;
        inner.order.push_back(digest);
        while inner.order.len() > MOST {
            let Some(oldest) = inner.order.pop_front() else { break };
            inner.forget(oldest);
        }
    }

    /// Whether `delivery` of `queue` is one remembered (forgetting it if so).
    pub(crate) fn take(&self, queue: &str, delivery: &Delivery) -> bool {
        let mut inner = self.lock();
        // Nothing remembered (no channel closed): no digest of the body to compute.
        !inner.counts.is_empty() && inner.forget(digest(queue, delivery))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Inner {
    /// Counts one delivery with `digest` off; whether there was one. (Its place in
    /// `order` stays until it is the oldest: forgetting it then finds nothing.)
    fn forget(&mut self, digest: u64) -> bool {
        let Some(count) = self.counts.get_mut(&digest) else { return false };
        *count -= 1;
        if *count == 0 {
            self.counts.remove(&digest);
        }
        true
    }
}

fn digest(queue: &str, delivery: &Delivery) -> u64 {
    // SipHash with fixed keys: the same digest for the same delivery in this process.
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    queue.hash(&mut hasher);
    delivery.exchange.as_str().hash(&mut hasher);
    delivery.routing_key.as_str().hash(&mut hasher);
    delivery.properties.message_id().as_ref().map(|id| id.as_str()).hash(&mut hasher);
    delivery.data.hash(&mut hasher);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use lapin::message::Delivery;

    use super::{Unstarted, MOST};

    fn delivery(tag: u64, body: &str) -> Delivery {
        Delivery::mock(tag, "".into(), "payments".into(), true, body.as_bytes().to_vec())
    }

    #[test]
    fn a_remembered_delivery_is_taken_once_per_copy_and_only_on_its_queue() {
        let unstarted = Unstarted::default();
        unstarted.remember("payments", &delivery(1, "a"));
        unstarted.remember("payments", &delivery(2, "a"));
        assert!(!unstarted.take("orders", &delivery(7, "a")), "another queue");
        assert!(!unstarted.take("payments", &delivery(7, "b")), "another body");
        assert!(unstarted.take("payments", &delivery(7, "a")), "its tag is the broker's new one");
        assert!(unstarted.take("payments", &delivery(8, "a")), "the second copy");
        assert!(!unstarted.take("payments", &delivery(9, "a")), "a third was never held");
    }

    #[test]
    fn past_the_bound_the_oldest_are_forgotten() {
        let unstarted = Unstarted::default();
        unstarted.remember("payments", &delivery(0, "first"));
        for n in 0..MOST {
            unstarted.remember("payments", &delivery(1, &n.to_string()));
        }
        assert!(!unstarted.take("payments", &delivery(2, "first")));
        assert!(unstarted.take("payments", &delivery(2, "0")));
    }
}
