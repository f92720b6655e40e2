//! The one error collector (like serde's `Ctxt`): every check pushes its error and
//! goes on, so the user sees all of them at once; `finish` combines them.

/// Errors collected while parsing and validating.
#[derive(Default)]
pub(crate) struct Errors(Option<syn::Error>);

impl Errors {
    /// Records an error.
    pub(crate) fn push(&mut self, error: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    /// Records the error of a result and returns its value, if any.
    pub(crate) fn take<T>(&mut self, result: syn::Result<T>) -> Option<T> {
        result.map_err(|error| self.push(error)).ok()
    }

    /// `Ok(value)` when nothing was recorded, else every error combined.
    pub(crate) fn finish<T>(self, value: impl FnOnce() -> T) -> syn::Result<T> {
        match self.0 {
            Some(errors) => Err(errors),
            None => Ok(value()),
        }
    }
}
