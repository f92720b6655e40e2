//! The checks [`RuntimeBuilder::build`] makes of the handlers it was given: each
//! queue consumed once, by a handler that agrees on its name, and handler names
//! that can scope dedup rows.

use super::builder::Registration;
use super::RuntimeBuilder;
use crate::error::Error;

impl RuntimeBuilder {
    /// Each handler's queue: named by the handler or at registration, not both
    /// differently.
    pub(super) fn check_handler_queues(&self) -> Result<(), Error> {
        for Registration { queue, handler, .. } in &self.consumers {
            match handler.queue() {
                None if queue.is_empty() => {
                    return Err(Error::Config(format!(
                        "handler `{}` names no queue: give it one with #[idempotent_handler(queue = \"...\")], \
                         or register it with `.consume(queue, handler)`",
                        handler.type_path()
                    )));
                }
                Some(own) if own != queue => {
                    return Err(Error::Config(format!(
                        "handler `{}` consumes queue '{own}' (its `queue = ...`), but is registered for '{queue}'; \
                         register it with `.handler(h)`, or drop its `queue` option",
                        handler.type_path()
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// One handler per queue.
    pub(super) fn check_unique_queues(&self) -> Result<(), Error> {
        let mut seen = std::collections::HashSet::new();
        for Registration { queue, .. } in &self.consumers {
            if !seen.insert(queue.as_str()) {
                return Err(Error::Config(format!(
                    "queue '{queue}' has two consumers; give each queue one handler"
                )));
            }
        }
        Ok(())
    }

    /// Handler names: usable as a dedup scope, and one per handler type.
    pub(super) fn check_handler_names(&self) -> Result<(), Error> {
        // The name scopes dedup rows: two handlers sharing one would share rows, and
        // the second's messages would be acked as duplicates without ever running.
        // The same handler on two queues is one handler (its rows are shared on
        // purpose: a key applied from either queue is applied).
        let mut names: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        for Registration { handler, .. } in &self.consumers {
            let (name, path) = (handler.name(), handler.type_path());
            if name.is_empty() || name.contains('/') {
                return Err(Error::Config(format!(
                    "handler `{path}` is named {name:?}; a handler name must be non-empty and hold no '/': \
                     set another with #[idempotent_handler(name = \"...\")]"
                )));
            }
            match names.insert(name, path) {
                Some(other) if other != path => {
                    return Err(Error::Config(format!(
                        "handlers `{other}` and `{path}` are both named `{name}`, so they would share one dedup \
                         namespace and one's messages would be acked as duplicates of the other's; give each a \
                         stable name of its own with #[idempotent_handler(name = \"...\")]"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }
}
