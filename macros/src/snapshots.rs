//! Snapshot tests of the generated code for the main forms: the expansion,
//! pretty-printed, against `tests/expand/<name>.rs`. Regenerate with
//! `IDEMQ_BLESS=1 cargo test -p idemq-macros --lib` and review the diff.

use std::path::PathBuf;

use proc_macro2::TokenStream;
use quote::quote;

fn check(name: &str, attr: TokenStream, item: TokenStream) {
    let expanded = crate::expand::idempotent_handler(attr, item);
    let file = syn::parse2::<syn::File>(expanded).expect("the expansion parses as a file");
    let pretty = prettyplease::unparse(&file);
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/expand").join(format!("{name}.rs"));
    if std::env::var_os("IDEMQ_BLESS").is_some() {
        std::fs::write(&path, &pretty).expect("write the snapshot");
        return;
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|_| panic!("no snapshot {}: run with IDEMQ_BLESS=1", path.display()));
    assert!(
        expected == pretty,
        "the expansion of `{name}` changed; run with IDEMQ_BLESS=1 and review the diff of {}\n{pretty}",
        path.display()
    );
}

#[test]
fn a_field_path_key() {
    check(
        "field_path",
        quote!(key = "payment_id"),
        quote! {
            /// Applies a payment.
            async fn apply_payment(conn: &mut AsyncPgConnection, msg: PaymentRequested) -> Result<(), Error> {
                Ok(())
            }
        },
    );
}

#[test]
fn a_template_key_with_a_context_and_a_result() {
    check(
        "template_context_result",
        quote!(key = "{tenant}:{@header:x-order}", lane = "tenant"),
        quote! {
            async fn place(conn: &mut AsyncPgConnection, ctx: &mut Context, msg: &OrderPlaced) -> Result<Receipt, HandlerError> {
                Ok(Receipt)
            }
        },
    );
}

#[test]
fn a_key_fn_and_the_options() {
    check(
        "key_fn_options",
        quote!(
            key_fn = order_key,
            queue = "orders",
            retry(delays = ["1s", "5m"]),
            on_conflict = "ignore",
            batch = 8
        ),
        quote! {
            async fn ship(conn: &mut AsyncPgConnection, msg: OrderPlaced) -> Result<(), HandlerError> {
                Ok(())
            }
        },
    );
}

#[test]
fn no_dedup_and_a_key_from_the_type() {
    check(
        "no_dedup",
        quote!(dedup = false),
        quote! {
            async fn upsert(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
                Ok(())
            }
        },
    );
    check(
        "key_from_type",
        quote!(),
        quote! {
            async fn refund(conn: &mut AsyncPgConnection, msg: Refund) -> Result<(), HandlerError> {
                Ok(())
            }
        },
    );
}

#[test]
fn a_batch_handler() {
    check(
        "batch",
        quote!(key = "payment_id", lane = "account"),
        quote! {
            /// Applies payments, a transaction's at once.
            async fn apply_payment(conn: &mut AsyncPgConnection, batch: &mut idemq::Batch<PaymentRequested>) -> Result<(), HandlerError> {
                Ok(())
            }
        },
    );
    check(
        "batch_results",
        quote!(key = "payment_id"),
        quote! {
            async fn apply_payment(conn: &mut AsyncPgConnection, batch: &mut Batch<PaymentRequested>) -> Result<Vec<Receipt>, Error> {
                Ok(Vec::new())
            }
        },
    );
}

#[test]
fn a_saga_step_that_starts_its_saga() {
    check(
        "saga_step",
        quote!(key = "order_id", saga(start)),
        quote! {
            async fn order_placed(
                conn: &mut AsyncPgConnection,
                msg: OrderPlaced,
                saga: &mut Saga<Order>,
                ctx: &mut Context,
            ) -> Result<(), HandlerError> {
                Ok(())
            }
        },
    );
}
