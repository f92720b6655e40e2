//! A connection the pool hands out: diesel-async's connection (what handlers get,
//! through `Deref`), with what its server said and how to cancel its statement.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use diesel_async::AsyncPgConnection;
use tokio_util::sync::DropGuard;

use crate::tls::postgres::wire::{Mark, Sent, WireLog};
use crate::tls::postgres::Canceller;

/// A PostgreSQL connection idemq made (see [`open`](super::connect::open)):
/// diesel-async's connection, the SQLSTATEs its server sent (read off the wire:
/// diesel-async keeps none), and its cancel request. Dropped, its socket closes at
/// once.
pub(crate) struct Conn {
    pg: AsyncPgConnection,
    wire: Arc<WireLog>,
    canceller: Canceller,
    /// Stops the connection's driver when this is dropped.
    driver: DropGuard,
}

impl Conn {
    pub(super) fn new(
        pg: AsyncPgConnection,
        wire: Arc<WireLog>,
        canceller: Canceller,
        driver: DropGuard,
    ) -> Self {
        Self { pg, wire, canceller, driver }
    }

    /// The point after every error the server sent so far: [`Self::sent_since`] it
    /// tells what a statement run after it met.
    pub(crate) fn mark(&self) -> Mark {
        self.wire.mark()
    }

    /// The SQLSTATEs of the errors the server sent since `mark`, oldest first.
    pub(crate) fn sent_since(&self, mark: Mark) -> Sent {
        self.wire.since(mark)
    }

    /// What cancels the statement running on this connection (from anywhere).
    pub(crate) fn canceller(&self) -> Canceller {
        self.canceller.clone()
    }

    /// The diesel-async connection alone: it lives as long as its client, no longer
    /// closed at once when dropped.
    pub(crate) fn into_inner(self) -> AsyncPgConnection {
        let Self { pg, driver, .. } = self;
        driver.disarm();
        pg
    }
}

impl Deref for Conn {
    type Target = AsyncPgConnection;

    fn deref(&self) -> &AsyncPgConnection {
        &self.pg
    }
}

impl DerefMut for Conn {
    fn deref_mut(&mut self) -> &mut AsyncPgConnection {
        &mut self.pg
    }
}
