//! How many batches of one consumer run at once: its *width*. Batches of a handler
//! without a lane may lock the same hot rows and deadlock each other; idemq cannot
//! know what a handler locks, so it watches for collisions instead.
//!
//! Additive increase, multiplicative decrease: a collision (a lock wait past the
//! batch limit, a deadlock) halves the width; it grows by one after `width × probe`
//! whole batches, and every collision doubles `probe` (up to [`MAX_PROBE`]). Where
//! batches keep colliding a wider try comes ever more rarely; where they never do,
//! the width stays at the runtime's concurrency. It starts full: slow handlers run
//! side by side from the start.

use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Notify;

/// The most rounds of whole batches a consumer whose batches collided waits before
/// it tries one more batch at once.
const MAX_PROBE: usize = 256;

/// One consumer's width, and its batches running now.
#[derive(Debug)]
pub(crate) struct Width {
    /// The widest it may be: the runtime's concurrency.
    max: usize,
    width: AtomicUsize,
    running: AtomicUsize,
    /// Told when a batch ends.
    finished: Notify,
    /// Whole batches since the width last changed.
    clean: AtomicUsize,
    probe: AtomicUsize,
}

impl Width {
    pub(crate) fn new(max: usize) -> Self {
        let max = max.max(1);
        Self {
            max,
            width: AtomicUsize::new(max),
            running: AtomicUsize::new(0),
            finished: Notify::new(),
            clean: AtomicUsize::new(0),
            probe: AtomicUsize::new(1),
        }
    }

    /// How many batches may run at once now.
    pub(crate) fn current(&self) -> usize {
        self.width.load(Ordering::Relaxed).clamp(1, self.max)
    }

    /// Waits until fewer than [`Self::current`] batches run, then counts one more;
    /// [`Self::release`] counts it off.
    pub(crate) async fn acquire(&self) {
        loop {
            let finished = self.finished.notified();
            tokio::pin!(finished);
            finished.as_mut().enable();
            let running = self.running.load(Ordering::Acquire);
            if running < self.current() {
                if self
                    .running
                    .compare_exchange(running, running + 1, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            finished.await;
        }
    }

    /// Slots free for more batches now.
    pub(crate) fn free(&self) -> usize {
        self.current().saturating_sub(self.running.load(Ordering::Acquire))
    }

    pub(crate) fn release(&self) {
        self.running.fetch_sub(1, Ordering::AcqRel);
        self.finished.notify_waiters();
    }

    /// Learns from a batch that ended: `split` if it had to be run again smaller,
    /// `contended` if that was because its transactions collided.
    pub(crate) fn adapt(&self, split: bool, contended: bool) {
        let width = self.current();
        if contended {
            self.width.store((width / 2).max(1), Ordering::Relaxed);
            self.clean.store(0, Ordering::Relaxed);
            let probe = self.probe.load(Ordering::Relaxed);
            self.probe.store((probe * 2).clamp(1, MAX_PROBE), Ordering::Relaxed);
        } else if !split && width < self.max {
            let clean = self.clean.fetch_add(1, Ordering::Relaxed) + 1;
            if clean >= width * self.probe.load(Ordering::Relaxed).max(1) {
                self.clean.store(0, Ordering::Relaxed);
                self.width.store(width + 1, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Width;

    #[test]
    fn collisions_halve_the_width_and_make_wider_tries_ever_rarer() {
        let width = Width::new(16);
        assert_eq!(width.current(), 16, "it starts full");
        width.adapt(true, true);
        width.adapt(true, true);
        assert_eq!(width.current(), 4);
        // probe is 4 now: one step wider takes width × probe = 16 whole batches.
        for _ in 0..15 {
            width.adapt(false, false);
        }
        assert_eq!(width.current(), 4);
        width.adapt(false, false);
        assert_eq!(width.current(), 5);
        // A split that was not a collision (a failing handler) changes nothing.
        width.adapt(true, false);
        assert_eq!(width.current(), 5);
        for _ in 0..5 {
            width.adapt(true, true);
        }
        assert_eq!(width.current(), 1, "never below one");
    }
}
