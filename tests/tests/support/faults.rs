//! Fault hooks shared by the test modules (`crate::support::faults`).
//! They need idemq's `testing` feature, which only the test targets have (a
//! dev-dependency's feature): in `idemq-tests`'s library, `cargo build --workspace`
//! would not compile them.

use std::sync::Arc;

/// A fault hook that closes the channel once, after the first COMMIT of an applied
/// delivery and before its ack (the ack is lost with the channel); and whether it
/// fired.
pub(crate) fn lose_the_first_ack() -> (idemq::testing::fault::FaultHook, Arc<std::sync::atomic::AtomicBool>) {
    use idemq::testing::fault::{FaultContext, FaultPoint};
    use std::sync::atomic::{AtomicBool, Ordering};
    let fired = Arc::new(AtomicBool::new(false));
    let fired_in_hook = Arc::clone(&fired);
    let hook: idemq::testing::fault::FaultHook = Arc::new(move |ctx: FaultContext| {
        let fired = Arc::clone(&fired_in_hook);
        Box::pin(async move {
            if ctx.point == FaultPoint::AfterCommit
                && ctx.outcome == idemq::Outcome::Applied
                && !fired.swap(true, Ordering::SeqCst)
            {
                ctx.channel
                    .close(200, "fault: channel lost after commit".into())
                    .await
                    .expect("close the channel");
            }
        })
    });
    (hook, fired)
}
