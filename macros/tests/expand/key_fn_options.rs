/// Idempotent handler `ship` (dedup key `key_fn order_key`); register it with the runtime. The original fn is [`ship::call`].
#[allow(non_camel_case_types)]
#[derive(
    ::core::fmt::Debug,
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::default::Default
)]
struct ship;
impl ship {
    /// The fn `ship` as written, for unit tests; the runtime calls it through `idemq::Handler`, inside its transaction.
    async fn call(
        conn: &mut AsyncPgConnection,
        msg: OrderPlaced,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}
impl ::idemq::Handler for ship {
    type Message = OrderPlaced;
    fn name(&self) -> &'static str {
        "ship"
    }
    fn key_path(&self) -> &'static str {
        "key_fn order_key"
    }
    fn key(
        &self,
        __idemq_message: &<Self as ::idemq::Handler>::Message,
        __idemq_metadata: &::idemq::Metadata<'_>,
    ) -> ::core::result::Result<::idemq::Key, ::idemq::key::KeyError> {
        let _ = __idemq_metadata;
        let __idemq_keyed = __idemq_message;
        ::idemq::key::KeyFn::key(&order_key, __idemq_message, __idemq_metadata)
    }
    fn queue(&self) -> ::core::option::Option<&'static str> {
        ::core::option::Option::Some("orders")
    }
    fn retry(&self) -> ::core::option::Option<::idemq::RetryPolicy> {
        ::core::option::Option::Some(
            ::idemq::RetryPolicy::new([
                ::core::time::Duration::from_millis(1000u64),
                ::core::time::Duration::from_millis(300000u64),
            ]),
        )
    }
    fn on_conflict(&self) -> ::core::option::Option<::idemq::OnConflict> {
        ::core::option::Option::Some(::idemq::OnConflict::Ignore)
    }
    fn batch_size(&self) -> ::core::option::Option<usize> {
        ::core::option::Option::Some(8usize)
    }
    #[allow(clippy::needless_borrow)]
    fn wire(&self) -> ::idemq::__private::Wire<<Self as ::idemq::Handler>::Message> {
        #[allow(unused_imports)]
        use ::idemq::__private::{
            __IdemqNamedProbe as _, __IdemqNoSchemaProbe as _, __IdemqSchemaProbe as _,
            __IdemqUnnamedProbe as _, __IdemqUnversionedProbe as _,
            __IdemqVersionedProbe as _,
        };
        let probe = ::idemq::__private::__IdemqProbe::<
            <Self as ::idemq::Handler>::Message,
        >::new();
        ::idemq::__private::Wire::of(
            (&probe).__idemq_type_name(),
            (&probe).__idemq_versions(),
            (&probe).__idemq_schema(),
        )
    }
    fn handle<'__idemq_a>(
        &'__idemq_a self,
        __idemq_conn: &'__idemq_a mut ::idemq::__private::AsyncPgConnection,
        __idemq_ctx: &'__idemq_a mut ::idemq::Context,
        __idemq_message: <Self as ::idemq::Handler>::Message,
    ) -> ::idemq::BoxFuture<
        '__idemq_a,
        ::core::result::Result<::idemq::HandlerOutput, ::idemq::HandlerError>,
    > {
        let __idemq_conn = <&mut AsyncPgConnection as ::idemq::__private::__IdemqConnection<
            '_,
        >>::__idemq_connection(__idemq_conn);
        let _ = __idemq_ctx;
        ::std::boxed::Box::pin(async move {
            let result = ship::call(__idemq_conn, __idemq_message).await;
            match <Result<
                (),
                HandlerError,
            > as ::idemq::__private::__IdemqResult<_, _>>::__idemq_result(result) {
                ::core::result::Result::Ok(value) => {
                    ::idemq::__private::__IdemqOutput::__idemq_output(&value)
                }
                ::core::result::Result::Err(error) => {
                    ::core::result::Result::Err(
                        ::idemq::__private::__IdemqError::__idemq_error(error),
                    )
                }
            }
        })
    }
}
