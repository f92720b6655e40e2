//! The host's one private RabbitMQ cluster, lent to this binary's tests one at a
//! time. `idemq::testing::Cluster` holds a host-wide lock while it lives, so two in
//! one process would wait on each other for ever; here one lives at a time, kept
//! between tests of the same shape (starting one takes 10–25 s), torn down when a
//! test asks for another shape, and by the kit's watchdog when the process ends.

use std::ops::Deref;
use std::sync::{Arc, Weak};

use idemq::testing::{Cluster, ClusterBuilder};
use tokio::sync::{Mutex, MutexGuard};

/// The running cluster, named by its shape.
static SLOT: Mutex<Option<(&'static str, Arc<Cluster>)>> = Mutex::const_new(None);

/// A cluster lent to one test: no other test of the process has one meanwhile.
pub(crate) struct Lease(MutexGuard<'static, Option<(&'static str, Arc<Cluster>)>>);

impl Deref for Lease {
    type Target = Cluster;

    fn deref(&self) -> &Cluster {
        &self.0.as_ref().expect("a lease holds a cluster").1
    }
}

impl Lease {
    /// The cluster for code the test cannot hand it to (a handler, a fault hook),
    /// which must not keep it past the lease: the next shape could never start.
    pub(crate) fn weak(&self) -> Weak<Cluster> {
        Arc::downgrade(&self.0.as_ref().expect("a lease holds a cluster").1)
    }
}

/// The cluster `shape` names (`builder` makes it), once the test before has given
/// the slot back: the one kept from an earlier test of that shape, or a new one.
pub(crate) async fn lease(shape: &'static str, builder: impl FnOnce() -> ClusterBuilder) -> Lease {
    let mut slot = SLOT.lock().await;
    if slot.as_ref().is_some_and(|(running, _)| *running != shape) {
        // Dropped: its nodes go, and the host's lock with them.
        *slot = None;
    }
    if slot.is_none() {
        let cluster = builder()
            .start()
            .await
            .unwrap_or_else(|err| panic!("start the private RabbitMQ cluster ({shape}): {err}"));
        *slot = Some((shape, Arc::new(cluster)));
    }
    Lease(slot)
}
