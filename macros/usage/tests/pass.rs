//! What `#[idempotent_handler]` and `#[derive(Message)]` accept: each file of
//! `tests/ui/pass` is a module of this one test binary, and its `main` (its checks:
//! the generated options, keys and lanes) runs as a test.
//!
//! They were trybuild `pass` cases: trybuild builds each in a project of its own,
//! with every dependency compiled again for it (with codegen, since a pass case
//! runs), which was most of the UI tests' minutes. Here they compile with the rest
//! of the tests, and `tests/ui.rs` keeps only the refusals (`cargo check` there).
//! A case that needs a crate of its own (crate-level attributes, a `main` with
//! another signature) belongs in `tests/ui.rs` again.

// As trybuild compiles its cases: examples of what compiles, not code that is used
// (and `pub_in_module` shows `pub` handlers in a module no one outside reaches).
#![allow(dead_code, unreachable_pub)]

#[path = "ui/pass/batch.rs"]
mod batch;

#[path = "ui/pass/call_original.rs"]
mod call_original;

#[path = "ui/pass/context.rs"]
mod context;

#[path = "ui/pass/custom_error.rs"]
mod custom_error;

#[path = "ui/pass/derive_message.rs"]
mod derive_message;

#[path = "ui/pass/impl_trait_error.rs"]
mod impl_trait_error;

#[path = "ui/pass/integer_key.rs"]
mod integer_key;

#[path = "ui/pass/key_forms.rs"]
mod key_forms;

#[path = "ui/pass/key_path_forms.rs"]
mod key_path_forms;

#[path = "ui/pass/lane.rs"]
mod lane;

#[path = "ui/pass/message_by_ref.rs"]
mod message_by_ref;

#[path = "ui/pass/name_override.rs"]
mod name_override;

#[path = "ui/pass/nested_key.rs"]
mod nested_key;

#[path = "ui/pass/option_key.rs"]
mod option_key;

#[path = "ui/pass/options.rs"]
mod options;

#[path = "ui/pass/permanent_error.rs"]
mod permanent_error;

#[path = "ui/pass/pub_in_module.rs"]
mod pub_in_module;

#[path = "ui/pass/returns_a_result.rs"]
mod returns_a_result;

#[path = "ui/pass/saga.rs"]
mod saga;

#[path = "ui/pass/string_key.rs"]
mod string_key;

#[path = "ui/pass/uuid_key.rs"]
mod uuid_key;

#[test]
fn batch_is_accepted() {
    batch::main();
}

#[test]
fn call_original_is_accepted() {
    call_original::main();
}

#[test]
fn context_is_accepted() {
    context::main();
}

#[test]
fn custom_error_is_accepted() {
    custom_error::main();
}

#[test]
fn derive_message_is_accepted() {
    derive_message::main();
}

#[test]
fn impl_trait_error_is_accepted() {
    impl_trait_error::main();
}

#[test]
fn integer_key_is_accepted() {
    integer_key::main();
}

#[test]
fn key_forms_is_accepted() {
    key_forms::main();
}

#[test]
fn key_path_forms_is_accepted() {
    key_path_forms::main();
}

#[test]
fn lane_is_accepted() {
    lane::main();
}

#[test]
fn message_by_ref_is_accepted() {
    message_by_ref::main();
}

#[test]
fn name_override_is_accepted() {
    name_override::main();
}

#[test]
fn nested_key_is_accepted() {
    nested_key::main();
}

#[test]
fn option_key_is_accepted() {
    option_key::main();
}

#[test]
fn options_is_accepted() {
    options::main();
}

#[test]
fn permanent_error_is_accepted() {
    permanent_error::main();
}

#[test]
fn pub_in_module_is_accepted() {
    pub_in_module::main();
}

#[test]
fn returns_a_result_is_accepted() {
    returns_a_result::main();
}

#[test]
fn a_saga_and_its_steps_are_accepted() {
    saga::main();
}

#[test]
fn string_key_is_accepted() {
    string_key::main();
}

#[test]
fn uuid_key_is_accepted() {
    uuid_key::main();
}
